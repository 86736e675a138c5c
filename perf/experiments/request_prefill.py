"""A slot's prefill of one batch (perf/sweep.py's: 14 prompts of 320 random token ids, one token
out), timed in-process on one thread (issue 50's speed guard): runner.prefill, as the batch calls it
with no cache kept, in this checkout and in another (--other DIR), each in a subprocess, rounds
interleaved; the least of 10 repetitions' thread CPU time, median over rounds, in microseconds.

    .venv/bin/python perf/experiments/request_prefill.py --other /tmp/wt-before [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "perf/results/models/qwen3-tiny")


def child(checkout: str, model_dir: str, rows: int, length: int, threads: int) -> None:
    sys.path.insert(0, checkout)
    import torch

    import xllm_async  # noqa: F401  (its environment before torch's threads start)
    from xllm_async.runtime.model_runner import load_runner

    torch.set_num_threads(threads)
    runner = load_runner(model_dir, torch.device("cpu"))
    runner.set_kv_cache(None, 2)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 5000) for _ in range(length)] for _ in range(rows)]
    clock = time.thread_time if threads == 1 else time.perf_counter
    with torch.inference_mode():
        for _ in range(5):
            runner.prefill(prompts)
        best = float("inf")
        for _ in range(10):
            started = clock()
            for _ in range(5):
                runner.prefill(prompts)
            best = min(best, (clock() - started) / 5 * 1e6)
    print(f"{best:.1f}")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], *(int(v) for v in sys.argv[4:7]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True)
    parser.add_argument("--this", default=ROOT)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: thread CPU time is measured)")
    args = parser.parse_args()
    results = {"other": [], "this": []}
    for r in range(args.rounds):
        order = [("other", args.other), ("this", args.this)]
        for name, checkout in order if r % 2 == 0 else reversed(order):
            out = subprocess.run([sys.executable, __file__, "--child", os.path.abspath(checkout), args.model,
                                  str(args.rows), str(args.length), str(args.threads)],
                                 check=True, capture_output=True, text=True, cwd="/tmp").stdout
            results[name].append(float(out.split()[-1]))
    a, b = statistics.median(results["other"]), statistics.median(results["this"])
    print(f"prefill {args.rows}x{args.length}: other {a:.0f} us  this {b:.0f} us  this/other {b / a:.3f}  "
          f"(other {results['other']}, this {results['this']})")


if __name__ == "__main__":
    main()
