"""Where a /v1/score request's time goes (issue 47), in-process: a history of --history tokens and
--candidates candidates of --tokens tokens (token ids over the whole vocabulary, and items of a
random table by their tuples), each scored by execution/score_batch.py's ScoreBatch, interleaved
with the history's prefill alone (runner.prefill: what a 1-token completion's forward costs).

    .venv/bin/python perf/experiments/score_profile.py                      # medium, 1,000 + 100 x 4
    .venv/bin/python perf/experiments/score_profile.py --candidates 1000 --profile items

Prints, per workload, the median of --reps of score time / prefill time (each pair measured back to
back, so that a loaded machine slows both alike), wall and CPU time; --profile KIND also prints
cProfile's top functions of that workload. Run it with PYTHONPATH=. (else the package installed
in the environment is the one measured) or PYTHONPATH=<another checkout> to compare.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import servers
import torch
from cli import positive_ints

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.engine.score_request import ScoreRequest
from xllm_async.execution.item_trie import ItemTrie
from xllm_async.execution.score_batch import ScoreBatch
from xllm_async.runtime.model_runner import ModelRunner


def run_score(runner, requests: list[ScoreRequest]) -> None:
    batch = ScoreBatch(runner, requests)
    batch.prefill()
    while batch:
        batch.decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--history", type=int, default=1000)
    parser.add_argument("--candidates", type=positive_ints, default=[100], help="candidates a request, e.g. 100,1000")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--table", type=int, default=1520000, help="items in the random table (the issue's 1.52M)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", choices=["tokens", "items"], default=None)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: as set); 1 on a loaded machine: no waits for a second core, "
                             "and the CPU-time ratio then counts the work alone")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = servers.ensure_model(f"perf/results/models/qwen3-{args.size}")
    runner = ModelRunner(model, torch.device("cpu"), args.dtype)
    rng = random.Random(0)
    base, codes = 1000, 256
    keys = {tuple(base + c * codes + rng.randrange(codes) for c in range(args.tokens)) for _ in range(args.table)}
    keys = sorted(keys)
    trie = ItemTrie.of(keys, torch.device("cpu"))

    def history() -> list[int]:
        return [rng.randrange(200, 150000) for _ in range(args.history)]

    def workload(kind: str, count: int) -> list[ScoreRequest]:
        if kind == "tokens":
            cands = [[rng.randrange(200, 150000) for _ in range(args.tokens)] for _ in range(count)]
            return [ScoreRequest(0, history(), cands, None)]
        return [ScoreRequest(0, history(), [list(k) for k in rng.sample(keys, count)], None, trie=trie)]

    with torch.inference_mode():
        for kind in ("tokens", "items"):  # warm-up
            run_score(runner, workload(kind, args.candidates[0]))
            runner.prefill([history()])
        for count in args.candidates:
            for kind in ("tokens", "items"):
                ratios, cpu_ratios = [], []
                for _ in range(args.reps):
                    h = history()
                    started, cpu = time.perf_counter(), time.process_time()
                    runner.prefill([h])
                    prefill, prefill_cpu = time.perf_counter() - started, time.process_time() - cpu
                    requests = workload(kind, count)
                    started, cpu = time.perf_counter(), time.process_time()
                    run_score(runner, requests)
                    ratios.append((time.perf_counter() - started) / prefill)
                    cpu_ratios.append((time.process_time() - cpu) / prefill_cpu)
                print(f"{count} {kind} of {args.tokens} on {args.history}: score / prefill "
                      f"median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); "
                      f"CPU time median {statistics.median(cpu_ratios):.2f} (min {min(cpu_ratios):.2f})", flush=True)
                if args.profile == kind:
                    profile = cProfile.Profile()
                    requests = workload(kind, count)
                    profile.enable()
                    run_score(runner, requests)
                    profile.disable()
                    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
