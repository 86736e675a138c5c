"""Our linear (xllm_async/model/csrc/linear.cpp: bfloat16 on AMX or AVX512-BF16, float32 on AVX512
FMAs) against oneDNN's linear on its packed weight (torch.ops.mkldnn._linear_pointwise) and aten's
(F.linear on the plain weight: MKL's in float32), on the shapes a server meets:
SmolLM2's layers and LM head, the 4-layer test model's layers, for a decode step's rows up to a
prompt's.

    .venv/bin/python perf/experiments/cpu_linear.py                                   # every shape, 1 and 2 threads
    .venv/bin/python perf/experiments/cpu_linear.py --shapes 576x49152 --rows 128,512 --threads 2
    .venv/bin/python perf/experiments/cpu_linear.py --dtype float32 --threads 2

Weights are cold (each call reads another copy, COLD_BYTES of them in all, past a 32 MB L3) or
warm (one copy, in the caches). Calls alternate ours / oneDNN / aten, so that on a shared machine all
meet the same neighbours, and each figure is the 25th percentile of a side's calls, in
microseconds (what it costs when it has the cores); oneDNN's first call at a row count, which
compiles its kernel, is not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
import torch.nn.functional as F
from cli import cpu_model, positive_ints

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model import cpu_kernels
from xllm_async.model.cpu_linear import _PACK_HINT

SHAPES = "576x960,576x576,576x3072,1536x576,576x49152,256x1536,256x768,768x256"  # in x out
COLD_BYTES = 100 << 20


def quartile_us(times: list[int]) -> float:
    return statistics.quantiles(times, n=4)[0] / 1e3


def alternating(x: torch.Tensor, sides: dict[str, list[torch.Tensor]], n: int, budget_s: float,
                least: int = 9) -> dict[str, float]:
    """x through copy i % len(copies) of each side's weight, i = 1, 2, ...: us for each side (ours:
    our linear on its packed weight; onednn: oneDNN's on its; aten: F.linear on the plain one)."""
    calls = {
        "ours": lambda w: torch.ops.xllm.linear(x, w, None, n),
        "onednn": lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "aten": lambda w: F.linear(x, w),
    }
    for name, copies in sides.items():
        calls[name](copies[0])
    times: dict[str, list[int]] = {name: [] for name in sides}
    start, i = time.perf_counter(), 1
    while len(times["ours"]) < least or time.perf_counter() - start < budget_s:
        for name, copies in sides.items():
            began = time.perf_counter_ns()
            calls[name](copies[i % len(copies)])
            times[name].append(time.perf_counter_ns() - began)
        i += 1
    return {name: quartile_us(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="in x out, comma-separated")
    parser.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds of calls per figure")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    isa = cpu_kernels.our_linear() if dtype == torch.bfloat16 else (
        "AVX512 FMA" if cpu_kernels.our_float32_linear() else None)
    if isa is None:
        raise SystemExit(f"our {args.dtype} linear is not available here (it needs AVX512-BF16)")
    print(f"{cpu_model()}: our {args.dtype} linear on {isa}; us, 25th percentile of alternating calls")
    print("| in x out | rows | threads | weights | ours | oneDNN | aten | oneDNN / ours | aten / ours |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            cold_copies = max(2, -(-COLD_BYTES // (dtype.itemsize * k * n)))
            weights = [torch.randn(n, k).to(dtype) for _ in range(min(cold_copies, 4))]
            copies = {
                "ours": [torch.ops.xllm.pack_linear(weights[i % len(weights)]) for i in range(cold_copies)],
                "onednn": [torch.ops.mkldnn._reorder_linear_weight(weights[i % len(weights)], _PACK_HINT)
                           for i in range(cold_copies)],
                "aten": [weights[i % len(weights)].clone() for i in range(cold_copies)],
            }
            for rows in args.rows:
                x = torch.randn(rows, k).to(dtype)
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    for weights_at, count in (("cold", cold_copies), ("warm", 1)):
                        us = alternating(x, {name: c[:count] for name, c in copies.items()}, n, args.budget)
                        a, b, c = us["ours"], us["onednn"], us["aten"]
                        print(f"| {k} x {n} | {rows} | {threads} | {weights_at} | {a:.1f} | {b:.1f} | {c:.1f} | "
                              f"{b / a:.2f} | {c / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
