#!/usr/bin/env bash
# Parallel CUDA replicas on one GPU: parity of TP=2 / PP=2 (host collectives, both ranks on GPU 0)
# and of a one-rank replica in a rank process with the unsharded backend and Hugging Face, the
# rank-process overhead at batch-1 decode (Llama-3-8B shape), and cuda_bench's batch-1 decode
# figure in the same run (the single-GPU path unchanged). Binaries come prebuilt in $BIN
# (bench/cuda/README.md: cuda_parallel, cuda_bench, prism-rank, all with --features cuda).
# Full logs to $OUT (default bench/out/run_parallel-<UTC time>, ignored by git; at most 8 files),
# with summary.json (scripts/gpu/summarize.py); RESULTS=bench/cuda/runN copies the summary there.
# Every step has its own timeout. PARTS picks the steps (default all three; the whole run can
# take more than one 10-minute command: run "parity" and "speed bench" as two commands).
#   usage (repo root): [OUT=dir] [BIN=.gpu-bin] [PARTS="parity speed bench"] [TWO_GPUS=1] [RESULTS=bench/cuda/runN] \
#                      bash scripts/gpu/run_parallel.sh
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_parallel)
BIN=${BIN:-.gpu-bin}
PARTS=${PARTS:-parity speed bench}
WORK=${WORK:-/tmp/prism-parallel}
MODEL=$WORK/hf-ref
CKPT=$WORK/llama3-8b-synthetic
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 RUST_LOG=${RUST_LOG:-info}
machine_txt "$OUT"
rc=0
for b in cuda_parallel cuda_bench prism-rank; do
  [ -x "$BIN/$b" ] || { echo "run_parallel: $BIN/$b is missing (see bench/cuda/README.md)" | tee -a "$OUT/machine.txt"; exit 1; }
done
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has parity; then
  # The trained reference model (clear greedy margins; hf_reference.py exits 3 when it is not).
  rm -rf "$MODEL"
  timeout 240 python3 scripts/gpu/hf_reference.py "$MODEL" 2>&1 | tee "$OUT/hf_reference.log" || rc=1
  if [ -f "$MODEL/trained/reference.json" ]; then
    # TWO_GPUS=1 (a two-GPU machine) adds the NCCL layouts (tp2_nccl, pp2_nccl).
    timeout 300 "$BIN/cuda_parallel" --rank-program "$BIN/prism-rank" --model "$MODEL/trained" \
      ${TWO_GPUS:+--two-gpus} 2>&1 \
      | tee "$OUT/cuda_parallel_parity.log" || rc=1
  else
    echo "cuda_parallel: FAIL (no trained reference model)" | tee "$OUT/cuda_parallel_parity.log"
    rc=1
  fi
fi

if has speed; then
  # The Llama-3-8B-shape checkpoint (seeded weights, bf16 safetensors, ~16 GB) both backends load.
  if [ ! -f "$CKPT/config.json" ]; then
    python3 scripts/gpu/make_trace.py "$WORK/trace.json" >/dev/null || exit 1
    timeout 240 python3 scripts/gpu/hf_trace.py "$WORK/trace.json" "$WORK/hf_save.json" --skip-trace --save "$CKPT" 2>&1 \
      | tee "$OUT/hf_save.log" || rc=1
  fi
  timeout 300 "$BIN/cuda_parallel" --rank-program "$BIN/prism-rank" --speed-model "$CKPT" --steps 300 2>&1 \
    | tee "$OUT/cuda_parallel_speed.log" || rc=1
fi

if has bench; then
  # The single-GPU benchmark as run_cuda.sh runs it: compare its batch-1 decode figure with
  # earlier runs (docs/benchmarks.md) to see the unsharded path unchanged.
  timeout 300 "$BIN/cuda_bench" "$OUT/cuda_bench.json" 2>&1 | tee "$OUT/cuda_bench.log" || rc=1
fi

finish_run "$OUT" "BIN=$BIN PARTS=\"$PARTS\" bash scripts/gpu/run_parallel.sh" || rc=1
exit $rc
