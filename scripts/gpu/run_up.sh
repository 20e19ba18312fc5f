#!/usr/bin/env bash
# `prism up` on the GPU machine with the CUDA build of the CLI (`cargo build --release -p prism-cli
# --features cuda`): the worker must discover the GPU and place the replica on it. Serves MODEL
# (default: the trained reference model written by hf_reference.py), then checks
#   - `prism status` shows a GPU group (an NVIDIA device) for the Ready replica,
#   - nvidia-smi lists the prism process holding GPU memory,
#   - a chat completion and a streamed completion answer 200 with text,
# and stops it with SIGINT (drain, exit 0). Full outputs to $OUT (default bench/out/run_up-<UTC time>,
# ignored by git) with summary.json; RESULTS=bench/cuda/runN also copies the summary there.
#   usage (repo root, binaries in $BIN): [OUT=dir] [BIN=.gpu-bin] [MODEL=dir] bash scripts/gpu/run_up.sh
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_up)
BIN=${BIN:-.gpu-bin}
mkdir -p "$OUT"
machine_txt "$OUT"
rc=0
MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
  MODEL=/tmp/prism-ref
  [ -d "$MODEL/trained" ] || timeout 300 python3 scripts/gpu/hf_reference.py "$MODEL" > "$OUT/hf_reference.log" 2>&1
  MODEL="$MODEL/trained"
fi
PORT=18000
"$BIN/prism" up --model "$MODEL" --served-model-name ref --port $PORT --grpc-port 18051 --head-port 18050 \
  --head-http-port 18081 --worker-port 18061 --worker-http-port 18082 > "$OUT/up.log" 2>&1 &
UP=$!
ready=0
for _ in $(seq 240); do
  if curl -sf "http://127.0.0.1:$PORT/v1/models" 2>/dev/null | grep -q '"ref"'; then
    grep -q "Prism is up" "$OUT/up.log" && { ready=1; break; }
  fi
  kill -0 $UP 2>/dev/null || break
  sleep 0.5
done
echo "ready=$ready" | tee "$OUT/up_check.txt"
"$BIN/prism" status --head http://127.0.0.1:18050 > "$OUT/status.txt" 2>&1
cat "$OUT/status.txt"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$OUT/gpu_apps.csv" 2>&1
cat "$OUT/gpu_apps.csv"
curl -s -o "$OUT/chat.json" -w "%{http_code}\n" "http://127.0.0.1:$PORT/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "ref", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "temperature": 0}' \
  > "$OUT/chat_status.txt"
curl -sN -o "$OUT/stream.txt" -w "%{http_code}\n" "http://127.0.0.1:$PORT/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "ref", "prompt": "the", "max_tokens": 16, "temperature": 0, "stream": true}' > "$OUT/stream_status.txt"
kill -INT $UP 2>/dev/null
timeout 60 tail --pid=$UP -f /dev/null
wait $UP
up_rc=$?
echo "up_exit=$up_rc" >> "$OUT/up_check.txt"
python3 - "$OUT" <<'PY' | tee "$OUT/up_summary.txt"
import json, sys, os
out = sys.argv[1]
read = lambda f: open(os.path.join(out, f)).read() if os.path.exists(os.path.join(out, f)) else ""
status = read("status.txt")
apps = read("gpu_apps.csv")
chat_code = read("chat_status.txt").strip()
stream_code = read("stream_status.txt").strip()
try:
    chat = json.loads(read("chat.json"))
    text = chat["choices"][0]["message"]["content"]
    tokens = chat["usage"]["completion_tokens"]
except Exception:
    text, tokens = None, 0
stream_ok = stream_code == "200" and "data: [DONE]" in read("stream.txt")
gpu_in_status = "H200" in status or "NVIDIA" in status
gpu_mem = any(l for l in apps.splitlines()[1:] if "prism" in l)
exit_line = [l for l in read("up_check.txt").splitlines() if l.startswith("up_exit=")]
ok = "ready=1" in read("up_check.txt") and gpu_in_status and gpu_mem and chat_code == "200" and tokens > 0 and stream_ok
print(f"{'PASS' if ok else 'FAIL'} prism up on the GPU: gpu_in_status={gpu_in_status} gpu_process={gpu_mem} "
      f"chat={chat_code} completion_tokens={tokens} stream={stream_code}/{stream_ok} {exit_line}")
sys.exit(0 if ok else 1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
finish_run "$OUT" "BIN=$BIN bash scripts/gpu/run_up.sh" || rc=1
exit $rc
