"""How our packed prefill attention shares a call between threads (csrc/attention_rows.h,
query_pieces): each case's time on one thread and on two, SmolLM2's heads (9 query heads over 3 key
heads of 64), bfloat16. Before the pieces, a call's work items were whole (sequence, key head)s, so
one prompt over 3 key heads on 2 threads could not go faster than 1.5x one thread; now its queries
are split into pieces of equal work and two threads should come near 2x wherever one alone did.

    .venv/bin/python perf/experiments/attention_pieces.py
"""

from __future__ import annotations

import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
from cli import cpu_model

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model import cpu_kernels

HEADS, KV_HEADS, DIM = 9, 3, 64


def flops(q_lengths: list[int], before: list[int]) -> float:
    """Useful multiply-adds x 2 of the scores and the values' sums."""
    return sum(n * (b + (n + 1) / 2) for n, b in zip(q_lengths, before)) * HEADS * DIM * 4


def cases() -> dict[str, tuple]:
    def bf16(*shape):
        return torch.randn(*shape).bfloat16()
    made = {}
    for lengths in ([1088], [320], [320, 320], [64] * 4):
        tokens = sum(lengths)
        q, k, v = bf16(tokens, HEADS, DIM), bf16(tokens, KV_HEADS, DIM), bf16(tokens, KV_HEADS, DIM)
        made[f"{'+'.join(map(str, lengths))}"] = (
            lambda q=q, k=k, v=v, lengths=lengths: torch.ops.xllm.varlen_attention(q, k, v, lengths, 0.125, False),
            flops(lengths, [0] * len(lengths)))
    for rows in (1, 3, 4):  # generated-shared-prefix's questions: 64 tokens behind 1,024 cached
        keys, values = bf16(rows, KV_HEADS, 1100, DIM), bf16(rows, KV_HEADS, 1100, DIM)
        q = bf16(rows * 64, HEADS, DIM)
        made[f"{rows} x 64 after 1,024 cached"] = (
            lambda q=q, keys=keys, values=values, rows=rows: torch.ops.xllm.varlen_attention_cached(
                q, keys, values, [64] * rows, [1088] * rows, 0.125, False),
            flops([64] * rows, [1024] * rows))
    return made


def timed(fn, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    seconds = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - began)
    return min(seconds)  # (the least disturbed: 2 vCPUs of a shared host)


def main() -> None:
    if not cpu_kernels.available() or cpu_kernels.cached_attention() is None:
        raise SystemExit("our packed attention kernels did not load here (they need AVX512-BF16)")
    made = cases()
    results: dict[str, dict[int, list[float]]] = {name: {1: [], 2: []} for name in made}
    for round_ in range(4):  # threads alternating, so that the machine's phases fall on both
        for threads in ((1, 2) if round_ % 2 == 0 else (2, 1)):
            torch.set_num_threads(threads)
            for name, (fn, _) in made.items():
                results[name][threads].append(timed(fn))
    print(f"CPU: {cpu_model()}; SmolLM2's attention ({HEADS} heads over {KV_HEADS}, {DIM} wide), bfloat16, "
          "the fastest of 15 calls, median of 4 rounds")
    print("| case | 1 thread | 2 threads | 2 threads' speed-up | GFLOP/s on 2 |")
    print("|---|---|---|---|---|")
    for name, (_, work) in made.items():
        one, two = (statistics.median(results[name][t]) for t in (1, 2))
        print(f"| {name} | {one * 1e3:.2f} ms | {two * 1e3:.2f} ms | {one / two:.2f}x | {work / two / 1e9:.0f} |")


if __name__ == "__main__":
    main()
