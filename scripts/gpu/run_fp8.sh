#!/usr/bin/env bash
# FP8 on the GPU machine, side by side with bf16 in the same run (binaries prebuilt in $BIN:
# cargo build --release -p prism-engine --features cuda --example cuda_bench --example cuda_trace
# --example cuda_check). PARTS picks the parts (default all of them, in this order):
#   bench:    cuda_bench --quick at Llama-3-8B shapes: bf16, --quantization fp8 (lm_head bf16; every
#             FP8 GEMV variant, PRISM_GEMV_FP8_SWEEP=1), fp8 weights + --kv-cache-dtype fp8 (batch-1
#             decode, batched decode, prefill; the FP8 GEMV vs FP8 GEMM logits check); BENCH_EXTRA
#             adds more, e.g. "fp8_lm_head::--quantization fp8 --fp8-lm-head"
# (Parts run in the order PARTS names them.)
#   trace:    the 512-request trace (make_trace.py) through cuda_trace at engine defaults: bf16,
#             fp8 weights, fp8 weights + fp8 KV
#   accuracy: hf_reference.py (random + trained reference models), then cuda_check --fp8 (bf16 vs
#             fp8 runs: logits error vs HF f32, greedy agreement with bf16), also with fp8 KV (with fp8
#             and with bf16 weights) and fp8_kv_sim.py (e4m3 K/V in HF, scale 1 vs calibrated)
# Knobs: BENCH_RUNS / TRACE_RUNS replace the bench / trace lists (';'-separated NAME:ENV:FLAGS /
# NAME:FLAGS or NAME:ENV:FLAGS entries), ACCURACY_ENV (e.g. PRISM_FP8_FAST_ACCUM=0) for the FP8 accuracy check, KV8_CHECK=0
# skips its FP8-KV variant, QUANTIZE the path of scripts/quantize_fp8.py.
# Logs and JSON into $OUT (default bench/out/run_fp8-<UTC time>), summary.json next to them.
#   usage (from the repo root): [OUT=dir] [BIN=.gpu-bin] [PARTS="bench trace accuracy"] bash scripts/gpu/run_fp8.sh
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_fp8)
BIN=${BIN:-.gpu-bin}
PARTS=${PARTS:-accuracy trace bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RUST_LOG=${RUST_LOG:-warn}
machine_txt "$OUT"
rc=0
part_bench() {
  # NAME:ENV:FLAGS (ENV: PRISM_GEMV_FP8_SWEEP=1 times every FP8 GEMV variant; PRISM_BENCH_PROFILE=1
  # adds per-kernel profiles).
  local runs
  if [ -n "${BENCH_RUNS:-}" ]; then
    IFS=';' read -ra runs <<< "$BENCH_RUNS"
  else
    # shellcheck disable=SC2206  # BENCH_EXTRA is a list
    runs=("bf16::" "fp8:PRISM_GEMV_FP8_SWEEP=1:--quantization fp8" ${BENCH_EXTRA:-} "fp8_kv8::--quantization fp8 --kv-cache-dtype fp8")
  fi
  for v in "${runs[@]}"; do
    name=${v%%:*}; rest=${v#*:}; envs=${rest%%:*}; args=${rest#*:}
    # shellcheck disable=SC2086  # envs and args are lists
    env $envs timeout 150 "$BIN/cuda_bench" "$OUT/cuda_bench_$name.json" --quick $args 2>&1 | tee "$OUT/cuda_bench_$name.log" || rc=1
  done
}

part_trace() {
  python3 scripts/gpu/make_trace.py "$OUT/trace.json" || { rc=1; return; }
  local runs
  if [ -n "${TRACE_RUNS:-}" ]; then
    IFS=';' read -ra runs <<< "$TRACE_RUNS"
  else
    runs=("bf16:" "fp8:--quantization fp8" "fp8_kv8:--quantization fp8 --kv-cache-dtype fp8")
  fi
  for v in "${runs[@]}"; do
    # NAME:FLAGS, or NAME:ENV:FLAGS (ENV a list of VAR=VALUE for the run).
    name=${v%%:*}; args=${v#*:}; envs=
    case $args in *:*) envs=${args%%:*}; args=${args#*:} ;; esac
    # shellcheck disable=SC2086
    env $envs timeout 150 "$BIN/cuda_trace" "$OUT/trace.json" "$OUT/cuda_trace_$name.json" --timeout-s 120 $args 2>&1 \
      | tee "$OUT/cuda_trace_$name.log" || rc=1
  done
  python3 - "$OUT" <<'EOF' | tee "$OUT/fp8_trace_summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def tps(n):
    try:
        return json.loads((out / f"cuda_trace_{n}.json").read_text())["result"]["output_tokens_per_s"]
    except (OSError, ValueError, KeyError):
        return None
b = tps("bf16")
names = [p.name[len("cuda_trace_"):-len(".json")] for p in sorted(out.glob("cuda_trace_*.json"))]
for n in [n for n in names if n != "bf16"]:
    t = tps(n)
    if b and t:
        print(f"SUMMARY trace {n}: {t:.0f} tok/s vs bf16 {b:.0f} tok/s = {t / b:.2f}x ({'PASS' if t / b >= 1.5 else 'FAIL'} >= 1.5x)")
    else:
        print(f"SUMMARY trace {n}: no result")
EOF
}

part_accuracy() {
  MODEL=/tmp/prism-hf-ref
  rm -rf "$MODEL"
  timeout 240 python3 scripts/gpu/hf_reference.py "$MODEL" > "$OUT/hf_reference.log" 2>&1 || rc=1
  tail -3 "$OUT/hf_reference.log"
  # FP8 checkpoints of both models (compressed-tensors, per-channel scales) for cuda_check to
  # load as stored and compare with the at-load quantization.
  for d in "$MODEL" "$MODEL/trained"; do
    python3 "${QUANTIZE:-scripts/quantize_fp8.py}" "$d" "$d/fp8" > "$OUT/quantize_fp8.log" 2>&1 || rc=1
  done
  timeout 120 env ${ACCURACY_ENV:-} "$BIN/cuda_check" "$MODEL" "$OUT/cuda_check_fp8.json" --fp8 2>&1 | tee "$OUT/cuda_check_fp8.log" || rc=1
  if [ "${KV8_CHECK:-1}" = 1 ]; then
    timeout 120 "$BIN/cuda_check" "$MODEL" "$OUT/cuda_check_fp8_kv8.json" --fp8 --kv-cache-dtype fp8 2>&1 \
      | tee "$OUT/cuda_check_fp8_kv8.log" || rc=1
    # The FP8 KV cache alone (bf16 weights), and e4m3 K/V simulated in HF (scale 1 vs calibrated).
    timeout 120 "$BIN/cuda_check" "$MODEL" "$OUT/cuda_check_kv8.json" --fp8 --weights bf16 --kv-cache-dtype fp8 2>&1 \
      | tee "$OUT/cuda_check_kv8.log" || rc=1
    timeout 120 python3 scripts/gpu/fp8_kv_sim.py "$MODEL/trained" "$OUT/fp8_kv_sim_trained.json" 2>&1 \
      | grep -v Loading | tee "$OUT/fp8_kv_sim_trained.log" || rc=1
  fi
}

for p in $PARTS; do
  "part_$p"
done
finish_run "$OUT" "PARTS='$PARTS' BIN=$BIN bash scripts/gpu/run_fp8.sh" || rc=1
exit $rc
