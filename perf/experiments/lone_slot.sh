#!/usr/bin/env bash
# A lone request on fixed_steps N=2, before and after both slots have run alone once (perf/history/RESULTS-sessions-1-23.md,
# tenth session). Environment variables pass through to the server, e.g.
#   perf/lone_slot.sh                              # the defaults
#   XLLM_TORCH_THREADS=1 perf/lone_slot.sh         # one thread a slot, never two
#   OMP_WAIT_POLICY=ACTIVE perf/lone_slot.sh
# Prints seconds per request (SmolLM2, 128 tokens out, greedy, streamed).
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-8403}
.venv/bin/python server.py --port "$PORT" --log-level warning > /tmp/lone_slot_server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -s "localhost:$PORT/health" >/dev/null && break; sleep 0.5; done
request() {
  curl -sN "localhost:$PORT/v1/completions" -H 'content-type: application/json' \
    -d "{\"prompt\": [1, 504, 3827, 314, 1000, 2000, $1], \"max_tokens\": 128, \"temperature\": 0, \"ignore_eos\": true, \"stream\": true}" >/dev/null
}
timed() { local t0 t1; t0=$(date +%s.%N); request "$1"; t1=$(date +%s.%N); echo "$2: $(echo "$t1 - $t0" | bc) s"; }
timed 1 "fresh server, slot 0 alone"
request 2 & a=$!; sleep 0.3; request 3 & b=$!; wait $a $b   # side by side: each slot ends up alone once
for i in 4 5 6; do timed "$i" "after both slots have been alone"; done
