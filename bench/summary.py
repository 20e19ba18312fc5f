#!/usr/bin/env python3
"""Writes a benchmark's committed summary: its result JSON plus a `meta` record of where and how
it ran (UTC date, commit, command, CPU model, cores, memory, kernel, 1/5/15-minute load average at
the end). The full logs stay in the run's folder under bench/out/, which git ignores.

A result that is a JSON object keeps its keys and gets `meta` added; any other JSON value (the
router benchmark's list of points) goes under `results`. No value of the result is changed.

Usage: python3 bench/summary.py RESULT.json OUT.json --command CMD [--logs DIR]
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def first_line_with(path: str, prefix: str):
    """The value after `prefix` on the first line of `path` that starts with it, or None."""
    try:
        for line in Path(path).read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def commit():
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def meta(command: str, logs) -> dict:
    m = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "command": command,
        "machine": {
            "cpu": first_line_with("/proc/cpuinfo", "model name"),
            "cores": os.cpu_count(),
            "memory": first_line_with("/proc/meminfo", "MemTotal"),
            "kernel": f"{platform.system()} {platform.release()}",
            "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
    }
    if logs:
        m["full_logs"] = str(logs)
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--command", required=True)
    ap.add_argument("--logs", help="folder of the full logs (recorded in meta)")
    args = ap.parse_args()
    try:
        result = json.loads(args.result.read_text())
    except (OSError, ValueError) as e:
        print(f"summary: cannot read {args.result}: {e}", file=sys.stderr)
        return 1
    m = meta(args.command, args.logs)
    summary = {"meta": m, **result} if isinstance(result, dict) else {"meta": m, "results": result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
