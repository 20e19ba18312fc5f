#!/usr/bin/env bash
# The serving-trace comparison on the GPU machine, in one command (about 4 minutes on one H200, at
# most ~9.5 minutes with every timeout hit):
#   1. scripts/gpu/make_trace.py: the 512-request trace (seeded, deterministic) -> $OUT/trace.json
#   2. $BIN/cuda_trace: Prism's engine on the CUDA backend, Llama-3-8B shapes, seeded weights;
#      --check-weights; the trace all at once; KV waste; probe logits (-> $OUT/cuda_trace.json)
#   3. scripts/gpu/hf_trace.py: Hugging Face generate with the same weights (checked against
#      step 2's checksums and probe logits), static batches of 32, the first $HF_BATCHES batches
#      (-> $OUT/hf_trace.json)
#   4. one SUMMARY line: Prism tok/s, HF tok/s, ratio (target >= 25x), KV waste (target < 4%)
#      (-> $OUT/trace_summary.txt), and $OUT/summary.json (scripts/gpu/summarize.py).
# $OUT defaults to bench/out/run_trace-<UTC time> (ignored by git); RESULTS=bench/cuda/runN also
# copies summary.json there to be committed.
# Binaries prebuilt on the build machine:
#   cargo build --release -p prism-engine --features cuda --examples && cp target/release/examples/cuda_trace .gpu-bin/
# usage (from the repo root): [OUT=dir] [BIN=.gpu-bin] [HF_BATCHES=2] [CUDA_TRACE_ARGS='--limit 64']
#   [RESULTS=bench/cuda/runN] bash scripts/gpu/run_trace.sh
# Exit status 1 when any step failed or FAILed a check.
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_trace)
BIN=${BIN:-.gpu-bin}
HF_BATCHES=${HF_BATCHES:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
machine_txt "$OUT"
rc=0
python3 scripts/gpu/make_trace.py "$OUT/trace.json" || exit 1
# shellcheck disable=SC2086  # CUDA_TRACE_ARGS is a list of flags
timeout 300 "$BIN/cuda_trace" "$OUT/trace.json" "$OUT/cuda_trace.json" --check-weights --timeout-s 240 \
  ${CUDA_TRACE_ARGS:-} 2>&1 | tee "$OUT/cuda_trace.log" || rc=1
timeout 270 python3 scripts/gpu/hf_trace.py "$OUT/trace.json" "$OUT/hf_trace.json" --batches "$HF_BATCHES" \
  --prism "$OUT/cuda_trace.json" 2>&1 | tee "$OUT/hf_trace.log" || rc=1
python3 - "$OUT/cuda_trace.json" "$OUT/hf_trace.json" <<'EOF' | tee "$OUT/trace_summary.txt"
import json, sys
from pathlib import Path

def load(p):
    try:
        return json.loads(Path(p).read_text())
    except (OSError, ValueError):
        return None

pr, hf = load(sys.argv[1]), load(sys.argv[2])
parts = []
if pr and "result" in pr:
    r = pr["result"]
    w = r["kv_waste"]
    parts.append(f"Prism {r['output_tokens_per_s']:.0f} tok/s ({r['output_tokens']} tokens of {pr['requests_run']} "
                 f"requests in {r['wall_s']:.1f}s; TTFT p50 {r['ttft_s']['p50']:.2f}s p99 {r['ttft_s']['p99']:.2f}s; "
                 f"TPOT p50 {1e3 * r['tpot_s']['p50']:.1f}ms p99 {1e3 * r['tpot_s']['p99']:.1f}ms; {r['steps']} steps, "
                 f"{r['preemptions']} preemptions)")
    parts.append(f"KV waste {100 * w['time_weighted']:.2f}% time-weighted, {100 * w['mean']:.2f}% mean, "
                 f"{100 * w['max']:.2f}% max ({'PASS' if w['pass'] else 'FAIL'} < 4%)")
else:
    parts.append("Prism: no result")
if hf and "hf" in hf:
    h = hf["hf"]
    parts.append(f"HF {h['useful_tok_s']:.1f} useful tok/s ({h['batches_run']} of {h['batches_total']} batches)")
    if "ratio" in hf:
        x = hf["ratio"]["ratio"]
        parts.append(f"ratio {x:.1f}x ({'PASS' if x >= 25 else 'FAIL'} >= 25x)")
    for k in ("weights_compare", "probe_compare"):
        v = hf.get(k, {})
        ok = v.get("pass", all(t.get("pass", False) for t in v.values() if isinstance(t, dict)))
        parts.append(f"{k.split('_')[0]} {'skipped' if v.get('skipped') else 'PASS' if ok else 'FAIL'}")
else:
    parts.append("HF: no result")
print("SUMMARY trace: " + "; ".join(parts))
EOF
finish_run "$OUT" "CUDA_TRACE_ARGS='${CUDA_TRACE_ARGS:-}' HF_BATCHES=$HF_BATCHES BIN=$BIN bash scripts/gpu/run_trace.sh" || rc=1
exit $rc
