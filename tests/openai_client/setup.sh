#!/usr/bin/env bash
# Creates (once) the Python virtual environment of the OpenAI-client acceptance test
# (tests/openai_client/test_openai_client.py): the official `openai` package at the exact
# version pinned in requirements.txt. Idempotent: later runs only check the venv, and a
# changed pin reinstalls. Needs PyPI (or a configured index) the first time.
#
#   tests/openai_client/setup.sh       # prints the venv's python on success
#
# Exit status: 0 ready; 3 could not install (no index reachable).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${PRISM_OPENAI_VENV:-$repo/target/openai-venv}"
req="$here/requirements.txt"
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
# Tests run in parallel: one installer at a time, the others wait and reuse.
exec 9>"$venv.lock"
flock 9
stamp="$venv/.requirements"
if [ -x "$py" ] && [ -f "$stamp" ] && cmp -s "$req" "$stamp" && "$py" -c 'import openai' 2>/dev/null; then
  echo "$py"
  exit 0
fi
[ -x "$py" ] || python3 -m venv "$venv" >&2
if ! "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2; then
  echo "setup.sh: could not install $req (offline?)" >&2
  exit 3
fi
cp "$req" "$stamp"
echo "$py"
