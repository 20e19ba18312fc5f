#!/usr/bin/env python3
"""The figures of a prefix-caching benchmark run (bench/prefix/run_cpu.sh, scripts/gpu/run_prefix.sh)
in OUT_DIR/summary.json and OUT_DIR/summary.md, checked against the acceptance targets:

- single replica, multi-turn trace: TTFT p50 cache off / cache on >= 3 and output tok/s cache on /
  cache off >= 1.5; random trace (control): output tok/s within 2 % of cache off (a run repeated as
  `NAME_2`, as run_cpu.sh repeats the control, counts as the mean of the two);
- three replicas, shared-prefix traces: the cluster's hit rate within 10 points of one replica's
  while the busiest replica takes at most 1.5x the mean requests (prefix-aware), P2C alongside.

Inputs: the `prism bench serve` JSON results in OUT_DIR named by run (`a_multi_turn_cache_on.json`,
`b_shared_prefix_3_replicas_p2c.json`, ...; other JSON files are ignored) and, when present,
settings.json and machine.txt / cpu.txt. A run that is missing or reported no cached tokens gives
`null` figures and an `n/a` verdict, never an error, so a partial run still summarises.
The hit rate of a run is cached prompt tokens over prompt tokens as the server reported them in
`usage` (`prefix_cache_hit_rate`), else the workers' `vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total` (`workers.prefix_cache_hit_rate`).

Usage: python3 bench/prefix/summarize.py OUT_DIR [--name summary]
(writes OUT_DIR/NAME.json and OUT_DIR/NAME.md)
"""

import argparse
import json
import sys
from pathlib import Path

RUN_KEYS = ["completed", "failed", "failures", "num_prompts", "request_rate", "duration", "total_input_tokens",
            "total_output_tokens", "total_cached_tokens", "prefix_cache_hit_rate", "output_throughput",
            "request_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms",
            "median_e2el_ms"]


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ratio(num, den):
    return num / den if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den else None


def run_figures(r: dict, replicas: int) -> dict:
    out = {k: r.get(k) for k in RUN_KEYS}
    w = r.get("workers") or {}
    out["workers_prefix_cache_hit_rate"] = w.get("prefix_cache_hit_rate")
    out["requests_per_worker"] = w.get("requests")
    if replicas > 1 and w.get("requests"):
        # One replica per worker; the workers without a replica of this model take no request.
        reqs = sorted(w["requests"], reverse=True)[:replicas]
        mean = sum(reqs) / replicas
        out["max_over_mean_requests"] = max(reqs) / mean if mean else None
    else:
        out["max_over_mean_requests"] = None
    hit = r.get("prefix_cache_hit_rate")
    out["hit_rate"] = hit if hit is not None else w.get("prefix_cache_hit_rate")
    return out


def verdict(ok):
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def mean(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def side(runs: dict, trace: str, name: str):
    """One side of the comparison: the run, and its repeat (`_2`) when there is one, averaged."""
    reps = [r for r in (runs.get(f"a_{trace}_{name}"), runs.get(f"a_{trace}_{name}_2")) if r]
    if not reps:
        return None
    cached = [r["total_cached_tokens"] for r in reps]
    return {
        "runs": len(reps),
        "median_ttft_ms": mean(r["median_ttft_ms"] for r in reps),
        "output_throughput": mean(r["output_throughput"] for r in reps),
        "output_throughput_per_run": [r["output_throughput"] for r in reps],
        "hit_rate": mean(r["hit_rate"] for r in reps),
        "total_cached_tokens": None if None in cached else sum(cached),
    }


def single_replica(runs: dict, trace: str, control: bool) -> dict:
    on, off = side(runs, trace, "cache_on"), side(runs, trace, "cache_off")
    if not on or not off:
        return {"missing": [n for n, r in (("cache_on", on), ("cache_off", off)) if not r]}
    ttft = ratio(off["median_ttft_ms"], on["median_ttft_ms"])
    tput = ratio(on["output_throughput"], off["output_throughput"])
    res = {
        "runs_per_side": {"cache_on": on["runs"], "cache_off": off["runs"]},
        "ttft_p50_ms": {"cache_on": on["median_ttft_ms"], "cache_off": off["median_ttft_ms"]},
        "output_tok_s": {"cache_on": on["output_throughput"], "cache_off": off["output_throughput"]},
        "output_tok_s_per_run": {"cache_on": on["output_throughput_per_run"],
                                 "cache_off": off["output_throughput_per_run"]},
        "hit_rate": {"cache_on": on["hit_rate"], "cache_off": off["hit_rate"]},
        "cached_tokens": {"cache_on": on["total_cached_tokens"], "cache_off": off["total_cached_tokens"]},
        "ttft_p50_off_over_on": ttft,
        "output_tok_s_on_over_off": tput,
    }
    if control:
        res["target"] = "output tok/s within 2% of cache off"
        res["verdict"] = verdict(None if tput is None else abs(tput - 1) <= 0.02)
    else:
        res["target"] = "TTFT p50 >= 3x lower, output tok/s >= 1.5x higher with the cache on"
        res["verdict"] = verdict(None if ttft is None or tput is None else ttft >= 3 and tput >= 1.5)
    return res


def cluster(runs: dict, trace: str) -> dict:
    one = runs.get(f"b_{trace}_1_replica")
    res = {"one_replica_hit_rate": one and one["hit_rate"]}
    for policy in ("prefix_aware", "p2c"):
        r = runs.get(f"b_{trace}_3_replicas_{policy}")
        if not r:
            res[policy] = None
            continue
        gap = None
        if r["hit_rate"] is not None and res["one_replica_hit_rate"] is not None:
            gap = 100 * (res["one_replica_hit_rate"] - r["hit_rate"])
        balanced = r["max_over_mean_requests"]
        res[policy] = {
            "hit_rate": r["hit_rate"],
            "hit_rate_points_below_one_replica": gap,
            "requests_per_replica": r["requests_per_worker"],
            "max_over_mean_requests": balanced,
            "ttft_p50_ms": r["median_ttft_ms"],
            "output_tok_s": r["output_throughput"],
        }
    pa = res.get("prefix_aware")
    ok = None
    if pa and pa["hit_rate_points_below_one_replica"] is not None and pa["max_over_mean_requests"] is not None:
        ok = pa["hit_rate_points_below_one_replica"] <= 10 and pa["max_over_mean_requests"] <= 1.5
    res["target"] = "prefix-aware: hit rate within 10 points of one replica's, max/mean requests <= 1.5"
    res["verdict"] = verdict(ok)
    return res


def fmt(v, pct=False, digits=1):
    if v is None:
        return "n/a"
    if isinstance(v, list):
        return " / ".join(fmt(x, digits=0) for x in v)
    return f"{100 * v:.{digits}f}%" if pct else f"{v:.{digits}f}"


def markdown(s: dict) -> str:
    lines = ["# Prefix caching benchmark", ""]
    meta = s["meta"]
    lines.append("; ".join(x for x in (meta.get("machine"), meta.get("settings_line")) if x))
    runs = s["runs"]
    if any(k.startswith("a_") for k in runs):
        lines += ["", "## One replica, prefix cache on vs off", "",
                  "| trace | run | completed | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | cached tokens | hit rate |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for trace in ("multi_turn", "random"):
        for name in ("cache_on", "cache_off", "cache_off_2", "cache_on_2"):
            r = s["runs"].get(f"a_{trace}_{name}")
            if r:
                lines.append(f"| {trace} | {name} | {r['completed']}/{r['num_prompts']} | {fmt(r['median_ttft_ms'], digits=0)} "
                             f"| {fmt(r['p99_ttft_ms'], digits=0)} | {fmt(r['output_throughput'])} "
                             f"| {fmt(r['total_cached_tokens'], digits=0)} | {fmt(r['hit_rate'], pct=True)} |")
    for trace in ("multi_turn", "random"):
        a = s["single_replica"].get(trace, {})
        if "verdict" in a and any(k.startswith(f"a_{trace}") for k in runs):
            lines.append(f"\n{trace}: TTFT p50 off/on {fmt(a['ttft_p50_off_over_on'], digits=2)}x, output tok/s on/off "
                         f"{fmt(a['output_tok_s_on_over_off'], digits=3)}x — {a['verdict']} ({a['target']})")
    if any(k.startswith("b_") for k in runs):
        lines += ["", "## Shared-prefix traces, one replica vs three", "",
                  "| trace | run | completed | hit rate | requests per replica | max/mean | TTFT p50 (ms) | output tok/s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for trace in ("shared_prefix", "system_prompt"):
        for run in ("1_replica", "3_replicas_prefix_aware", "3_replicas_p2c"):
            r = s["runs"].get(f"b_{trace}_{run}")
            if r:
                lines.append(f"| {trace} | {run} | {r['completed']}/{r['num_prompts']} | {fmt(r['hit_rate'], pct=True)} "
                             f"| {fmt(r['requests_per_worker']) if run != '1_replica' else '-'} "
                             f"| {fmt(r['max_over_mean_requests'], digits=2)} | {fmt(r['median_ttft_ms'], digits=0)} "
                             f"| {fmt(r['output_throughput'])} |")
    for trace in ("shared_prefix", "system_prompt"):
        c = s["cluster"].get(trace, {})
        if "verdict" in c and any(k.startswith(f"b_{trace}") for k in runs):
            lines.append(f"\n{trace}: {c['verdict']} ({c['target']})")
    if meta.get("note"):
        lines += ["", meta["note"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--name", default="summary", help="output file name without extension")
    a = ap.parse_args()
    out = Path(a.out_dir)
    settings = load(out / "settings.json") or {}
    runs = {}
    for p in sorted(out.glob("*.json")):
        if p.name[:2] not in ("a_", "b_") or p.stem == a.name:
            continue
        r = load(p)
        if isinstance(r, dict) and "completed" in r:
            runs[p.stem] = run_figures(r, 3 if "3_replicas" in p.stem else 1)
    machine = ", ".join(
        " ".join(line.split()) for f in ("machine.txt", "cpu.txt") if (out / f).exists()
        for line in (out / f).read_text().splitlines() if line.strip())
    note = (out / "note.txt").read_text().strip() if (out / "note.txt").exists() else None
    summary = {
        "meta": {"machine": machine or None, "settings": settings, "note": note,
                 "settings_line": f"wall {settings['wall_s']} s" if "wall_s" in settings else None},
        "runs": runs,
        "single_replica": {"multi_turn": single_replica(runs, "multi_turn", False),
                           "random": single_replica(runs, "random", True)},
        "cluster": {"shared_prefix": cluster(runs, "shared_prefix"),
                    "system_prompt": cluster(runs, "system_prompt")},
    }
    (out / f"{a.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(summary)
    (out / f"{a.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
