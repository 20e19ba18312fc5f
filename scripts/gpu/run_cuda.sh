#!/usr/bin/env bash
# One run on the GPU machine for the CUDA backend (issue 6): HF reference + correctness check,
# then the Llama-3-8B-shape benchmark. Binaries come prebuilt in .gpu-bin/ (built on the build
# machine: cargo build --release -p prism-worker --features cuda --examples). Logs and JSON go
# to $OUT (or ./gpu-out). Every step has its own timeout.
#   usage (from the repo root): bash scripts/gpu/run_cuda.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RUST_LOG=${RUST_LOG:-info}
BIN=${BIN:-.gpu-bin}
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  git rev-parse --short HEAD 2>/dev/null || true
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
MODEL=/tmp/prism-hf-ref
rc=0
timeout 240 python3 scripts/gpu/hf_reference.py "$MODEL" 2>&1 | tee "$OUT/hf_reference.log" || rc=1
cp "$MODEL/config.json" "$OUT/hf_config.json" 2>/dev/null || true
if [ -f "$MODEL/reference.json" ]; then
  timeout 180 "$BIN/cuda_check" "$MODEL" "$OUT/cuda_check.json" 2>&1 | tee "$OUT/cuda_check.log" || rc=1
  # The engine's batching-changes-nothing body on CUDA (alone / batched / 7-token chunks / preemption).
  timeout 180 "$BIN/cuda_engine_parity" "$MODEL" "$OUT/cuda_engine_parity.json" 2>&1 | tee "$OUT/cuda_engine_parity.log" || rc=1
fi
timeout 300 "$BIN/cuda_bench" "$OUT/cuda_bench.json" 2>&1 | tee "$OUT/cuda_bench.log" || rc=1
exit $rc
