"""What the prefix cache costs where nothing repeats (issue 48), in-process and offline: batches of
one-token requests (prompts of --length random tokens, never seen before) prefilled through our
runner with the cache off and on, interleaved, and the on path taken apart.

The on path is the served one (engine/budget.py, execution/prepare.py, runtime/model_runner.py):
each prompt matched at admission (hashing its blocks, the lookup, pinning), then the prefill with a
slab to hold its keys (claim: the held hits pinned again; the forward writes every layer's keys
into the slab), then keep_all (blocks taken in the store and the prompt's keys copied into them),
then the pins released. The figures are medians of --reps batches a point, per batch, in ms; the
machine may be shared, so read the ratios, not the times.

    .venv/bin/python perf/prefix_miss.py                                   # small model, 320 tokens
    .venv/bin/python perf/prefix_miss.py --sizes 2 --reps 40 --profile     # + cProfile of the on path
    .venv/bin/python perf/prefix_miss.py --shared 896 --length 64 --sizes 8,16 --reps 10   # a shared prefix
    .venv/bin/python perf/prefix_miss.py --admit all       # every prompt's blocks kept (before second sight)

Since issue 48's second sight (model/seen_blocks.py; --admit second, the default) a never-seen
prompt keeps nothing: "keep" is then the admission (admitted) and an empty reserve and commit.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import os
import pstats
import random
import statistics
import sys
import time
from collections import defaultdict

# This checkout's package, not the one the virtual environment was installed from (a worktree's).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import xllm_async  # noqa: E402, F401  (OpenMP settings before torch loads)
from xllm_async.model import prefix_cache  # noqa: E402
from xllm_async.runtime.model_runner import ModelRunner  # noqa: E402

# The on path's pieces, timed by wrapping the store's methods (what each wraps: see main()); write:
# the forward's writes of new blocks into the store (prefix_cache.BlockWrites, after issue 48).
PIECES = ("match", "claim", "keep", "write", "release")


class Timed:
    """Seconds spent in wrapped callables, by name, since the last reset."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - began
                self.calls[name] += 1
        return timed

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="perf/results/models/qwen3-small")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--length", type=int, default=320, help="tokens a prompt")
    parser.add_argument("--sizes", default="1,2,8,16", help="prompts a batch")
    parser.add_argument("--reps", type=int, default=30, help="batches a point and mode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a slot's on fixed_steps N=2 here)")
    parser.add_argument("--kv-bytes", type=float, default=2.0, help="GiB of keys and values, half for the store")
    parser.add_argument("--shared", type=int, default=0, help="tokens a batch's prompts share before their own "
                        "--length (a new prefix each batch): the batch's shared prefix computed once (issue 48)")
    parser.add_argument("--touch", action="store_true", help="write the whole store once before measuring "
                        "(a long-running server's: no page is new)")
    parser.add_argument("--admit", default="second", choices=("second", "all"),
                        help="which blocks the store keeps (XLLM_PREFIX_CACHE_ADMIT), where this version has it")
    parser.add_argument("--profile", action="store_true", help="cProfile the on path's batches of the last size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(args.model, torch.device("cpu"), args.dtype)
    admit = (args.admit,) if "prefix_admit" in inspect.signature(runner.set_kv_cache).parameters else ()
    runner.set_kv_cache(int(args.kv_bytes * 2**30), 1, 0.5, *admit)
    store = runner.prefix_store
    timed = Timed()
    # (instance attributes: the runner and the bench call them through the store object; the names
    # of both versions, before issue 48 (keep_all: copies from the slab) and after (reserve, the
    # forward's writes, commit))
    for piece, names in (("match", ("match",)), ("claim", ("claim", "load")),
                         ("keep", ("keep_all", "admitted", "reserve", "commit", "abandon")),
                         ("release", ("release_all", "release"))):
        for name in names:
            if hasattr(store, name):
                setattr(store, name, timed.wrap(piece, getattr(store, name)))
    copies = Timed()
    store._blocks = copies.wrap("blocks", store._blocks)  # (before: a copy of every layer a call)
    if hasattr(prefix_cache, "BlockWrites"):
        write = timed.wrap("write", prefix_cache.BlockWrites.write)

        def counted(writes, layer, k, v):
            copies.calls["blocks"] += 2 * len(writes.runs)  # (after: keys and values, a copy a run)
            write(writes, layer, k, v)
        prefix_cache.BlockWrites.write = counted
    rng = random.Random(0)
    sizes = [int(s) for s in args.sizes.split(",")]

    def prompts(n: int) -> list[list[int]]:
        shared = [rng.randrange(200, 150000) for _ in range(args.shared)]
        return [shared + [rng.randrange(200, 150000) for _ in range(args.length)] for _ in range(n)]

    def off(batch: list[list[int]]):
        runner.prefix_store = None
        return runner.prefill(batch, 0)

    def on(batch: list[list[int]]):
        runner.prefix_store = store
        hits = [store.match(p) for p in batch]  # (admission: BatchBudget.take)
        try:
            return runner.prefill(batch, 0, hits=hits)
        finally:
            for hit in hits:  # (execution/prepare.py's admitted_prefixes)
                store.release(hit)

    results: dict[tuple[int, str], list[float]] = defaultdict(list)  # wall seconds a batch
    cpu: dict[tuple[int, str], list[float]] = defaultdict(list)  # this thread's CPU seconds a batch
    pieces: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    copies_a_batch: dict[int, list[int]] = defaultdict(list)
    same = True
    with torch.inference_mode():
        for size in sizes:  # (warm: oneDNN's kernels, the arena's pages)
            off(prompts(size)), on(prompts(size))
        if args.touch:
            store._pool.zero_()
        for rep in range(args.reps):
            for size in sizes:
                batch = prompts(size)
                order = ("off", "on") if rep % 2 == 0 else ("on", "off")
                logits = {}
                for mode in order:
                    timed.reset()
                    copies.reset()
                    began, began_cpu = time.perf_counter(), time.thread_time()
                    logits[mode] = (off if mode == "off" else on)(batch).logits
                    results[size, mode].append(time.perf_counter() - began)
                    cpu[size, mode].append(time.thread_time() - began_cpu)
                    if mode == "on":
                        for piece in PIECES:
                            pieces[size][piece].append(timed.spent.get(piece, 0.0))
                        copies_a_batch[size].append(copies.calls.get("blocks", 0))
                same = same and torch.equal(logits["off"].argmax(-1), logits["on"].argmax(-1))
        if args.profile:
            profiler = cProfile.Profile()
            batches = [prompts(sizes[-1]) for _ in range(args.reps)]
            profiler.enable()
            for batch in batches:
                on(batch)
            profiler.disable()
    print(f"{xllm_async.__file__}: {args.model}, {runner.dtype}, {torch.get_num_threads()} thread(s), "
          f"{args.length}-token prompts never seen (after {args.shared} tokens a batch's prompts share), "
          f"1 token out; medians of {args.reps} batches (ms a batch); "
          f"store {store.capacity} blocks of {prefix_cache.BLOCK_TOKENS}, {store.used} used at the end, "
          f"admit {args.admit if admit else 'all (no choice in this version)'}")
    # on / off: the batches a second the cache on runs, against off (1.0: it costs nothing); of the
    # medians, the median of each pair's (same batch, back to back), and of CPU time.
    print("| prompts a batch | off | on | on / off | pairs | CPU | match | claim | keep | write | release "
          "| rest (slab, forward) | copies into the store |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        t_off = statistics.median(results[size, "off"]) * 1e3
        t_on = statistics.median(results[size, "on"]) * 1e3
        pairs = statistics.median(a / b for a, b in zip(results[size, "off"], results[size, "on"]))
        by_cpu = statistics.median(cpu[size, "off"]) / statistics.median(cpu[size, "on"])
        parts = {piece: statistics.median(pieces[size][piece]) * 1e3 for piece in PIECES}
        rest = t_on - t_off - sum(parts.values())
        print(f"| {size} | {t_off:.2f} | {t_on:.2f} | **{t_off / t_on:.3f}x** | {pairs:.3f}x | {by_cpu:.3f}x | "
              + " | ".join(f"{parts[p]:.3f}" for p in PIECES)
              + f" | {rest:+.3f} | {statistics.median(copies_a_batch[size]):.0f} |")
    print("greedy tokens the same off and on:", same)
    if args.profile:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
