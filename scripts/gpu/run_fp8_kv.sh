#!/usr/bin/env bash
# FP8-KV attention on the GPU machine, in order of importance within one device run: the FP8 unit
# checks (tests/cuda_fp8.rs), the decode attention micro-benchmark (bf16 vs FP8-KV kernels on the
# same values), the serving trace (bf16, FP8 weights, FP8 weights + FP8 KV), cuda_bench --quick
# (the same three), then the prefill attention micro-benchmark. Binaries in $B (built on the build
# machine, stripped): cuda_fp8 (test binary), cuda_attn_decode, cuda_attn_prefill, cuda_bench,
# cuda_trace. Logs and JSON into $OUT.
#   usage (from the repo root): [OUT=dir] [B=.gpu-bin] bash scripts/gpu/run_fp8_kv.sh
set -uo pipefail
B=${B:-.gpu-bin}
OUT=${OUT:-bench/out/run_k-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/machine.txt"
grep -m1 "model name" /proc/cpuinfo | tee -a "$OUT/machine.txt"

step "tests/cuda_fp8.rs"
timeout 60 "$B/cuda_fp8" --test-threads=1 --nocapture > "$OUT/cuda_fp8.log" 2>&1; echo "exit $?" >> "$OUT/cuda_fp8.log"
grep -E "^test |max \|out|exit|result" "$OUT/cuda_fp8.log" | grep -v "GEMM\|GEMV\|quantiz" | tail -12

step "cuda_attn_decode --fp8"
timeout 60 "$B/cuda_attn_decode" "$OUT/cuda_attn_decode_fp8.json" --fp8 > "$OUT/cuda_attn_decode_fp8.log" 2>&1; echo "exit $?" >> "$OUT/cuda_attn_decode_fp8.log"
grep -c PASS "$OUT/cuda_attn_decode_fp8.log"; grep -E "FAIL|occupancy caps|cap= 1:|cuda_attn_decode|exit" "$OUT/cuda_attn_decode_fp8.log" | tail -30

step "trace + bench"
OUT="$OUT/run_fp8" BIN="$B" PARTS="trace bench" \
  BENCH_RUNS="bf16::;fp8::--quantization fp8;fp8_kv8::--quantization fp8 --kv-cache-dtype fp8" \
  timeout 200 bash scripts/gpu/run_fp8.sh > "$OUT/run_fp8.log" 2>&1
grep -E "SUMMARY|trace: 512|decode b=|prefill|tok/s" "$OUT/run_fp8.log" | tail -40

step "cuda_attn_prefill --fp8"
timeout 40 "$B/cuda_attn_prefill" "$OUT/cuda_attn_prefill_fp8.json" --fp8 > "$OUT/cuda_attn_prefill_fp8.log" 2>&1; echo "exit $?" >> "$OUT/cuda_attn_prefill_fp8.log"
grep -E "FAIL|TIME|cuda_attn_prefill|exit" "$OUT/cuda_attn_prefill_fp8.log" | tail -12
step done
