#!/usr/bin/env bash
# SIGTERM -> router route update latency over N drain trials (issue 7), on a real local
# cluster: etcd, prism-head, 3 prism-worker on the bundled SmolLM2 GGUF (CPU), prism-router,
# 4 closed-loop greedy streaming clients checked token by token the whole time.
# Each trial SIGTERMs the next worker (30 s grace), times SIGTERM -> the router's ListModels
# showing one ready replica fewer, checks exit 0 and that nothing was dispatched to the
# drained replica after the update, then restarts the worker (schedulable again on register).
#
# Usage: bench/drain/run.sh [TRIALS]   (default 20; writes bench/drain/results.json)
set -euo pipefail
cd "$(dirname "$0")/../.."
trials="${1:-20}"
out="$PWD/bench/drain/results.json"
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || scripts/fetch-model.sh
cargo build --bins
PRISM_REQUIRE_MODEL=1 PRISM_DRAIN_TRIALS="$trials" PRISM_DRAIN_BENCH_OUT="$out" \
  cargo test -p prism-tests --test drain_sigterm sigterm_under_streaming_load_loses_nothing -- --nocapture
echo "results: $out"
cat "$out"
