#!/usr/bin/env bash
# Router benchmark: prism-router + mock engine (no model, tokens returned instantly) vs a
# Ray Serve 2.60 no-op deployment, same machine, same load generator, same run.
# Usage: bench/router/run.sh [seconds per point]   (RAY_VENV=/tmp/rayvenv by default)
# Prints one JSON line per point and a Markdown table (append it to docs/benchmarks.md), and writes
# bench/router/results.json (the committed result: the points + meta, see bench/summary.py). The
# processes' logs and the points go to $OUT (default bench/out/router-<UTC time>, ignored by git).
set -euo pipefail
cd "$(dirname "$0")/../.."
DUR=${1:-10}
RAY_VENV=${RAY_VENV:-/tmp/rayvenv}
BIN=${CARGO_TARGET_DIR:-target}/release
LOGS=${OUT:-$PWD/bench/out/router-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$LOGS"
cargo build --release -q -p prism-router --features mock-engine --bins
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_http() { # url, seconds
  local end=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    [ $SECONDS -lt $end ] || { echo "timeout waiting for $1" >&2; return 1; }
    sleep 0.2
  done
}

$BIN/mock-engine --listen 127.0.0.1:50161 --tokens 1 >"$LOGS/mock-engine.log" 2>&1 & PIDS+=($!)
RUST_LOG=warn $BIN/prism-router --http-listen 127.0.0.1:18000 --grpc-listen 127.0.0.1:15051 \
  --static-route mock=http://127.0.0.1:50161 >"$LOGS/prism-router.log" 2>&1 & PIDS+=($!)
wait_http http://127.0.0.1:18000/health 30

BODY='{"model":"mock","prompt":"hi","max_tokens":1}'
RESULTS=()
for c in 1 64; do
  RESULTS+=("$($BIN/prism-loadgen --url http://127.0.0.1:18000/v1/completions --body "$BODY" \
    --concurrency $c --duration "$DUR" --label prism-router)")
  echo "${RESULTS[-1]}"
done
cleanup; PIDS=()

if [ -x "$RAY_VENV/bin/python" ]; then
  "$RAY_VENV/bin/python" bench/router/ray_noop.py 18001 >"$LOGS/ray.log" 2>&1 & PIDS+=($!)
  end=$((SECONDS + 180))
  until grep -q READY "$LOGS/ray.log"; do
    [ $SECONDS -lt $end ] || { echo "ray serve did not start" >&2; tail "$LOGS/ray.log" >&2; exit 1; }
    sleep 1
  done
  for c in 1 64; do
    RESULTS+=("$($BIN/prism-loadgen --url http://127.0.0.1:18001/ --body "$BODY" \
      --concurrency $c --duration "$DUR" --label ray-serve-2.60)")
    echo "${RESULTS[-1]}"
  done
  cleanup; wait "${PIDS[@]}" 2>/dev/null || true; PIDS=()  # SIGTERM: the script shuts Serve and Ray down
else
  echo "no Ray venv at $RAY_VENV: python3 -m venv $RAY_VENV && $RAY_VENV/bin/pip install 'ray[serve]==2.60.0'" >&2
fi

echo
echo "| system | concurrency | req/s | p50 ms | p90 ms | p99 ms | errors |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for r in "${RESULTS[@]}"; do
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print("| {label} | {concurrency} | {rps:.0f} | {p50_ms:.3f} | {p90_ms:.3f} | {p99_ms:.3f} | {errors} |".format(**d))' "$r"
done
printf '%s\n' "${RESULTS[@]}" > "$LOGS/points.jsonl"
python3 -c 'import json,sys; json.dump([json.loads(l) for l in open(sys.argv[1]) if l.strip()], open(sys.argv[2], "w"))' \
  "$LOGS/points.jsonl" "$LOGS/points.json"
python3 bench/summary.py "$LOGS/points.json" bench/router/results.json --command "bench/router/run.sh $DUR" \
  --logs "${LOGS#"$PWD"/}"
echo "results: bench/router/results.json; logs: $LOGS"
