#!/usr/bin/env bash
# mTLS overhead on the router's no-op path: two prism-routers + two mock engines side by side,
# one pair plaintext, one pair with mutual TLS on router -> worker (certificates made here with
# openssl), the same closed-loop load generator, rounds interleaved (plain, mTLS, plain, ...)
# so a noisy shared machine disturbs both alike.
# Usage: bench/router/mtls.sh [seconds per point] [rounds]
# Prints one JSON line per point, then a Markdown table of the medians over the rounds.
set -euo pipefail
cd "$(dirname "$0")/../.."
DUR=${1:-5}
ROUNDS=${2:-3}
BIN=${CARGO_TARGET_DIR:-target}/release
LOGS=${OUT:-$PWD/bench/out/router-mtls-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$LOGS/tls"
cargo build --release -q -p prism-router --features mock-engine --bins
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

( cd "$LOGS/tls"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.crt -days 1 \
    -subj /CN=bench-ca 2>/dev/null
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > ext.cnf
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key -out tls.csr -subj /CN=bench \
    2>/dev/null
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 1 -extfile ext.cnf \
    2>/dev/null )
TLS=(--tls-cert "$LOGS/tls/tls.crt" --tls-key "$LOGS/tls/tls.key" --tls-ca "$LOGS/tls/ca.crt")

wait_http() { # url, seconds
  local end=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    [ $SECONDS -lt $end ] || { echo "timeout waiting for $1" >&2; return 1; }
    sleep 0.2
  done
}

$BIN/mock-engine --listen 127.0.0.1:50171 --tokens 1 >"$LOGS/mock-plain.log" 2>&1 & PIDS+=($!)
$BIN/mock-engine --listen 127.0.0.1:50172 --tokens 1 "${TLS[@]}" >"$LOGS/mock-mtls.log" 2>&1 & PIDS+=($!)
RUST_LOG=warn $BIN/prism-router --http-listen 127.0.0.1:18010 --grpc-listen 127.0.0.1:15061 \
  --static-route mock=http://127.0.0.1:50171 >"$LOGS/router-plain.log" 2>&1 & PIDS+=($!)
RUST_LOG=warn $BIN/prism-router --http-listen 127.0.0.1:18011 --grpc-listen 127.0.0.1:15062 \
  --static-route mock=https://127.0.0.1:50172 "${TLS[@]}" >"$LOGS/router-mtls.log" 2>&1 & PIDS+=($!)
wait_http http://127.0.0.1:18010/health 30
wait_http http://127.0.0.1:18011/health 30

BODY='{"model":"mock","prompt":"hi","max_tokens":1}'
: > "$LOGS/points.jsonl"
for round in $(seq "$ROUNDS"); do
  for c in 1 64; do
    for pair in "plain 18010" "mtls 18011"; do
      set -- $pair
      line=$($BIN/prism-loadgen --url "http://127.0.0.1:$2/v1/completions" --body "$BODY" \
        --concurrency $c --duration "$DUR" --label "$1")
      echo "$line" | tee -a "$LOGS/points.jsonl"
    done
  done
done
echo "round $ROUNDS done" >&2

python3 - "$LOGS/points.jsonl" <<'PY'
import json, statistics, sys
pts = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| router -> worker | concurrency | req/s (median) | p50 ms (median) | p99 ms (median) | errors | rounds |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for c in sorted({p["concurrency"] for p in pts}):
    for label in ("plain", "mtls"):
        ps = [p for p in pts if p["label"] == label and p["concurrency"] == c]
        med = lambda k: statistics.median(p[k] for p in ps)
        print(f"| {label} | {c} | {med('rps'):.0f} | {med('p50_ms'):.3f} | {med('p99_ms'):.3f} | "
              f"{sum(p['errors'] for p in ps)} | {len(ps)} |")
PY
echo "logs: $LOGS"
