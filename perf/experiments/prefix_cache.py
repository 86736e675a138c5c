"""What the prefix cache (xllm_async/model/prefix_cache.py) saves and costs on our engine, offline,
one prompt a prefill on this process's threads:

- cold: a history of --history tokens plus --new tokens, prefilled with no prefix cache;
- warm: the same, with the history's blocks in the store (a user's next request);
- miss: a prompt the store has never seen, with the store on: the cold prefill plus keeping its
  blocks (what the cache costs when nothing repeats);
- and apart, the copies a warm prefill makes: the cached blocks into the prompt's slab (load),
  and a whole prompt's blocks into the store (keep).

    .venv/bin/python perf/experiments/prefix_cache.py                        # medium model, 2,000 + 20
    .venv/bin/python perf/experiments/prefix_cache.py --size small --history 1000 --new 64 --dtype float32

Each figure is the median of --reps prefills, in milliseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import servers
import torch

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model.prefix_cache import PrefixStore
from xllm_async.runtime.model_runner import ModelRunner


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium", help="random Qwen3 size (xllm_async.testing.random_model SIZES)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--new", type=int, default=20)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = ModelRunner(servers.ensure_random_model(args.size), torch.device("cpu"), args.dtype)
    runner.set_kv_cache(4 << 30, 1, 0.5)
    store = runner.prefix_store
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(200, 150000) for _ in range(n)]

    history = tokens(args.history)
    length = args.history + args.new

    def prefill(prompt: list[int], with_store: PrefixStore | None) -> None:
        runner.prefix_store = with_store
        runner.prefill([prompt], capacity=len(prompt) + 1)

    with torch.inference_mode():
        prefill(history, store)  # the history's blocks into the store (and everything warm)
        cold = median_ms(lambda: prefill(history + tokens(args.new), None), args.reps)
        warm = median_ms(lambda: prefill(history + tokens(args.new), store), args.reps)
        # (stores of two prompts' blocks: from the third prompt on, they reuse pages already touched)
        small = [PrefixStore(store.layout, 2 * (length // 32), store.device) for _ in range(2)]
        miss = median_ms(lambda: prefill(tokens(length), small[0]), args.reps)
        cold_again = median_ms(lambda: prefill(tokens(length), None), args.reps)
        slabs = runner._arena().view(1, length + 1)
        prompt = history + tokens(args.new)

        def load() -> None:
            store.release_all(store.claim([prompt], slabs, 0))

        def keep() -> None:
            other = tokens(length)
            small[1].keep(other, small[1].match(other, look=False), slabs, 0)

        loaded, kept = median_ms(load, args.reps), median_ms(keep, args.reps)
    cached = store.match(prompt).tokens
    print(f"{args.size}, {runner.dtype}, {torch.get_num_threads()} threads: a {args.history}-token history "
          f"+ {args.new} new tokens ({cached} cached)")
    print(f"  cold prefill     {cold:9.2f} ms")
    print(f"  warm prefill     {warm:9.2f} ms   ({cold / warm:.1f}x sooner)")
    print(f"    load {cached} tokens   {loaded:9.2f} ms")
    print(f"  miss, store on   {miss:9.2f} ms   (off: {cold_again:.2f} ms)")
    print(f"    keep {length // 32 * 32} tokens   {kept:9.2f} ms")


if __name__ == "__main__":
    main()
