"""torch's fused CPU attention by prompt length: what memory it keeps and how long it takes, with
lengths as they come against lengths rounded up to a multiple (model/attention_backends.py pads them).

    .venv/bin/python perf/experiments/attention_kernels.py                       # bfloat16, one thread
    .venv/bin/python perf/experiments/attention_kernels.py --dtype float32

1. Memory: rounds of causal attentions of random lengths (uniform in 30..--most-tokens), resident
   memory after each round (freed heap handed back first). In bfloat16 the kernel compiles a
   micro-kernel for each block shape it meets and keeps it per thread.
2. Time: the same 64 prompts of 30-608 tokens, one call each, as they are and rounded up to each
   multiple; and 64 prompts of exactly 320 tokens, for the quadratic part (E[L^2]).
Shapes: the 4-layer test model's attention (8 query heads, 4 key/value heads, 32 wide).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time

import torch
import torch.nn.functional as F

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)

HEADS, KV_HEADS, DIM = 8, 4, 32


def resident_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def inputs(length: int, multiple: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    padded = -(-length // multiple) * multiple
    return torch.randn(1, HEADS, padded, DIM, dtype=dtype), torch.randn(1, KV_HEADS, padded, DIM, dtype=dtype)


def attend(q: torch.Tensor, k: torch.Tensor) -> None:
    F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)


def best_ms(fn, runs: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=300)
    parser.add_argument("--most-tokens", type=int, default=2000)
    parser.add_argument("--multiples", default="16,1", help="memory part: lengths rounded up to each")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    print(f"{args.dtype}, {args.threads} thread(s), {HEADS} heads ({KV_HEADS} key/value) of {DIM}")
    with torch.inference_mode():
        for multiple in (int(m) for m in args.multiples.split(",")):
            rng = random.Random(0)
            start, readings = resident_mb(), []
            for _ in range(args.rounds):
                for _ in range(args.per_round):
                    attend(*inputs(rng.randint(30, args.most_tokens), multiple, dtype))
                readings.append(f"{resident_mb():.0f}")
            print(f"memory, lengths rounded up to {multiple}: from {start:.0f} MB to {', '.join(readings)} MB")
        rng = random.Random(3)
        lengths = [rng.randint(30, 608) for _ in range(64)]
        for multiple in (1, 8, 16, 32, 64):
            batch = [inputs(n, multiple, dtype) for n in lengths]
            ms = best_ms(lambda batch=batch: [attend(q, k) for q, k in batch])
            print(f"time, 64 prompts of 30-608 tokens rounded up to {multiple}: {ms:.1f} ms")
        batch = [inputs(320, 1, dtype) for _ in lengths]
        ms = best_ms(lambda: [attend(q, k) for q, k in batch])
        print(f"time, 64 prompts of 320 tokens: {ms:.1f} ms "
              f"(the varied ones' E[L^2] is {sum(n * n for n in lengths) / len(lengths) / 320 ** 2:.2f}x)")


if __name__ == "__main__":
    main()
