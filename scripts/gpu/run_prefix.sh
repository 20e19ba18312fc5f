#!/usr/bin/env bash
# Prefix caching on one H200, Llama-3-8B shapes (synthetic seeded weights, bf16 safetensors), one
# replica through the whole stack (`prism up`: router, head, worker; OpenAI HTTP streaming,
# greedy, --ignore-eos so every request generates exactly its max_tokens: with random weights the
# outputs are noise, the shape of the trace is what matters), in one run:
#   1. the checkpoint (as run_stack_trace.sh builds it: make_trace.py + hf_trace.py --save, skipped
#      when $CKPT exists), then $CKPT_PC: the same weight files (symlinks) with a word-level
#      tokenizer and chat template in which every word of the benchmark's synthetic text is one token
#      (scripts/gpu/prefix_tokenizer.py), so chat prompts tokenize and share prefixes as text does.
#   2. `prism up` with the prefix cache on (the default): the multi-turn trace (chat, each turn
#      resends the history) and the random trace (control, token ids), same seed and rate;
#      then `prism up --no-enable-prefix-caching` and the same two runs.
#   3. bench/prefix/summarize.py: TTFT p50 off/on (target >= 3), output tok/s on/off (target >= 1.5)
#      on the multi-turn trace, output tok/s within 2% on the random one -> prefix_summary.json/.md,
#      and a `run_prefix: PASS|FAIL ...` line in steps.log; scripts/gpu/summarize.py -> summary.json.
# At most 8 files come back in $OUT: machine.txt, steps.log (every bench table), up_cache_on.log,
# up_cache_off.log, prefix_summary.json, prefix_summary.md, summary.json. The bench JSONs stay in
# $WORK. Sizes (env): MT_CONVERSATIONS [32] MT_TURNS [6] MT_SYSTEM_LEN [1024] MT_USER_LEN [128]
# MT_OUTPUT_LEN [32] RATE [32 req/s] RANDOM_INPUT_LEN [1536] RANDOM_OUTPUT_LEN [32] RANDOM_VOCAB
# [32000] (192 requests per run, Poisson arrivals). Device time: ~1.5 min for the checkpoint when absent, ~40 s per
# `prism up` load, ~15 s per bench run: ~4-5 min.
# Binaries prebuilt on the build machine into $BIN (default .gpu-bin):
#   cargo build --release -p prism-cli --features cuda && cp target/release/prism .gpu-bin/
# usage (repo root): [OUT=dir] [BIN=.gpu-bin] [RESULTS=bench/cuda/runN] bash scripts/gpu/run_prefix.sh
#   PREFIX_SMOKE=1 skips nvidia-smi (a CPU smoke test of everything but the GPU, with CKPT_PC, VOCAB
#   and small sizes set by the caller).
set -uo pipefail
. "$(dirname "$0")/run_common.sh"
OUT=$(gpu_out run_prefix)
BIN=${BIN:-.gpu-bin}
CKPT=${CKPT:-/tmp/prism-llama3-8b-synthetic}
CKPT_PC=${CKPT_PC:-/tmp/prism-llama3-8b-prefix}
WORK=${WORK:-/tmp/prism-prefix}
VOCAB=${VOCAB:-128256}
MT_CONVERSATIONS=${MT_CONVERSATIONS:-32} MT_TURNS=${MT_TURNS:-6} MT_SYSTEM_LEN=${MT_SYSTEM_LEN:-1024}
MT_USER_LEN=${MT_USER_LEN:-128} MT_OUTPUT_LEN=${MT_OUTPUT_LEN:-32} RATE=${RATE:-32}
RANDOM_INPUT_LEN=${RANDOM_INPUT_LEN:-1536} RANDOM_OUTPUT_LEN=${RANDOM_OUTPUT_LEN:-32} RANDOM_VOCAB=${RANDOM_VOCAB:-32000}
PORT=${PORT:-18000}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
STEPS="$OUT/steps.log"
if [ "${PREFIX_SMOKE:-0}" = 1 ]; then date -u +"date %Y-%m-%dT%H:%M:%SZ" > "$OUT/machine.txt"; else machine_txt "$OUT"; fi
rc=0
if [ "${PREFIX_SMOKE:-0}" != 1 ] && [ ! -f "$CKPT/config.json" ]; then
  python3 scripts/gpu/make_trace.py "$WORK/trace.json" >> "$STEPS" 2>&1 || exit 1
  timeout 300 python3 scripts/gpu/hf_trace.py "$WORK/trace.json" "$WORK/hf_save.json" --skip-trace --save "$CKPT" \
    > "$WORK/hf_save.log" 2>&1 || { tail -5 "$WORK/hf_save.log" | tee -a "$STEPS"; exit 1; }
  grep "saved the HF" "$WORK/hf_save.log" | tee -a "$STEPS"
fi
if [ "${PREFIX_SMOKE:-0}" != 1 ]; then
  # The weights and config of $CKPT, this run's tokenizer (run_stack_trace.sh's stays untouched).
  mkdir -p "$CKPT_PC"
  for f in "$CKPT"/*; do
    case "$(basename "$f")" in tokenizer.json|tokenizer_config.json) ;; *) ln -sf "$f" "$CKPT_PC/" ;; esac
  done
fi
# shellcheck disable=SC2086 # TOKENIZER_ARGS: several flags
python3 scripts/gpu/prefix_tokenizer.py "$CKPT_PC" --vocab-size "$VOCAB" ${TOKENIZER_ARGS:-} >> "$STEPS" 2>&1 \
  || { tail -3 "$STEPS"; exit 1; }
MT=(--dataset-name multi-turn --multi-turn-conversations "$MT_CONVERSATIONS" --multi-turn-turns "$MT_TURNS"
  --multi-turn-system-len "$MT_SYSTEM_LEN" --multi-turn-user-len "$MT_USER_LEN"
  --multi-turn-output-len "$MT_OUTPUT_LEN" --request-rate "$RATE" --seed 1)
RANDOM_TRACE=(--dataset-name random --random-input-len "$RANDOM_INPUT_LEN" --random-output-len "$RANDOM_OUTPUT_LEN"
  --random-vocab-size "$RANDOM_VOCAB" --num-prompts $((MT_CONVERSATIONS * MT_TURNS)) --request-rate "$RATE" --seed 2)
bench() { # RUN BACKEND ARGS...
  local run=$1 backend=$2; shift 2
  echo "== $run" | tee -a "$STEPS"
  timeout 240 "$BIN/prism" bench serve --base-url "http://127.0.0.1:$PORT" --backend "$backend" --model prefix-8b \
    --ignore-eos --temperature 0 --no-progress --label "$run" --metrics-url "http://127.0.0.1:$((PORT + 82))/metrics" \
    --result-file "$WORK/$run.json" "$@" 2>&1 | tee -a "$STEPS"
  [ "${PIPESTATUS[0]}" = 0 ] && cp "$WORK/$run.json" "$WORK/results/" || rc=1
}
serve() { # SIDE UP_FLAGS...: one `prism up`, both traces, SIGINT
  local side=$1; shift
  "$BIN/prism" up --model "$CKPT_PC" --served-model-name prefix-8b --port "$PORT" --grpc-port $((PORT + 51)) \
    --head-port $((PORT + 50)) --head-http-port $((PORT + 81)) --worker-port $((PORT + 61)) \
    --worker-http-port $((PORT + 82)) --max-queue-wait 120 "$@" > "$OUT/up_$side.log" 2>&1 &
  local up=$! ready=0
  for _ in $(seq 360); do
    grep -q "Prism is up" "$OUT/up_$side.log" 2>/dev/null && { ready=1; break; }
    kill -0 $up 2>/dev/null || break
    sleep 0.5
  done
  echo "$side: ready=$ready" | tee -a "$STEPS"
  if [ $ready = 1 ]; then
    bench "a_multi_turn_$side" openai-chat "${MT[@]}"
    bench "a_random_$side" openai "${RANDOM_TRACE[@]}"
  else
    tail -5 "$OUT/up_$side.log" | tee -a "$STEPS"
    rc=1
  fi
  kill -INT $up 2>/dev/null
  timeout 60 tail --pid=$up -f /dev/null
}
rm -rf "$WORK/results" && mkdir -p "$WORK/results"
serve cache_on
serve cache_off --no-enable-prefix-caching
python3 bench/prefix/summarize.py "$WORK/results" --name prefix_summary | tee -a "$STEPS"
cp "$WORK/results/prefix_summary.json" "$WORK/results/prefix_summary.md" "$OUT/" 2>/dev/null || rc=1
python3 - "$OUT/prefix_summary.json" <<'PY' | tee -a "$STEPS"
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("run_prefix: FAIL no prefix summary")
    sys.exit(1)
mt, rnd = s["single_replica"]["multi_turn"], s["single_replica"]["random"]
f = lambda v, d=2: "n/a" if v is None else f"{v:.{d}f}"
ok = mt.get("verdict") == "PASS" and rnd.get("verdict") == "PASS"
print(f"run_prefix: {'PASS' if ok else 'FAIL'} multi-turn TTFT p50 off/on {f(mt.get('ttft_p50_off_over_on'))}x "
      f"(>= 3), output tok/s on/off {f(mt.get('output_tok_s_on_over_off'), 3)}x (>= 1.5), hit rate "
      f"{f((mt.get('hit_rate') or {}).get('cache_on'), 3)}; random output tok/s on/off "
      f"{f(rnd.get('output_tok_s_on_over_off'), 3)}x (within 2%)")
sys.exit(0 if ok else 1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
[ "${PREFIX_SMOKE:-0}" = 1 ] && exit $rc
finish_run "$OUT" "BIN=$BIN bash scripts/gpu/run_prefix.sh" || rc=1
exit $rc
