#!/usr/bin/env bash
# Prefix caching and cache-aware routing on the CPU backend, in one run (one head on an embedded
# store, three workers with one CPU slot each so that each worker's /metrics is one replica's,
# two routers: A with --routing-policy prefix-aware, B with --routing-policy p2c; the bundled
# SmolLM2 GGUF; `prism bench serve` over OpenAI HTTP, streaming, --ignore-eos, greedy):
#   (a) one replica, prefix cache on ("pc-on") vs off ("pc-off", engine.enable_prefix_caching:
#       false), same seed and request rate: the multi-turn trace (each turn resends the history)
#       and the random trace (control). TTFT p50, output tok/s, cached tokens. The control runs
#       twice, in the order on, off, off, on (the second pair with another seed, so that cache-on
#       does not hit the first pair's prompts): drift in the machine's load cancels out of the
#       mean throughput, which is what must stay within 2 %.
#   (b) the shared-prefix trace (prefix_repetition: PR_PREFIXES prefixes of PR_PREFIX_LEN tokens,
#       token-id prompts) and the shared-system-prompt trace (one SP_PREFIX_LEN-word system
#       message, short user turns, chat) on one replica ("pc-on") and on three ("pc-three")
#       through router A and router B, the three replicas restarted (cold caches) before each
#       three-replica run: cluster prefix-cache hit rate and max/mean requests per replica.
# Every figure goes to $OUT/summary.json and $OUT/summary.md (bench/prefix/summarize.py); the
# bench JSONs, logs and `prism status` stay next to them.
#   usage (repo root, after `cargo build -p prism-head -p prism-worker -p prism-router -p prism-cli`):
#   [BIN=target/debug] [OUT=dir] [ONLY=a|b] bash bench/prefix/run_cpu.sh
# Sizes (env, defaults in brackets) keep the run near 10-15 minutes on 2 cores:
#   MT_CONVERSATIONS [6] MT_TURNS [4] MT_SYSTEM_LEN [192] MT_USER_LEN [32] MT_OUTPUT_LEN [32]
#   MT_RATE [1 req/s: beyond one replica's capacity without the cache, within it with the cache];
#   RANDOM_INPUT_LEN [192] RANDOM_OUTPUT_LEN [32] RANDOM_PROMPTS (the control: as many requests as the
#   multi-turn trace, the same rate, so capacity-bound: its throughput measures the cache's
#   overhead); PR_PROMPTS [60] PR_PREFIXES [10] PR_PREFIX_LEN [256] PR_SUFFIX_LEN [32]
#   PR_OUTPUT_LEN [16] PR_RATE [0.75]; SP_PROMPTS [30] SP_PREFIX_LEN [1000] SP_SUFFIX_LEN [32]
#   SP_OUTPUT_LEN [16] SP_RATE [0.75] (the shared-prefix rates stay within what three
#   single-thread replicas on two cores serve, where routing, not queueing, decides the hit rate);
#   KV_BYTES [256 MiB per replica: 5,824 tokens], ENGINE_THREADS [1; empty: every core].
set -uo pipefail
BIN=${BIN:-target/debug}
OUT=${OUT:-bench/prefix/run-$(date -u +%Y%m%dT%H%M%SZ)}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
ONLY=${ONLY:-ab}
KV_BYTES=${KV_BYTES:-268435456}
# Compute threads per replica (empty: the worker's default, every core). One keeps three replicas
# on two cores from oversubscribing them, and every run uses the same engine.
ENGINE_THREADS=${ENGINE_THREADS-1}
MT_CONVERSATIONS=${MT_CONVERSATIONS:-6} MT_TURNS=${MT_TURNS:-4} MT_SYSTEM_LEN=${MT_SYSTEM_LEN:-192}
MT_USER_LEN=${MT_USER_LEN:-32} MT_OUTPUT_LEN=${MT_OUTPUT_LEN:-32} MT_RATE=${MT_RATE:-1}
RANDOM_INPUT_LEN=${RANDOM_INPUT_LEN:-192} RANDOM_OUTPUT_LEN=${RANDOM_OUTPUT_LEN:-32}
RANDOM_PROMPTS=${RANDOM_PROMPTS:-$((MT_CONVERSATIONS * MT_TURNS))}
PR_PROMPTS=${PR_PROMPTS:-60} PR_PREFIXES=${PR_PREFIXES:-10} PR_PREFIX_LEN=${PR_PREFIX_LEN:-256}
PR_SUFFIX_LEN=${PR_SUFFIX_LEN:-32} PR_OUTPUT_LEN=${PR_OUTPUT_LEN:-16} PR_RATE=${PR_RATE:-0.75}
SP_PROMPTS=${SP_PROMPTS:-30} SP_PREFIX_LEN=${SP_PREFIX_LEN:-1000} SP_SUFFIX_LEN=${SP_SUFFIX_LEN:-32}
SP_OUTPUT_LEN=${SP_OUTPUT_LEN:-16} SP_RATE=${SP_RATE:-0.75}
mkdir -p "$OUT"
STARTED=$(date +%s)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HG=$(free_port); HH=$(free_port); AH=$(free_port); AG=$(free_port); BH=$(free_port); BG=$(free_port)
HEAD="http://127.0.0.1:$HG"
"$BIN/prism-head" --store "embedded:$OUT/state.json" --listen "127.0.0.1:$HG" --http-listen "127.0.0.1:$HH" \
  > "$OUT/head.log" 2>&1 & PIDS+=($!)
sleep 1
METRICS=()
for w in 1 2 3; do
  WG=$(free_port); WH=$(free_port)
  "$BIN/prism-worker" --head "$HEAD" --node-id "w$w" --listen "127.0.0.1:$WG" --http-listen "127.0.0.1:$WH" \
    --cpu-slots 1 --kv-cache-bytes "$KV_BYTES" ${ENGINE_THREADS:+--engine-threads "$ENGINE_THREADS"} \
    > "$OUT/worker$w.log" 2>&1 & PIDS+=($!)
  METRICS+=(--metrics-url "http://127.0.0.1:$WH/metrics")
done
# The routing policy flag comes with cache-aware routing; without it both routers route alike.
if "$BIN/prism-router" --help 2>&1 | grep -q -- '--routing-policy'; then
  POLICY_A=(--routing-policy prefix-aware); POLICY_B=(--routing-policy p2c); POLICIES=1
else
  POLICY_A=(); POLICY_B=(); POLICIES=0
  echo "note: $BIN/prism-router has no --routing-policy; routers A and B both use the default policy" \
    | tee "$OUT/note.txt"
fi
"$BIN/prism-router" --head "$HEAD" --http-listen "127.0.0.1:$AH" --grpc-listen "127.0.0.1:$AG" "${POLICY_A[@]}" \
  --max-queue-wait 300 > "$OUT/router_prefix_aware.log" 2>&1 & PIDS+=($!)
"$BIN/prism-router" --head "$HEAD" --http-listen "127.0.0.1:$BH" --grpc-listen "127.0.0.1:$BG" "${POLICY_B[@]}" \
  --max-queue-wait 300 > "$OUT/router_p2c.log" 2>&1 & PIDS+=($!)
sleep 2
prism() { "$BIN/prism" --head "$HEAD" "$@"; }
deploy() { # NAME REPLICAS ENGINE_EXTRA
  printf 'name: %s\nmodel: %s\nserved_model_name: %s\nreplicas: %s\nengine:\n  max_num_seqs: 8\n%s' \
    "$1" "$PWD/$MODEL" "$1" "$2" "${3:-}" > "$OUT/$1.yaml"
  prism deploy -f "$OUT/$1.yaml" >> "$OUT/deploy.log" 2>&1
}
ready_count() { prism status 2>/dev/null | grep -cE "^\s*$1-[0-9a-z]+\s.*\bReady\b"; }
replica_count() { prism status 2>/dev/null | grep -cE "^\s*$1-[0-9a-z]+\s"; }
wait_ready() { # NAME COUNT
  for _ in $(seq 480); do
    # Ready, then a load report or two (about a second each) so the routers know the replicas.
    [ "$(ready_count "$1")" -ge "$2" ] && { sleep 3; return 0; }
    sleep 0.5
  done
  echo "$1: fewer than $2 replicas Ready" >&2; prism status >&2; return 1
}
restart() { # NAME COUNT: stop every replica, then start COUNT fresh ones (cold prefix caches)
  prism scale "$1" 0 >> "$OUT/deploy.log" 2>&1
  for _ in $(seq 240); do [ "$(replica_count "$1")" = 0 ] && break; sleep 0.5; done
  prism scale "$1" "$2" >> "$OUT/deploy.log" 2>&1
  wait_ready "$1" "$2"
}
bench() { # RUN BASE MODEL BACKEND ARGS...
  local run=$1 base=$2 model=$3 backend=$4; shift 4
  echo "== $run ($(( $(date +%s) - STARTED )) s in)"
  "$BIN/prism" bench serve --backend "$backend" --base-url "$base" --model "$model" --ignore-eos --no-progress \
    --temperature 0 "${METRICS[@]}" --label "$run" --result-file "$OUT/$run.json" "$@" > "$OUT/$run.log" 2>&1 \
    || echo "$run: prism bench serve failed (see $OUT/$run.log)"
  grep -E "Successful|Failed requests|duration|Output token|Median TTFT|cached|hit rate|per worker" "$OUT/$run.log" \
    | sed 's/^/   /'
}
A="http://127.0.0.1:$AH"; B="http://127.0.0.1:$BH"
MT=(--dataset-name multi-turn --multi-turn-conversations "$MT_CONVERSATIONS" --multi-turn-turns "$MT_TURNS"
  --multi-turn-system-len "$MT_SYSTEM_LEN" --multi-turn-user-len "$MT_USER_LEN"
  --multi-turn-output-len "$MT_OUTPUT_LEN" --request-rate "$MT_RATE" --seed 1)
RANDOM_TRACE=(--dataset-name random --random-input-len "$RANDOM_INPUT_LEN" --random-output-len "$RANDOM_OUTPUT_LEN"
  --num-prompts "$RANDOM_PROMPTS" --request-rate "$MT_RATE")
PR=(--dataset-name prefix_repetition --prefix-repetition-num-prefixes "$PR_PREFIXES"
  --prefix-repetition-prefix-len "$PR_PREFIX_LEN" --prefix-repetition-suffix-len "$PR_SUFFIX_LEN"
  --prefix-repetition-output-len "$PR_OUTPUT_LEN" --num-prompts "$PR_PROMPTS" --request-rate "$PR_RATE" --seed 3)
SP=(--dataset-name prefix_repetition --prefix-repetition-num-prefixes 1
  --prefix-repetition-prefix-len "$SP_PREFIX_LEN" --prefix-repetition-suffix-len "$SP_SUFFIX_LEN"
  --prefix-repetition-output-len "$SP_OUTPUT_LEN" --num-prompts "$SP_PROMPTS" --request-rate "$SP_RATE" --seed 4)

deploy pc-on 1 && wait_ready pc-on 1 || exit 1
if [[ $ONLY == *a* ]]; then
  deploy pc-off 1 "  enable_prefix_caching: false
" && wait_ready pc-off 1 || exit 1
  # Interleaved on / off, so a drift in the machine's load hits both sides alike.
  bench a_multi_turn_cache_on "$A" pc-on openai-chat "${MT[@]}"
  bench a_multi_turn_cache_off "$A" pc-off openai-chat "${MT[@]}"
  bench a_random_cache_on "$A" pc-on openai "${RANDOM_TRACE[@]}" --seed 2
  bench a_random_cache_off "$A" pc-off openai "${RANDOM_TRACE[@]}" --seed 2
  bench a_random_cache_off_2 "$A" pc-off openai "${RANDOM_TRACE[@]}" --seed 5
  bench a_random_cache_on_2 "$A" pc-on openai "${RANDOM_TRACE[@]}" --seed 5
  prism scale pc-off 0 >> "$OUT/deploy.log" 2>&1
fi
if [[ $ONLY == *b* ]]; then
  bench b_shared_prefix_1_replica "$A" pc-on openai "${PR[@]}"
  bench b_system_prompt_1_replica "$A" pc-on openai-chat "${SP[@]}"
  prism scale pc-on 0 >> "$OUT/deploy.log" 2>&1
  prism scale pc-off 0 >> "$OUT/deploy.log" 2>&1
  for _ in $(seq 240); do [ "$(replica_count pc-on)$(replica_count pc-off)" = 00 ] && break; sleep 0.5; done
  deploy pc-three 3 && wait_ready pc-three 3 || exit 1
  bench b_shared_prefix_3_replicas_prefix_aware "$A" pc-three openai "${PR[@]}"
  restart pc-three 3 || exit 1
  bench b_shared_prefix_3_replicas_p2c "$B" pc-three openai "${PR[@]}"
  restart pc-three 3 || exit 1
  bench b_system_prompt_3_replicas_prefix_aware "$A" pc-three openai-chat "${SP[@]}"
  restart pc-three 3 || exit 1
  bench b_system_prompt_3_replicas_p2c "$B" pc-three openai-chat "${SP[@]}"
fi
prism status > "$OUT/status.txt" 2>&1
lscpu | grep -E "Model name|^CPU\(s\)" > "$OUT/cpu.txt"
cat > "$OUT/settings.json" <<EOF
{"routing_policy_flag": $POLICIES, "kv_cache_bytes": $KV_BYTES, "engine_threads": "${ENGINE_THREADS:-all cores}",
 "wall_s": $(( $(date +%s) - STARTED )),
 "multi_turn": {"conversations": $MT_CONVERSATIONS, "turns": $MT_TURNS, "system_len": $MT_SYSTEM_LEN,
   "user_len": $MT_USER_LEN, "output_len": $MT_OUTPUT_LEN, "rate": $MT_RATE},
 "random": {"prompts": $RANDOM_PROMPTS, "input_len": $RANDOM_INPUT_LEN, "output_len": $RANDOM_OUTPUT_LEN,
   "rate": $MT_RATE},
 "shared_prefix": {"prompts": $PR_PROMPTS, "prefixes": $PR_PREFIXES, "prefix_len": $PR_PREFIX_LEN,
   "suffix_len": $PR_SUFFIX_LEN, "output_len": $PR_OUTPUT_LEN, "rate": $PR_RATE},
 "system_prompt": {"prompts": $SP_PROMPTS, "prefix_len": $SP_PREFIX_LEN, "suffix_len": $SP_SUFFIX_LEN,
   "output_len": $SP_OUTPUT_LEN, "rate": $SP_RATE}}
EOF
python3 bench/prefix/summarize.py "$OUT"
