#!/usr/bin/env bash
# The redesign's speed guard (issue 36): this checkout against another one (a worktree of the commit
# before the change), interleaved, fresh servers each round, on this machine:
#   - the seed workload (320 in / 1 out, c2 and c32, the default configuration),
#   - SmolLM2-135M-Instruct 128 in / 128 out at 1 and 8 clients,
#   - beam 128 on a 1,000-token prompt with and without an item table (one request at a time),
#   - the open-loop run (Poisson arrivals at 50% and 80% of the baseline's capacity).
# Each figure of "after" should be at least 0.97x "before"; the tables land in OUT.
#
#     git worktree add --detach /tmp/wt-before <commit>   # then, from this checkout:
#     bash perf/guard.sh /tmp/wt-before [OUT]
set -euo pipefail
BEFORE=${1:?usage: perf/guard.sh PATH-OF-THE-CHECKOUT-BEFORE [OUT]}
OUT=${2:-perf/results/guard-$(date +%Y%m%d-%H%M)}
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-3}
SEED_ROUNDS=${SEED_ROUNDS:-6}  # a seed point lasts a second or two and moves +-20% between rounds
BEFORE=$(cd "$BEFORE" && pwd)
mkdir -p "$OUT"
SMOL=$("$PY" -m xllm_async.runtime.default_model)

"$PY" perf/sweep.py --concurrency 2,32 --random-input 320 --random-output 1 --num-prompts 2000 \
    --rounds "$SEED_ROUNDS" --config "before=@$BEFORE" --config "after=" --out-dir "$OUT/seed" | tee "$OUT/seed.txt"

"$PY" perf/sweep.py --model "$SMOL" --concurrency 1,8 --random-input 128 --random-output 128 --num-prompts 32 \
    --warmup-prompts 4 --rounds "$ROUNDS" --config "before=@$BEFORE" --config "after=" --out-dir "$OUT/smollm2" \
    | tee "$OUT/smollm2.txt"

for round in $(seq "$ROUNDS"); do
    for side in before after; do
        checkout=(); [ "$side" = before ] && checkout=(--checkout "$BEFORE")
        "$PY" perf/beams.py --widths 128 --tables none,items --repetitions 7 "${checkout[@]}" \
            | tee "$OUT/beams-$side-$round.txt"
    done
done

"$PY" perf/open_loop.py --config "before=@$BEFORE" --config "after=" --rounds "$ROUNDS" | tee "$OUT/open_loop.txt"
echo "guard: tables in $OUT"
