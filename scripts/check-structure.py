#!/usr/bin/env python3
"""Structure gate: no import loop between source files, no source file over the size limit.

A file "imports" another when it names an item of the other's module through a path
(`use crate::a::b::X`, `crate::a::f()`, `super::X`, `self::b::X`, or `b::X` for a child module
`b`). Paths are resolved to the longest module prefix that has
a file (`a.rs`, `a/b.rs`, `lib.rs`, `main.rs`). A loop is a strongly connected set of two
or more files; `mod foo;` declarations alone are not imports, and an inline unit-test module
(`#[cfg(test)] mod tests { .. }`) is not part of its file's structure.

Usage: scripts/check-structure.py [--max-lines N] [--verbose]
Exit 1 when a loop or an oversized file is found.
"""

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# Crate roots: (crate name as used in paths, src directory).
PATH_RE = re.compile(r"\b((?:crate|super|self|prism_[a-z_]+)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
# A path that starts with a child module's name (`weights::upload`, `use tp::CudaTpBackend`).
REL_RE = re.compile(r"(?<![:\w])([a-z_][a-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP_RE = re.compile(r"\buse\s+((?:crate|super|self|prism_[a-z_]+)(?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\};", re.S)


def crates():
    out = subprocess.run(["cargo", "metadata", "--no-deps", "--format-version", "1"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    import json
    meta = json.loads(out)
    result = []
    for pkg in meta["packages"]:
        name = pkg["name"].replace("-", "_")
        for t in pkg["targets"]:
            if "lib" in t["kind"] or "bin" in t["kind"]:
                src = t["src_path"]
                result.append((name if "lib" in t["kind"] else None, os.path.dirname(src), src))
    return result


def module_files(src_dir, root_file):
    """Maps module paths (tuples) to files for one crate target."""
    mods = {(): root_file}
    for dirpath, _, files in os.walk(src_dir):
        for f in files:
            if not f.endswith(".rs"):
                continue
            full = os.path.join(dirpath, f)
            if full == root_file or f in ("main.rs", "lib.rs") and dirpath == src_dir:
                continue
            rel = os.path.relpath(full, src_dir)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            if "bin" == rel[0] or rel[0] in ("tests", "benches", "examples"):
                continue
            mods[tuple(rel)] = full
    return mods


def strip_comments(text):
    # A unit-test module (`#[cfg(test)] mod tests { ... }`, by convention at the end of its file)
    # may exercise its module together with others; it is not part of the module's structure.
    m = re.search(r"^#\[cfg\(test\)\]\s*\n\s*mod \w+ \{", text, flags=re.M)
    if m:
        text = text[: m.start()]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def resolve(mods, parts):
    """Longest module prefix of `parts` that has a file."""
    for n in range(len(parts), -1, -1):
        if tuple(parts[:n]) in mods:
            return mods[tuple(parts[:n])]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-lines", type=int, default=800)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()

    edges = {}
    lib_mods = {}
    targets = crates()
    for name, src_dir, root in targets:
        if name:
            lib_mods[name] = module_files(src_dir, root)
    bad = False
    for name, src_dir, root in targets:
        mods = lib_mods.get(name) or module_files(src_dir, root)
        inv = {v: k for k, v in mods.items()}
        for f, modpath in inv.items():
            text = strip_comments(open(f, encoding="utf-8").read())
            paths = [m.group(1) for m in PATH_RE.finditer(text)]
            for m in REL_RE.finditer(text):
                if m.group(1) not in ("crate", "super", "self") and tuple(modpath) + (m.group(1),) in mods:
                    paths.append("self::" + m.group(1) + m.group(2))
            for g in USE_GROUP_RE.finditer(text):
                for item in re.split(r"[,\s]+", re.sub(r"\{[^}]*\}", "", g.group(2))):
                    item = item.strip()
                    if item and item not in ("self", "*") and re.match(r"^[A-Za-z_][A-Za-z0-9_:]*$", item):
                        paths.append(g.group(1) + "::" + item)
            for p in paths:
                parts = p.split("::")
                # test modules (`mod tests`) inside a file use super:: freely: they are the file itself.
                base = list(modpath)
                if parts[0] == "crate":
                    target_mods, rest = mods, parts[1:]
                elif parts[0] in lib_mods and parts[0] != name:
                    continue  # another crate: crate dependencies cannot loop
                elif parts[0] == "self":
                    target_mods, rest = mods, base + parts[1:]
                elif parts[0] == "super":
                    up = base[:]
                    i = 0
                    while i < len(parts) and parts[i] == "super":
                        up = up[:-1]
                        i += 1
                    target_mods, rest = mods, up + parts[i:]
                else:
                    continue
                tgt = resolve(target_mods, rest)
                if tgt and tgt != f:
                    edges.setdefault(f, set()).add(tgt)

    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            strong(v)
    for comp in sccs:
        bad = True
        names = sorted(os.path.relpath(c, ROOT) for c in comp)
        print("import loop: " + " <-> ".join(names))
        if args.verbose:
            for a in comp:
                for b in comp:
                    if b in edges.get(a, ()):
                        print(f"  {os.path.relpath(a, ROOT)} -> {os.path.relpath(b, ROOT)}")

    tracked = subprocess.run(["git", "ls-files", "*.rs"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in tracked:
        n = sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8"))
        if n > args.max_lines:
            bad = True
            print(f"file over {args.max_lines} lines: {f} ({n})")
        if os.path.basename(f) == "mod.rs":
            bad = True
            print(f"mod.rs module file (use foo.rs + foo/): {f}")
    if not bad:
        print(f"structure ok: no import loop, no file over {args.max_lines} lines, no mod.rs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
