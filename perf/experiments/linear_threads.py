"""Our linear's speed-up on two threads over one (csrc/blocked_linear.h shares a linear's tiles
between threads), on SmolLM2's shapes at the rows its prefills meet: the o and down projections
have 9 column blocks and qkv 15, where whole blocks left one thread more than the other; gate/up's
48 are the control. Calls alternate one thread and two, so that the machine's phases fall on both;
each figure is the 25th percentile of 60 calls. Run it here and in a worktree of the commit
before (WORKTREE) to compare builds:

    .venv/bin/python perf/experiments/linear_threads.py
    (cd WORKTREE && PYTHONPATH=. $OLDPWD/.venv/bin/python perf/experiments/linear_threads.py)
"""

from __future__ import annotations

import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
from cli import cpu_model

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model import cpu_kernels

CASES = [(576, 576, 448, "o, 7 questions"), (1536, 576, 256, "down, an MLP chunk"), (576, 960, 448, "qkv, 7 questions"),
         (576, 576, 64, "o, a lone question"), (576, 3072, 256, "gate/up, an MLP chunk (control)")]


def main() -> None:
    if cpu_kernels.our_linear() is None:
        raise SystemExit("our bfloat16 linear did not load here (it needs AMX or AVX512-BF16)")
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}; our bfloat16 linear, 25th percentile of 60 calls a side")
    print("| shape (in x out), rows | 1 thread | 2 threads | speed-up |")
    print("|---|---|---|---|")
    for k, n, m, what in CASES:
        packed = torch.ops.xllm.pack_linear(torch.randn(n, k).bfloat16())
        x = torch.randn(m, k).bfloat16()
        times: dict[int, list[int]] = {1: [], 2: []}
        for rep in range(60):
            for threads in (1, 2) if rep % 2 else (2, 1):
                torch.set_num_threads(threads)
                torch.ops.xllm.linear(x, packed, None, n)  # (the thread count's team started)
                began = time.perf_counter_ns()
                torch.ops.xllm.linear(x, packed, None, n)
                times[threads].append(time.perf_counter_ns() - began)
        one, two = (statistics.quantiles(times[t], n=4)[0] / 1e3 for t in (1, 2))
        print(f"| {what}: {k} x {n}, {m} | {one:.0f} us | {two:.0f} us | {one / two:.2f}x |")


if __name__ == "__main__":
    main()
