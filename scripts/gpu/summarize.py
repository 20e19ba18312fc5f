#!/usr/bin/env python3
"""The summary of one GPU run: the figures of every JSON result and log in a run's output folder,
in one small `summary.json`. The summary is what gets committed (`bench/cuda/runN/summary.json`);
the full logs and raw JSON stay in the output folder, which git ignores (`bench/out/`).

What goes in:
- `meta`: date, machine and commit (from the `machine.txt` the run scripts write, else from the
  flags), the commands, a note, the files the summary was built from (name and size) and the
  arrays left out of them (path and length).
- `results.NAME`: each `NAME.json` with its bulky arrays left out (lists of more than 16 numbers,
  such as logits and token ids; lists of lists; lists of more than 16 records, such as per-request
  timings and the per-case records of the kernel checks). Every value that stays is copied as written: no number is rounded or recomputed.
  `trace.json` is an input (make_trace.py's requests) and is skipped.
- `results.hf_reference`: the JSON lines that hf_reference.py prints (its reference.json, with the
  logits, stays in the model directory).
- `verdicts.NAME`: the last `tool: ...` line of `NAME.log` (PASS / FAIL and what it says with it,
  or why a step was skipped).
- `log.NAME`: the lines of `NAME.log` / `NAME.txt` that state a result a JSON does not hold:
  header lines (device, init time, KV size, model shape), totals, timings, SUMMARY lines and
  Python errors. Per-case lines (already in the JSON), progress bars and training steps are left out.

Usage: python3 scripts/gpu/summarize.py OUT_DIR [--out FILE] [--command CMD]... [--date D]
       [--machine M] [--commit C] [--note TEXT]
(--out defaults to OUT_DIR/summary.json; the flags override what machine.txt says.)
"""

import argparse
import json
import re
import sys
from pathlib import Path

MAX_SCALARS = 16
MAX_RECORDS = 16
MAX_LINE = 400
INLINE = 140
SKIP_JSON = {"summary.json", "trace.json"}

# Lines that state a run-level result (the rest of a log is per-case detail or progress).
HEADLINE = re.compile(
    r"^(device |model: |== |(\[[\w /-]+\] )?engine on CUDA|prompts: |trace: |warm-up|HF |SUMMARY|TIME |CHECK |"
    r"trained model|transformers |saved |attn_prefill\.cu |"
    r"(PASS|FAIL) (load|throughput|KV waste|every request|on-device|probe|batch invariance|torch fill|weight scale)|"
    r"[\w+./-]+( \w+)?: (ok|FAIL|PASS)|\w*(Error|Exception): |\S+\t/)"
)
VERDICT = re.compile(r"^((?:cuda|hf|run)_[a-z_]+): (.*)$")
NOISE = re.compile(r"it/s\]|s/it\]|^train step |Warning|^Consider using|^\s+return ")


class Dropped:
    """Marker for a value left out of the summary."""


DROP = Dropped()


def slim(value, path: str, left_out: list):
    """`value` without its bulky arrays (see the module doc), scalars unchanged; the path and
    length of each array left out is appended to `left_out`."""
    if isinstance(value, dict):
        kept = ((k, slim(v, f"{path}.{k}", left_out)) for k, v in value.items())
        return {k: v for k, v in kept if v is not DROP}
    if isinstance(value, list):
        if all(not isinstance(x, (dict, list)) for x in value) and len(value) <= MAX_SCALARS:
            return value
        if all(isinstance(x, dict) for x in value) and len(value) <= MAX_RECORDS:
            return [slim(x, f"{path}[{i}]", left_out) for i, x in enumerate(value)]
        left_out.append(f"{path} ({len(value)} items)")
        return DROP
    return value


def dumps(value, depth: int = 0) -> str:
    """JSON with one key per line, short objects and lists of numbers on one line (compact, diff-friendly)."""
    pad = "  " * (depth + 1)
    flat = json.dumps(value, ensure_ascii=False)
    if len(flat) <= INLINE:
        return flat
    if isinstance(value, dict) and value:
        items = (f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    if isinstance(value, list) and any(isinstance(x, (dict, list, str)) for x in value):
        items = (pad + dumps(v, depth + 1) for v in value)
        return "[\n" + ",\n".join(items) + "\n" + "  " * depth + "]"
    return flat


def log_lines(path: Path, seen: set):
    """(headline lines not in `seen`, JSON objects printed on their own line, last verdict) of one log."""
    lines, objects, verdict = [], [], None
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.rstrip()
        if not line or NOISE.search(line):
            continue
        if line.startswith("{"):
            try:
                objects.append(json.loads(line))
                continue
            except ValueError:
                pass
        m = VERDICT.match(line)
        if m:
            verdict = re.sub(r"( ->|; JSON in) /\S+", "", m.group(2))
        if len(line) <= MAX_LINE and HEADLINE.match(line) and line not in seen:
            seen.add(line)
            lines.append(line)
    return lines, objects, verdict


def machine_txt(path: Path) -> dict:
    """date / machine / commit from the machine.txt that the run scripts write."""
    meta = {}
    if not path.is_file():
        return meta
    rows = [r.strip() for r in path.read_text(errors="replace").splitlines() if r.strip()]
    gpus = []
    for row in rows:
        if row.startswith("date "):
            meta["date"] = row[5:]
        elif re.fullmatch(r"[0-9a-f]{7,40}", row):
            meta["commit"] = row
        elif "," in row:
            gpus.append(row)  # nvidia-smi: one "name, memory, driver, max SM clock" row per GPU
    if gpus:
        meta["machine"] = "; ".join(gpus)
    return meta


def summarize(out_dir: Path, args) -> dict:
    meta = machine_txt(out_dir / "machine.txt")
    for key in ("date", "machine", "commit"):
        if getattr(args, key):
            meta[key] = getattr(args, key)
    if args.command:
        meta["commands"] = args.command
    if args.note:
        meta["note"] = args.note
    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.suffix in (".json", ".log", ".txt"))
    files = [p for p in files if p.name not in SKIP_JSON and p.name != "machine.txt"]
    # JSON and the tools' own logs first, then the combined logs that repeat them.
    files.sort(key=lambda p: (p.suffix != ".json" and not (out_dir / f"{p.stem}.json").is_file(), p.name))
    meta["built_from"] = {p.name: p.stat().st_size for p in sorted(files)}
    results, verdicts, logs, left_out = {}, {}, {}, []
    seen = set()
    for p in files:
        if p.suffix == ".json":
            try:
                results[p.stem] = slim(json.loads(p.read_text()), p.stem, left_out)
            except ValueError as e:
                verdicts[p.stem] = f"unreadable JSON: {e}"
            continue
        # A log without a JSON of its own name is a script's combined output (run_trace.log):
        # only its lines that no tool log already holds are kept.
        combined = not (out_dir / f"{p.stem}.json").is_file()
        lines, objects, verdict = log_lines(p, seen if combined else set())
        if not combined:
            seen.update(lines)
        if objects:
            merged = results.setdefault(p.stem, {})
            for obj in objects:
                merged.update(slim(obj, p.stem, left_out))
        if verdict is not None:
            verdicts[p.stem] = verdict
        if lines:
            logs[p.stem] = lines
    if left_out:
        meta["left_out"] = left_out
    return {"meta": meta, "verdicts": verdicts, "results": results, "log": logs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--command", action="append", default=[])
    ap.add_argument("--date")
    ap.add_argument("--machine")
    ap.add_argument("--commit")
    ap.add_argument("--note")
    args = ap.parse_args()
    if not args.out_dir.is_dir():
        print(f"summarize: {args.out_dir} is not a directory", file=sys.stderr)
        return 2
    summary = summarize(args.out_dir, args)
    out = args.out or args.out_dir / "summary.json"
    out.write_text(dumps(summary) + "\n")
    print(f"summary: {out} ({out.stat().st_size} bytes; {len(summary['results'])} results, "
          f"{len(summary['verdicts'])} verdicts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
