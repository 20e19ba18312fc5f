#!/usr/bin/env bash
# One run on the GPU machine for the CUDA backend: HF reference + correctness check, the engine's
# batching-changes-nothing body on CUDA, then the Llama-3-8B-shape benchmark. Binaries come
# prebuilt in .gpu-bin/ (built on the build machine:
# cargo build --release -p prism-engine --features cuda --examples). Full logs and JSON go to $OUT
# (default bench/out/run_cuda-<UTC time>, ignored by git), with summary.json (scripts/gpu/summarize.py)
# next to them; RESULTS=bench/cuda/runN also copies the summary there to be committed.
# Every step has its own timeout.
#   usage (from the repo root): [OUT=dir] [BIN=.gpu-bin] [RESULTS=bench/cuda/runN] bash scripts/gpu/run_cuda.sh
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_cuda)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RUST_LOG=${RUST_LOG:-info}
BIN=${BIN:-.gpu-bin}
machine_txt "$OUT"
# hf_reference.py writes the random-weight model to $MODEL and the trained one (clear greedy
# margins; it exits 3 and says so when training did not reach them) to $MODEL/trained.
MODEL=/tmp/prism-hf-ref
rm -rf "$MODEL"  # never check a stale model of an earlier run
rc=0
timeout 240 python3 scripts/gpu/hf_reference.py "$MODEL" 2>&1 | tee "$OUT/hf_reference.log" || rc=1
cp "$MODEL/config.json" "$OUT/hf_config.json" 2>/dev/null || true
# The trained model's reference without the logits (the margins, training losses, prompts).
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); [r.pop(k) for k in ("logits_f32","logits_bf16")]; json.dump(r,open(sys.argv[2],"w"))' \
  "$MODEL/trained/reference.json" "$OUT/hf_reference_trained.json" 2>/dev/null || true
if [ -f "$MODEL/reference.json" ]; then
  # Both models, both backend modes: logits within the HF bound; 64 greedy tokens == HF f32
  # strictly on the trained model (information on the random one). A missing trained model is
  # a FAIL that cuda_check reports after checking the random one.
  timeout 180 "$BIN/cuda_check" "$MODEL" "$OUT/cuda_check.json" 2>&1 | tee "$OUT/cuda_check.log" || rc=1
fi
if [ -f "$MODEL/trained/reference.json" ]; then
  # The engine's batching-changes-nothing body on CUDA (alone / batched / 7-token chunks /
  # preemption), on the trained model, in the batch-invariant and the fast mode.
  timeout 180 "$BIN/cuda_engine_parity" "$MODEL/trained" "$OUT/cuda_engine_parity.json" --both-modes 2>&1 \
    | tee "$OUT/cuda_engine_parity.log" || rc=1
else
  echo "run_cuda: no trained reference model: cuda_engine_parity skipped" | tee "$OUT/cuda_engine_parity.log"
  rc=1
fi
timeout 300 "$BIN/cuda_bench" "$OUT/cuda_bench.json" 2>&1 | tee "$OUT/cuda_bench.log" || rc=1
finish_run "$OUT" "BIN=$BIN bash scripts/gpu/run_cuda.sh" || rc=1
exit $rc
