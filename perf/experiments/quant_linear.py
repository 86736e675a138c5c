"""Our quantized linear (xllm_async/model/csrc/quant_linear.cpp, what QuantWeight.linear calls) in
Q8_0, Q4_0 and Q4_1 against our bfloat16 linear (csrc/linear.cpp over cpu_linear.PackedWeight's
layout), on SmolLM2-135M's shapes, for a decode step's rows up to a prompt's.

    .venv/bin/python perf/experiments/quant_linear.py                                  # every shape, 1 and 2 threads
    .venv/bin/python perf/experiments/quant_linear.py --shapes 576x49152 --rows 1,512 --threads 1

Weights are cold: each call reads another copy, COLD_BYTES of them a side, past the L3 (a decode
step reads each weight once, from memory). Calls alternate bfloat16 / q8_0 / q4_0 / q4_1, so that
on a shared machine all meet the same neighbours; each figure is the median of a side's calls, in
microseconds, and "x" columns are bfloat16's time over the format's (above 1: faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
from cli import cpu_model, positive_ints

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model import quantized
from xllm_async.model.quantized import FORMATS, QuantWeight

# SmolLM2-135M's linears, in x out: a fused q/k/v-sized one, o_proj, gate/up fused, down, the LM head
SHAPES = "576x1728,576x576,576x3072,1536x576,576x49152"
COLD_BYTES = 96 << 20


def copies(weight: torch.Tensor, count: int) -> list[torch.Tensor]:
    return [weight] + [weight.clone() for _ in range(count - 1)]


def alternating(x: torch.Tensor, sides: dict[str, list[torch.Tensor]], n: int, budget_s: float,
                least: int = 15) -> dict[str, float]:
    """x through copy i % len(copies) of each side's weight, i = 1, 2, ...: median us for each side."""
    def call(name: str, weight: torch.Tensor) -> torch.Tensor:
        if name == "bf16":
            return torch.ops.xllm.linear(x, weight, None, n)
        return torch.ops.xllm.quant_linear(x, weight, name, None, n)

    for name, weights in sides.items():
        call(name, weights[0])
    times: dict[str, list[int]] = {name: [] for name in sides}
    start, i = time.perf_counter(), 1
    while len(times["bf16"]) < least or time.perf_counter() - start < budget_s:
        for name, weights in sides.items():
            began = time.perf_counter_ns()
            call(name, weights[i % len(weights)])
            times[name].append(time.perf_counter_ns() - began)
        i += 1
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="in x out, comma-separated")
    parser.add_argument("--rows", type=positive_ints, default=[1, 4, 8, 64, 512])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of calls per figure")
    args = parser.parse_args()
    if not quantized.kernel_verified():
        raise SystemExit("our quantized linear is not available here (it needs AVX512-BF16 and VNNI)")
    print(f"{cpu_model()}: bfloat16 rows in and out; us, median of alternating calls, cold weights")
    print("| in x out | rows | threads | bf16 | q8_0 | q4_0 | q4_1 | x q8_0 | x q4_0 | x q4_1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            weight = torch.randn(n, k) * 0.05
            plain = torch.ops.xllm.pack_linear(weight.bfloat16())
            sides = {"bf16": copies(plain, -(-COLD_BYTES // plain.nbytes))}
            for kind in FORMATS:
                packed = QuantWeight.quantize(weight, kind).packed
                sides[kind] = copies(packed, -(-COLD_BYTES // packed.nbytes))
            for rows in args.rows:
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    us = alternating(x, sides, n, args.budget)
                    ratios = " | ".join(f"{us['bf16'] / us[kind]:.2f}" for kind in FORMATS)
                    print(f"| {k} x {n} | {rows} | {threads} | "
                          + " | ".join(f"{us[name]:.1f}" for name in sides) + f" | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
