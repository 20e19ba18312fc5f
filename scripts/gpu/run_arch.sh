#!/usr/bin/env bash
# One run on the GPU machine for the CUDA backend's model families: HF references of Qwen2, Qwen3,
# Mistral and Gemma 3 (scripts/gpu/hf_arch_cuda.py), cuda_arch_check against them, then the
# Llama-3-8B-shape cuda_bench of the binary before the change ($BIN/cuda_bench_before, when
# present) and after ($BIN/cuda_bench), one after the other on the same GPU. Binaries prebuilt in
# .gpu-bin/ (cargo build --release -p prism-engine --features cuda --example cuda_arch_check
# --example cuda_bench). Logs and JSON go to $OUT.
#   usage (from the repo root): [OUT=dir] [BIN=.gpu-bin] bash scripts/gpu/run_arch.sh
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_arch)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RUST_LOG=${RUST_LOG:-warn}
BIN=${BIN:-.gpu-bin}
machine_txt "$OUT"
MODEL=/tmp/prism-hf-arch
rm -rf "$MODEL"
rc=0
timeout 120 python3 "$(dirname "$0")/hf_arch_cuda.py" "$MODEL" 2>&1 | tee "$OUT/hf_arch_cuda.log" || rc=1
timeout 120 "$BIN/cuda_arch_check" "$MODEL" "$OUT/cuda_arch_check.json" 2>&1 | tee "$OUT/cuda_arch_check.log" || rc=1
for b in cuda_bench_before cuda_bench; do
  if [ -x "$BIN/$b" ]; then
    timeout 150 "$BIN/$b" "$OUT/$b.json" 2>&1 | tee "$OUT/$b.log" || rc=1
  fi
done
echo "run_arch: rc $rc"
exit $rc
