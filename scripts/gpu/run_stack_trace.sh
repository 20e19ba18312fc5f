#!/usr/bin/env bash
# The 512-request serving trace sent all at once through the whole stack (`prism up`: router,
# head, worker on one H200; OpenAI HTTP, streaming) next to the engine alone, in one run:
#   1. scripts/gpu/make_trace.py: the trace (seeded) -> $WORK/trace.json, and the same requests as
#      JSONL for `prism bench serve` (token-id prompts, max_tokens = output_len, ignore_eos).
#   2. $BIN/cuda_trace: the engine alone, Llama-3-8B shapes, seeded weights, the trace at once.
#   3. scripts/gpu/hf_trace.py --save: the same seeded weights as a bf16 safetensors checkpoint,
#      given a 128,256-token WordLevel tokenizer (t0 ... t128255) so the trace's ids are valid.
#   4. `prism up` on that checkpoint (engine defaults, like step 2), then
#      `prism bench serve --request-rate inf` over OpenAI HTTP streaming: every request at once.
#   5. SUMMARY: rejected (429) and failed counts (target 0), stack output tok/s vs the engine's
#      (target >= 97%).
# Binaries prebuilt on the build machine into $BIN (default .gpu-bin):
#   cargo build --release -p prism-cli --features cuda && cp target/release/prism .gpu-bin/
#   cargo build --release -p prism-engine --features cuda --examples && cp target/release/examples/cuda_trace .gpu-bin/
# usage (repo root): [OUT=dir] [BIN=.gpu-bin] [RESULTS=bench/cuda/runN] bash scripts/gpu/run_stack_trace.sh
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_stack_trace)
BIN=${BIN:-.gpu-bin}
CKPT=${CKPT:-/tmp/prism-llama3-8b-synthetic}
# Inputs and bulky outputs stay out of $OUT (the device returns at most 8 files from it).
WORK=${WORK:-/tmp/prism-stack-trace}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
machine_txt "$OUT"
rc=0
python3 scripts/gpu/make_trace.py "$WORK/trace.json" || exit 1
python3 - "$WORK/trace.json" "$WORK/trace.jsonl" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
with open(sys.argv[2], "w") as f:
    for r in t["requests"]:
        f.write(json.dumps({"prompt": r["prompt"], "output_len": r["output_len"]}, separators=(",", ":")) + "\n")
PY
timeout 240 "$BIN/cuda_trace" "$WORK/trace.json" "$WORK/cuda_trace.json" --timeout-s 200 2>&1 | tee -a "$OUT/steps.log" || rc=1
cp "$WORK/cuda_trace.json" "$OUT/" 2>/dev/null
if [ ! -f "$CKPT/config.json" ]; then
  timeout 240 python3 scripts/gpu/hf_trace.py "$WORK/trace.json" "$WORK/hf_save.json" --skip-trace --save "$CKPT" \
    > "$WORK/hf_save.log" 2>&1 || rc=1
fi
python3 - "$CKPT" <<'PY' || rc=1
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers
d = sys.argv[1]
vocab = {f"t{i}": i for i in range(128256)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(f"{d}/tokenizer.json")
json.dump({"bos_token": "t128000", "eos_token": "t128001", "model_max_length": 8192,
           "tokenizer_class": "PreTrainedTokenizerFast"}, open(f"{d}/tokenizer_config.json", "w"))
PY
PORT=18000
"$BIN/prism" up --model "$CKPT" --served-model-name llama3-8b-shape --port $PORT --grpc-port 18051 --head-port 18050 \
  --head-http-port 18081 --worker-port 18061 --worker-http-port 18082 > "$OUT/up.log" 2>&1 &
UP=$!
ready=0
for _ in $(seq 360); do
  grep -q "Prism is up" "$OUT/up.log" 2>/dev/null && { ready=1; break; }
  kill -0 $UP 2>/dev/null || break
  sleep 0.5
done
echo "ready=$ready" | tee -a "$OUT/steps.log"
if [ $ready = 1 ]; then
  timeout 300 "$BIN/prism" bench serve --base-url "http://127.0.0.1:$PORT" --backend openai --model llama3-8b-shape \
    --dataset-name jsonl --dataset-path "$WORK/trace.jsonl" --num-prompts 512 --request-rate inf --ignore-eos \
    --no-progress --result-file "$OUT/stack_bench.json" 2>&1 | tee -a "$OUT/steps.log" || rc=1
  curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/router_metrics.txt"
else
  rc=1
fi
kill -INT $UP 2>/dev/null
timeout 60 tail --pid=$UP -f /dev/null
python3 - "$WORK/cuda_trace.json" "$OUT/stack_bench.json" <<'PY' | tee "$OUT/stack_summary.txt"
import json, sys
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None
eng, st = load(sys.argv[1]), load(sys.argv[2])
if not eng or not st:
    print(f"FAIL stack trace: engine result {'ok' if eng else 'missing'}, stack result {'ok' if st else 'missing'}")
    sys.exit(1)
e = eng["result"]["output_tokens_per_s"]
s = st["output_throughput"]
failed = st.get("failed", -1)
rejected = sum(n for k, n in st.get("failures", {}).items() if "429" in k or "ResourceExhausted" in k)
ratio = s / e if e else 0.0
ok = failed == 0 and st.get("completed") == 512 and ratio >= 0.97
print(f"{'PASS' if ok else 'FAIL'} stack trace: prism up {s:.0f} output tok/s vs engine alone {e:.0f} = {100 * ratio:.1f}% "
      f"(target >= 97%); completed {st.get('completed')}/512, failed {failed}, 429s {rejected}; "
      f"TTFT p50 {st.get('median_ttft_ms', 0):.0f} ms p99 {st.get('p99_ttft_ms', 0):.0f} ms")
sys.exit(0 if ok else 1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
finish_run "$OUT" "BIN=$BIN bash scripts/gpu/run_stack_trace.sh" || rc=1
exit $rc
