#!/usr/bin/env bash
# make test-stability: the whole suite RUNS times in a row (default 5) on a fresh clone of this
# repository's committed HEAD, each through .ci/run as CI runs it, then LOADED times (default 1)
# with a CPU burner on every core, started and stopped here. One summary line per run; the exit
# status is non-zero if any run failed. Logs stay in the printed folder.
set -uo pipefail
RUNS=${RUNS:-5}
LOADED=${LOADED:-1}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d -t xllm-stability-XXXXXX)
burners=()

stop_burners() {
    for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null; done
    burners=()
}
trap stop_burners EXIT
trap 'stop_burners; exit 130' INT TERM  # stopped from outside: end here, not go on with the next run

git clone -q "$repo" "$work/clone"
echo "stability: $(git -C "$work/clone" rev-parse --short HEAD) cloned into $work/clone; logs in $work"
cd "$work/clone"
failed=0

run() {  # run <label>
    local started=$SECONDS log="$work/$1.log" result
    if bash .ci/run >"$log" 2>&1; then result=pass; else result=FAIL; failed=1; fi
    echo "run $1: $result in $((SECONDS - started)) s: $(grep -E '(passed|failed|error)' "$log" | tail -1)"
}

for i in $(seq 1 "$RUNS"); do run "$i"; done
for i in $(seq 1 "$LOADED"); do
    for _ in $(seq 1 "$(nproc)"); do yes >/dev/null & burners+=("$!"); done
    run "loaded-$i (${#burners[@]} CPU burners)"
    stop_burners
done
exit $failed
