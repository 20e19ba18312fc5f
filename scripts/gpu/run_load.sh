#!/usr/bin/env bash
# Loading a real-size Hugging Face checkpoint on the GPU machine: hf_trace.py builds the
# Llama-3-8B-shape model with the same seeded weights as CudaBackend::synthetic and saves it as
# bf16 safetensors; cuda_trace loads it with CudaBackend::from_safetensors (--model) and the probe
# logits must equal the synthetic backend's. Prints both init times. Full outputs to $OUT (default
# bench/out/run_load-<UTC time>, ignored by git) with summary.json (scripts/gpu/summarize.py);
# RESULTS=bench/cuda/runN also copies the summary there to be committed.
#   usage (repo root, binaries in $BIN): [OUT=dir] [BIN=.gpu-bin] [RESULTS=bench/cuda/runN] bash scripts/gpu/run_load.sh
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_load)
BIN=${BIN:-.gpu-bin}
CKPT=${CKPT:-/tmp/prism-llama3-8b-synthetic}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
machine_txt "$OUT"
rc=0
python3 scripts/gpu/make_trace.py "$OUT/trace.json" >/dev/null || exit 1
timeout 150 "$BIN/cuda_trace" "$OUT/trace.json" "$OUT/load_synthetic.json" --probe-only 2>&1 | tee "$OUT/load_synthetic.log" || rc=1
rm -rf "$CKPT"
timeout 240 python3 scripts/gpu/hf_trace.py "$OUT/trace.json" "$OUT/load_hf.json" --skip-trace --save "$CKPT" 2>&1 | tee "$OUT/load_hf.log" || rc=1
du -sh "$CKPT" | tee -a "$OUT/load_hf.log"
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
timeout 200 "$BIN/cuda_trace" "$OUT/trace.json" "$OUT/load_safetensors.json" --probe-only --model "$CKPT" 2>&1 \
  | tee "$OUT/load_safetensors.log" || rc=1
python3 - "$OUT/load_synthetic.probe.f32" "$OUT/load_safetensors.probe.f32" "$OUT/load_synthetic.json" "$OUT/load_safetensors.json" <<'PY' | tee "$OUT/load_summary.txt"
import json, sys, array
a, b = array.array("f"), array.array("f")
a.frombytes(open(sys.argv[1], "rb").read()); b.frombytes(open(sys.argv[2], "rb").read())
d = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) and a else float("nan")
s, t = json.load(open(sys.argv[3])), json.load(open(sys.argv[4]))
ok = len(a) == len(b) and d == 0.0
print(f"{'PASS' if ok else 'FAIL'} load: probe logits from_safetensors vs synthetic max |diff| {d} over {len(a)} logits; "
      f"init synthetic {s.get('init_seconds', 0):.1f}s, from_safetensors {t.get('init_seconds', 0):.1f}s")
sys.exit(0 if ok else 1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
finish_run "$OUT" "BIN=$BIN bash scripts/gpu/run_load.sh" || rc=1
exit $rc
