#!/usr/bin/env bash
# SIGTERM -> router route update latency over N drain trials, on a real local cluster: etcd,
# prism-head, 3 prism-worker on the bundled SmolLM2 GGUF (CPU), prism-router, 4 closed-loop
# greedy streaming clients checked token by token the whole time.
# Each trial SIGTERMs the next worker (30 s grace), times SIGTERM -> the router's ListModels
# showing one ready replica fewer, checks exit 0 and that nothing was dispatched to the
# drained replica after the update, then restarts the worker (schedulable again on register).
#
# Usage: bench/drain/run.sh [TRIALS]   (default 20)
# Writes bench/drain/results.json (the committed result: latencies + meta, see bench/summary.py);
# the full build and test logs go to $OUT (default bench/out/drain-<UTC time>, ignored by git).
set -euo pipefail
cd "$(dirname "$0")/../.."
trials="${1:-20}"
logs="${OUT:-$PWD/bench/out/drain-$(date -u +%Y%m%dT%H%M%SZ)}"
out="$PWD/bench/drain/results.json"
mkdir -p "$logs"
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || scripts/fetch-model.sh
cargo build --bins 2>&1 | tee "$logs/build.log"
PRISM_REQUIRE_MODEL=1 PRISM_DRAIN_TRIALS="$trials" PRISM_DRAIN_BENCH_OUT="$logs/drain_sigterm.json" \
  cargo test -p prism-tests --test drain_sigterm sigterm_under_streaming_load_loses_nothing -- --nocapture 2>&1 \
  | tee "$logs/drain_sigterm.log"
python3 bench/summary.py "$logs/drain_sigterm.json" "$out" --command "bench/drain/run.sh $trials" --logs "${logs#"$PWD"/}"
echo "full logs: $logs"
echo "results: $out"
cat "$out"
