"""Our bfloat16 linear (xllm_async/model/csrc/linear.cpp, on AMX or AVX512-BF16) against oneDNN's
linear on its packed weight (torch.ops.mkldnn._linear_pointwise), on the shapes a server meets:
SmolLM2's layers and LM head, the 4-layer test model's layers, for a decode step's rows up to a
prompt's.

    .venv/bin/python perf/cpu_linear.py                                   # every shape, 1 and 2 threads
    .venv/bin/python perf/cpu_linear.py --shapes 576x49152 --rows 128,512 --threads 2

Weights are cold (each call reads another copy, COLD_BYTES of them in all, past a 32 MB L3) or
warm (one copy, in the caches). Calls alternate ours / oneDNN, so that on a shared machine both
meet the same neighbours, and each figure is the 25th percentile of a side's calls, in
microseconds (what it costs when it has the cores); oneDNN's first call at a row count, which
compiles its kernel, is not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cli import cpu_model, positive_ints

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model import cpu_kernels
from xllm_async.model.layers import _PACK_HINT

SHAPES = "576x960,576x576,576x3072,1536x576,576x49152,256x1536,256x768,768x256"  # in x out
COLD_BYTES = 100 << 20


def quartile_us(times: list[int]) -> float:
    return statistics.quantiles(times, n=4)[0] / 1e3


def alternating(x: torch.Tensor, ours: list[torch.Tensor], onednn: list[torch.Tensor], n: int, budget_s: float,
                least: int = 9) -> tuple[float, float]:
    """x through copy i % len(ours) of each side's weight, i = 1, 2, ...: (ours, oneDNN's) us."""
    def call_ours(i: int) -> None:
        torch.ops.xllm.linear(x, ours[i % len(ours)], None, n)

    def call_onednn(i: int) -> None:
        torch.ops.mkldnn._linear_pointwise(x, onednn[i % len(onednn)], None, "none", [], "")

    call_ours(0), call_onednn(0)
    ours_times, onednn_times = [], []
    start, i = time.perf_counter(), 1
    while len(ours_times) < least or time.perf_counter() - start < budget_s:
        for fn, times in ((call_ours, ours_times), (call_onednn, onednn_times)):
            began = time.perf_counter_ns()
            fn(i)
            times.append(time.perf_counter_ns() - began)
        i += 1
    return quartile_us(ours_times), quartile_us(onednn_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="in x out, comma-separated")
    parser.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--budget", type=float, default=0.4, help="seconds of calls per figure")
    args = parser.parse_args()
    isa = cpu_kernels.our_linear()
    if isa is None:
        raise SystemExit("our linear is not available here (it needs AVX512-BF16)")
    print(f"{cpu_model()}: our linear on {isa}; us, 25th percentile of alternating calls")
    print("| in x out | rows | threads | weights | ours | oneDNN | oneDNN / ours |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            cold_copies = max(2, -(-COLD_BYTES // (2 * k * n)))
            weights = [torch.randn(n, k).bfloat16() for _ in range(min(cold_copies, 4))]
            ours = [torch.ops.xllm.pack_linear(weights[i % len(weights)]) for i in range(cold_copies)]
            onednn = [torch.ops.mkldnn._reorder_linear_weight(weights[i % len(weights)], _PACK_HINT)
                      for i in range(cold_copies)]
            for rows in args.rows:
                x = torch.randn(rows, k).bfloat16()
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    for weights_at, copies in (("cold", cold_copies), ("warm", 1)):
                        a, b = alternating(x, ours[:copies], onednn[:copies], n, args.budget)
                        print(f"| {k} x {n} | {rows} | {threads} | {weights_at} | {a:.1f} | {b:.1f} | {b / a:.2f} |",
                              flush=True)


if __name__ == "__main__":
    main()
