#!/usr/bin/env bash
# The README's first command: from a fresh clone on Debian with the Rust toolchain,
# install the build dependencies, fetch the bundled model, build Prism (release), start
# `prism up` and stream an answer to "What is the capital of France?". The server keeps
# running afterwards (curl it from another terminal); Ctrl-C stops it.
# Extra arguments go to `prism up` (e.g. --port 9000, --model PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install Rust from https://rustup.rs" >&2; exit 1; }
./scripts/install-deps.sh
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || ./scripts/fetch-model.sh
cargo build --release --bins
exec ./target/release/prism up --demo "$@"
