#!/usr/bin/env bash
# One device command that checks a change to the CUDA kernels and measures FP8 against bf16 in
# the same run, most telling first: tests/cuda_fp8.rs, run_fp8.sh's bench part, the accuracy
# check (cuda_check with ACCURACY_FLAGS), run_fp8.sh's trace part, tests/cuda_masked_greedy.rs
# and the decode attention example's correctness cases. The logs are packed into one archive
# (the device tool brings back at most 8 files); steps.txt beside it has each step's exit status,
# time and headline figures, and comes back even if the command is cut short.
# Binaries prebuilt and stripped in $BIN: the examples cuda_bench, cuda_trace, cuda_check and
# cuda_attn_decode (`cargo build --release -p prism-engine --features cuda --example …`) and the
# test binaries cuda_fp8 and cuda_masked_greedy (`cargo test --release -p prism-engine --features
# cuda --test cuda_fp8 --test cuda_masked_greedy --no-run`, copied under those names).
#   usage (from the repo root): OUT=dir BIN=.gpu-bin/NAME bash scripts/gpu/run_fp8_verify.sh
# Knobs: BENCH_RUNS / TRACE_RUNS as for run_fp8.sh (defaults below), ACCURACY_FLAGS (default
# `--fp8-lm-head`: the FP8 lm_head's continuations against bf16 as well) and ACCURACY_ENV (its
# environment, e.g. PRISM_FP8_OUTER_VEC=1), GEMM_SWEEP=1 (the FP8 GEMM algorithm sweep).
set -uo pipefail
BIN=${BIN:?BIN: the folder of prebuilt binaries}
DEST=${OUT:?OUT: the folder to write the archive into}
RUN=$DEST/fp8_verify
# The step summary sits beside the archive, so it comes back even when the command is cut short.
STEPS=$DEST/steps.txt
mkdir -p "$RUN"
export RUST_LOG=${RUST_LOG:-warn}
rc=0
step() { # NAME TIMEOUT COMMAND...: one step, its log and its exit status in $RUN
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$RUN/$name.log" 2>&1
  local s=$?
  echo "step $name: exit $s in $((SECONDS - t0)) s" | tee -a "$STEPS"
  [ "$s" = 0 ] || rc=1
}
step cuda_fp8 150 "$BIN/cuda_fp8"
# GEMM_SWEEP=1: cuBLASLt's FP8 GEMM algorithms timed at the trace's step sizes (cuda_bench
# --fp8-gemm-sweep), first answer against fastest.
if [ "${GEMM_SWEEP:-0}" = 1 ]; then
  step fp8_gemm_sweep 150 "$BIN/cuda_bench" "$RUN/fp8_gemm_sweep.json" --fp8-gemm-sweep
  grep "^fp8 gemm" "$RUN/fp8_gemm_sweep.log" | sed 's/; all.*//' >> "$STEPS"
fi
export BENCH_RUNS=${BENCH_RUNS:-"bf16::;fp8::--quantization fp8;fp8_lm::--quantization fp8 --fp8-lm-head;fp8_lm_unfused:PRISM_LM_HEAD_NORM=0:--quantization fp8 --fp8-lm-head;fp8_kv8::--quantization fp8 --kv-cache-dtype fp8"}
export TRACE_RUNS=${TRACE_RUNS:-"bf16:;fp8:--quantization fp8;fp8_kv8:--quantization fp8 --kv-cache-dtype fp8"}
part() { # PART: one part of run_fp8.sh into $RUN
  local t0=$SECONDS
  OUT=$RUN BIN=$BIN PARTS=$1 bash scripts/gpu/run_fp8.sh > "$RUN/run_fp8_$1.log" 2>&1 || rc=1
  echo "step run_fp8 $1: $((SECONDS - t0)) s" | tee -a "$STEPS"
}
part bench
grep -H "decode b=1 \|decode b=256\|prefill 2048" "$RUN"/cuda_bench_*.log | sed "s|$RUN/||" | tee -a "$STEPS"
# Accuracy as run_fp8.sh's part does it, with ACCURACY_FLAGS passed to cuda_check (the FP8 run's
# options): the reference models, their FP8 checkpoints, then logits against HF f32 and 64 greedy
# tokens against bf16.
MODEL=/tmp/prism-hf-ref
rm -rf "$MODEL"
step hf_reference 240 python3 scripts/gpu/hf_reference.py "$MODEL"
step quantize_fp8 120 python3 scripts/quantize_fp8.py "$MODEL/trained" "$MODEL/trained/fp8"
python3 scripts/quantize_fp8.py "$MODEL" "$MODEL/fp8" >> "$RUN/quantize_fp8.log" 2>&1 || rc=1
# shellcheck disable=SC2086  # a list of flags
step cuda_check_fp8 120 env ${ACCURACY_ENV:-} "$BIN/cuda_check" "$MODEL" "$RUN/cuda_check_fp8.json" --fp8 ${ACCURACY_FLAGS:---fp8-lm-head}
tail -12 "$RUN/cuda_check_fp8.log" | tee -a "$STEPS"
part trace
cat "$RUN/fp8_trace_summary.txt" >> "$STEPS"
step cuda_masked_greedy 90 "$BIN/cuda_masked_greedy"
# The decode attention's correctness cases at head_dim 128 (no timing).
step attn_decode_check 90 "$BIN/cuda_attn_decode" "$RUN/attn_decode.json" 128
{ grep -c PASS "$RUN/attn_decode_check.log"; grep FAIL "$RUN/attn_decode_check.log" | head -5; } | tee -a "$STEPS"
rm -f "$RUN/trace.json"
tar czf "$DEST/fp8_verify.tgz" -C "$DEST" fp8_verify && rm -rf "$RUN"
exit $rc
