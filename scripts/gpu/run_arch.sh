#!/usr/bin/env bash
# One run on the GPU machine for the CUDA backend's model families: HF references of Qwen2, Qwen3,
# Mistral and Gemma 3 at small shapes and of Gemma 3 270M at its real config (seeded random
# weights, scripts/gpu/hf_arch_cuda.py), cuda_arch_check against them (with the 270M's greedy
# check and timings); each when its binary is in $BIN: the head_dim-256 cases of
# cuda_attn_decode and cuda_attn_prefill (alongside the HF step) and the K-quant GEMV
# micro-benchmark cuda_kquant_gemv (before cuda_arch_check, on a quiet GPU), and at the end the
# Llama-3-8B-shape cuda_bench of the binary before the change ($BIN/cuda_bench_before) and
# after ($BIN/cuda_bench), one after the other on the same GPU. Binaries prebuilt
# (cargo build --release -p prism-engine --features cuda --example cuda_arch_check
# [--example cuda_attn_decode --example cuda_attn_prefill --example cuda_kquant_gemv
# --example cuda_bench]). Logs and JSON go to $OUT.
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
stamp() { echo "[$(date -u +%T)] $*"; }
# The head_dim-256 attention checks run alongside the HF step (their timings are taken on a GPU
# shared with it: information only); cuda_arch_check starts once both are done.
attn_hd256() {
  local r=0 b
  for b in cuda_attn_decode cuda_attn_prefill; do
    if [ -x "$BIN/$b" ]; then
      timeout 90 "$BIN/$b" "$OUT/${b}_hd256.json" 256 > "$OUT/${b}_hd256.log" 2>&1 || r=1
      echo "[$(date -u +%T)] $b 256: rc $r" >> "$OUT/attn_hd256.log"
    fi
  done
  return $r
}
stamp "hf_arch_cuda (+ attention head_dim 256 alongside)"
attn_hd256 &
attn_pid=$!
timeout 150 python3 "$(dirname "$0")/hf_arch_cuda.py" "$MODEL" 2>&1 | tee "$OUT/hf_arch_cuda.log" || rc=1
stamp "waiting for the attention checks"
wait $attn_pid || rc=1
for b in cuda_attn_decode cuda_attn_prefill; do
  [ -f "$OUT/${b}_hd256.log" ] && grep -E "FAIL|PASS|TIME|error" "$OUT/${b}_hd256.log" | tail -30
done
if [ -x "$BIN/cuda_kquant_gemv" ]; then
  stamp cuda_kquant_gemv
  timeout 90 "$BIN/cuda_kquant_gemv" "$OUT/cuda_kquant_gemv.json" 2>&1 | tee "$OUT/cuda_kquant_gemv.log" || rc=1
fi
stamp cuda_arch_check
timeout 150 "$BIN/cuda_arch_check" "$MODEL" "$OUT/cuda_arch_check.json" 2>&1 | tee "$OUT/cuda_arch_check.log" || rc=1
for b in cuda_bench_before cuda_bench; do
  if [ -x "$BIN/$b" ]; then
    stamp "$b"
    timeout 150 "$BIN/$b" "$OUT/$b.json" 2>&1 | tee "$OUT/$b.log" || rc=1
  fi
done
stamp "run_arch: rc $rc"
exit $rc
