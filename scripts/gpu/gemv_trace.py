#!/usr/bin/env python3
"""Reads the decode GEMVs' per-block timing records that `cuda_bench` writes with PRISM_GEMV_TRACE=1
(`OUT.gemv_trace_LABEL.csv`, one row per block; columns as `GEMV_TRACE` in kernels/gemv.cu) and prints,
per product averaged over the layers of one decode step (µs):

  span      first block entry to last block exit of the launch
  gap       last exit of the previous GEMV launch to this one's first entry (includes the kernels
            in between that are not traced, e.g. decode attention before o_proj)
  spread    first to last block entry (how long the grid takes to start)
  prologue  block entry to the end of the norm/staging prologue (mean over blocks)
  warp end  block entry to the first / last end of a warp with rows (mean over blocks)
  exit lag  last block exit minus the mean block exit (the tail of the launch)
  TB/s      weight bytes / span

Usage: python3 scripts/gpu/gemv_trace.py FILE.csv [FILE.csv ...]
"""
import csv
import statistics
import sys


def kind(mode, out, inp, hidden):
    if mode == 4:
        return "qkv"
    if mode == 3:
        return "gate_up"
    if mode == 1:
        return "lm_head"
    return "o_proj" if inp <= hidden else "down"


def weight_bytes(k, out, inp, fp8):
    rows = {"qkv": 2 * out, "gate_up": 2 * out}.get(k, out)
    return rows * inp * (1 if fp8 else 2)


def main():
    for path in sys.argv[1:]:
        rows = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(open(path))]
        if not rows:
            print(f"{path}: no records")
            continue
        fp8 = "fp8" in path
        hidden = next(r["inp"] for r in rows if r["mode"] == 4)
        # Launches: runs of records with the same kernel (launches of one stream do not overlap).
        launches = []
        for r in rows:
            key = (r["mode"], r["out"], r["inp"])
            if not launches or launches[-1][0] != key:
                launches.append((key, []))
            launches[-1][1].append(r)
        # Cycles per ns from the blocks' own durations (clock64 vs %globaltimer).
        pairs = [(r["g_exit"] - r["g_entry"], r["c_warp_last_end"]) for r in rows if r["c_warp_last_end"] > 0]
        ghz = sum(c for _, c in pairs) / max(1, sum(g for g, _ in pairs))
        ticks = sorted({r["g_entry"] for r in rows})
        res = min((b - a for a, b in zip(ticks, ticks[1:]) if b > a), default=0)
        print(f"== {path}: {len(rows)} blocks, {len(launches)} launches, clock {ghz:.3f} GHz, timer step {res} ns")
        per = {}
        prev_exit = None
        for (mode, out, inp), rs in launches:
            k = kind(mode, out, inp, hidden)
            first = min(r["g_entry"] for r in rs)
            last = max(r["g_exit"] for r in rs)
            d = per.setdefault(k, {"n": 0, "blocks": len(rs), "bytes": weight_bytes(k, out, inp, fp8), **{c: [] for c in
                               ("span", "gap", "spread", "pro", "wfirst", "wlast", "lag")}})
            d["n"] += 1
            d["span"].append((last - first) / 1e3)
            if prev_exit is not None:
                d["gap"].append((first - prev_exit) / 1e3)
            d["spread"].append((max(r["g_entry"] for r in rs) - first) / 1e3)
            d["pro"].append(statistics.mean(r["c_prologue"] for r in rs) / ghz / 1e3)
            worked = [r for r in rs if r["c_warp_last_end"] > 0]
            d["wfirst"].append(statistics.mean(r["c_warp_first_end"] for r in worked) / ghz / 1e3)
            d["wlast"].append(statistics.mean(r["c_warp_last_end"] for r in worked) / ghz / 1e3)
            d["lag"].append((last - statistics.mean(r["g_exit"] for r in rs)) / 1e3)
            prev_exit = last
        print(f"{'product':<8} {'launches':>8} {'blocks':>6} {'span':>7} {'gap':>6} {'spread':>6} {'prologue':>8} "
              f"{'warp end 1st/last':>17} {'exit lag':>8} {'TB/s':>5}")
        total = 0.0
        for k in ("qkv", "o_proj", "gate_up", "down", "lm_head"):
            if k not in per:
                continue
            d = per[k]
            m = {c: statistics.mean(v) if v else 0.0 for c, v in d.items() if isinstance(v, list)}
            total += (m["span"] + m["gap"]) * d["n"]
            print(f"{k:<8} {d['n']:>8} {d['blocks']:>6} {m['span']:>7.2f} {m['gap']:>6.2f} {m['spread']:>6.2f} "
                  f"{m['pro']:>8.2f} {m['wfirst']:>8.2f}/{m['wlast']:<8.2f} {m['lag']:>8.2f} "
                  f"{d['bytes'] / m['span'] / 1e6:>5.2f}")
        print(f"first GEMV entry to last exit: {(max(r['g_exit'] for r in rows) - rows[0]['g_entry']) / 1e3:.1f} us; "
              f"sum of spans and gaps {total:.1f} us")


main()
