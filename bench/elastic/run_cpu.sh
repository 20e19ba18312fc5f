#!/usr/bin/env bash
# Elastic capacity on the CPU backend, side by side in one run (one head on an embedded store,
# one worker with 4 CPU slots, the bundled SmolLM2 GGUF; `prism bench serve` over OpenAI HTTP,
# streaming):
#   1. burst: 10x max_num_seqs (8) = 80 requests at once on one replica, through
#      router A (the admission queue, defaults) and router B (--max-queued-requests 0: the
#      old behaviour, a fixed in-flight limit and 429 beyond it).
#   2. ramp: a linear ramp 1 -> 8 req/s over 64 requests (64 in, 64 out) against a fixed one-replica
#      deployment ("fixed") and an autoscaled one ("auto", min 1, max 3, target 2 ongoing
#      requests per replica, upscale 2 s, downscale 20 s, look-back 3 s), both max_num_seqs 4;
#      goodput under TTFT < 2 s / TPOT < 200 ms (CPU-sized SLOs) and TTFT p99.
# Results (JSON from prism bench serve, logs) go to $OUT (default bench/out/elastic-<UTC time>);
# a one-line summary per run is printed and written to $OUT/summary.txt.
#   usage (repo root, after `cargo build -p prism-head -p prism-worker -p prism-router -p prism-cli`):
#   [BIN=target/debug] [OUT=dir] bash bench/elastic/run_cpu.sh
set -uo pipefail
BIN=${BIN:-target/debug}
OUT=${OUT:-bench/out/elastic-$(date -u +%Y%m%dT%H%M%SZ)}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$OUT"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HG=$(free_port); HH=$(free_port); WG=$(free_port); WH=$(free_port)
AH=$(free_port); AG=$(free_port); BH=$(free_port); BG=$(free_port)
"$BIN/prism-head" --store "embedded:$OUT/state.json" --listen "127.0.0.1:$HG" --http-listen "127.0.0.1:$HH" \
  > "$OUT/head.log" 2>&1 & PIDS+=($!)
sleep 1
"$BIN/prism-worker" --head "http://127.0.0.1:$HG" --node-id w1 --listen "127.0.0.1:$WG" --http-listen "127.0.0.1:$WH" \
  --cpu-slots 4 --kv-cache-bytes 67108864 > "$OUT/worker.log" 2>&1 & PIDS+=($!)
"$BIN/prism-router" --head "http://127.0.0.1:$HG" --http-listen "127.0.0.1:$AH" --grpc-listen "127.0.0.1:$AG" \
  > "$OUT/router_a.log" 2>&1 & PIDS+=($!)
"$BIN/prism-router" --head "http://127.0.0.1:$HG" --http-listen "127.0.0.1:$BH" --grpc-listen "127.0.0.1:$BG" \
  --max-queued-requests 0 > "$OUT/router_b.log" 2>&1 & PIDS+=($!)
sleep 2
deploy() { # NAME REPLICAS_OR_AUTOSCALING MAX_NUM_SEQS
  printf 'name: %s\nmodel: %s\nserved_model_name: %s\n%s\nengine:\n  max_num_seqs: %s\n' "$1" "$PWD/$MODEL" "$1" "$2" "$3" \
    > "$OUT/$1.yaml"
  "$BIN/prism" --head "http://127.0.0.1:$HG" deploy -f "$OUT/$1.yaml" >> "$OUT/deploy.log" 2>&1
}
wait_ready() { # MODEL
  for _ in $(seq 240); do
    # Ready, then one load report (about a second) so routers know its capacity.
    "$BIN/prism" --head "http://127.0.0.1:$HG" status 2>/dev/null | grep -q "$1-.*Ready" && { sleep 3; return 0; }
    sleep 0.5
  done
  echo "$1 not Ready" >&2; return 1
}
bench() { # NAME BASE MODEL ARGS...
  local name=$1 base=$2 model=$3; shift 3
  "$BIN/prism" bench serve --backend openai --base-url "$base" --model "$model" --ignore-eos --no-progress \
    --result-file "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  python3 - "$OUT/$name.json" "$name" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
g = r.get("request_goodput")
print(f"{sys.argv[2]}: completed {r['completed']}/{r['num_prompts']}, failures {r['failures'] or 0}, "
      f"{r['duration']:.1f} s, output {r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms "
      f"p99 {r['p99_ttft_ms']:.0f} ms, TPOT p50 {r['median_tpot_ms']:.0f} ms"
      + (f", goodput {g:.2f} req/s" if g is not None else ""))
PY
}
deploy burst "replicas: 1" 8 && wait_ready burst || exit 1
BURST=(--dataset-name random --random-input-len 64 --random-output-len 32 --num-prompts 80 --request-rate inf --seed 1)
bench burst_queue "http://127.0.0.1:$AH" burst "${BURST[@]}"
bench burst_fixed_limit "http://127.0.0.1:$BH" burst "${BURST[@]}"
"$BIN/prism" --head "http://127.0.0.1:$HG" scale burst 0 >> "$OUT/deploy.log" 2>&1 || true
deploy fixed "replicas: 1" 4 && wait_ready fixed || exit 1
deploy auto "autoscaling_config:
  min_replicas: 1
  max_replicas: 3
  target_ongoing_requests: 2
  upscale_delay_s: 2
  downscale_delay_s: 20
  look_back_period_s: 3" 4 && wait_ready auto || exit 1
RAMP=(--dataset-name random --random-input-len 64 --random-output-len 64 --num-prompts 64 --seed 2
  --ramp-up-strategy linear --ramp-up-start-rps 1 --ramp-up-end-rps 8 --goodput ttft:2000 tpot:200)
bench ramp_fixed "http://127.0.0.1:$AH" fixed "${RAMP[@]}"
bench ramp_autoscaled "http://127.0.0.1:$AH" auto "${RAMP[@]}"
curl -s "http://127.0.0.1:$HH/v1/events" > "$OUT/events.json"
"$BIN/prism" --head "http://127.0.0.1:$HG" status > "$OUT/status.txt" 2>&1
lscpu | grep -E "Model name|^CPU\(s\)" > "$OUT/cpu.txt"
cat "$OUT/cpu.txt"
