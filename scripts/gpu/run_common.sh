# Sourced by the run_*.sh scripts on the GPU machine: where the full logs go, the record of the
# machine, and the summary that gets committed.

# gpu_out NAME: the output folder: $OUT when set (the GPU machine's returned folder), else
# bench/out/NAME-<UTC time>, which git ignores.
gpu_out() {
  echo "${OUT:-$PWD/bench/out/$1-$(date -u +%Y%m%dT%H%M%SZ)}"
}

# machine_txt DIR: the date, each GPU (name, memory, driver, max SM clock) and the commit into
# DIR/machine.txt (read back by summarize.py), and printed.
machine_txt() {
  {
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    git rev-parse --short HEAD 2>/dev/null || true
  } > "$1/machine.txt" 2>&1
  cat "$1/machine.txt"
}

# finish_run DIR COMMAND: DIR/summary.json from the logs and JSON in DIR (scripts/gpu/summarize.py);
# with RESULTS=bench/cuda/runN set, also copied to $RESULTS/summary.json, the run's committed result.
finish_run() {
  python3 "${BASH_SOURCE[0]%/*}/summarize.py" "$1" --command "$2" || return 1
  if [ -n "${RESULTS:-}" ]; then
    mkdir -p "$RESULTS" && cp "$1/summary.json" "$RESULTS/summary.json" && echo "summary copied to $RESULTS/summary.json"
  fi
}
