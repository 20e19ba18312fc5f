#!/usr/bin/env python3
"""Summarise the decode-attention trace of cuda_bench (PRISM_GEMV_TRACE=1 writes
`{out}.attn_trace_{label}.csv` next to `{out}.gemv_trace_{label}.csv`; columns: the kernel file's
DA_TRACE). Per launch: the gap from the previous GEMV's last exit to the first CTA's entry, the
stages of a CTA (medians, µs from its entry: pos read, first tile in shared memory, tiles
computed, partial written, split counter / cluster barrier passed, exit), the span from the first
entry to the last exit, and the gap to the next GEMV's first entry; then the means over launches.

Usage: python3 scripts/gpu/attn_trace.py OUT.attn_trace_LABEL.csv [...]
"""
import csv, statistics, sys

def main():
    for path in sys.argv[1:]:
        rows = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(open(path))]
        gemv = []
        try:
            gemv = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(open(path.replace(".attn_trace_", ".gemv_trace_")))]
        except OSError:
            pass
        rows.sort(key=lambda r: r["g_entry"])
        launches, cur = [], []
        for r in rows:
            if cur and r["g_entry"] - cur[-1]["g_entry"] > 20000:
                launches.append(cur)
                cur = []
            cur.append(r)
        if cur:
            launches.append(cur)
        stages = ["g_pos", "g_tile", "g_computed", "g_written", "g_counted", "g_exit"]
        acc = {k: [] for k in ["before", "span", "after", "blocks"] + stages + ["last_fold"]}
        for L in launches:
            t0 = min(r["g_entry"] for r in L)
            t1 = max(r["g_exit"] for r in L)
            prev = [g["g_exit"] for g in gemv if g["g_exit"] <= t0 + 500]
            nxt = [g["g_entry"] for g in gemv if g["g_entry"] >= t0]
            if prev:
                acc["before"].append((t0 - max(prev)) / 1e3)
            if nxt:
                acc["after"].append((min(nxt) - t1) / 1e3)
            acc["span"].append((t1 - t0) / 1e3)
            acc["blocks"].append(len(L))
            for s in stages:
                v = [(r[s] - r["g_entry"]) / 1e3 for r in L if r[s]]
                if v:
                    acc[s].append(statistics.median(v))
            last = [r for r in L if r["last"] and r["g_counted"]]
            if last:
                acc["last_fold"].append(statistics.median((r["g_exit"] - r["g_counted"]) / 1e3 for r in last))
        print(f"== {path}: {len(rows)} CTA records, {len(launches)} launches, "
              f"{statistics.mean(acc['blocks']):.0f} CTAs each")
        m = lambda k: f"{statistics.mean(acc[k]):7.2f}" if acc[k] else "      -"
        print("µs (mean over launches)   GEMV exit → first entry", m("before"), "| span", m("span"), "| last exit → next GEMV", m("after"))
        print("CTA stages (median, µs from its entry): pos", m("g_pos"), " tile", m("g_tile"), " computed", m("g_computed"),
              " written", m("g_written"), " counted", m("g_counted"), " exit", m("g_exit"), " | last CTA's fold", m("last_fold"))

if __name__ == "__main__":
    main()
