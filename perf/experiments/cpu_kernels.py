"""Our fused bfloat16 CPU kernels (xllm_async/model/cpu_kernels.py) against the eager code they
replace, one operator at a time, at the row counts a server meets (decode steps to packed prefills).

    .venv/bin/python perf/experiments/cpu_kernels.py                  # one thread, the 4-layer test model's widths
    .venv/bin/python perf/experiments/cpu_kernels.py --threads 2 --hidden 576 --heads 9 --head-dim 64 \\
        --intermediate 1536                               # SmolLM2's widths

Each figure is the mean of --runs calls after a warm-up, in microseconds.
"""

from __future__ import annotations

import argparse
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
import torch.nn.functional as F
from cli import positive_ints

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model import cpu_kernels
from xllm_async.model.layers import apply_rotary

EPS = 1e-6


def mean_us(fn, runs: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs * 1e6


def eager_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), weight.shape, None, EPS).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_ints, default=[1, 8, 320, 5120])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the fused CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    print(f"bfloat16, {args.threads} thread(s), hidden {args.hidden}, {args.heads} heads of {args.head_dim}, "
          f"intermediate {args.intermediate}; microseconds a call, eager -> fused")
    print("| rows | RMSNorm | add + RMSNorm | q norm + rotary | rotary | SiLU x up |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in args.rows:
            print(f"| {rows} | " + " | ".join(row_cells(rows, args, gen)) + " |")


def row_cells(rows: int, args: argparse.Namespace, gen: torch.Generator) -> list[str]:
    """'eager -> fused' microseconds of each operator at this many rows."""
    ops = torch.ops.xllm

    def randn(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    x, residual, weight = randn(rows, args.hidden), randn(rows, args.hidden), randn(args.hidden)
    q = randn(rows, 2 * args.heads * args.head_dim)[:, :args.heads * args.head_dim].view(
        rows, args.heads, args.head_dim)  # a view of a wider projection, as in the model
    cos, sin = torch.rand(rows, args.head_dim, generator=gen), torch.rand(rows, args.head_dim, generator=gen)
    cos_b, sin_b = cos.bfloat16()[:, None], sin.bfloat16()[:, None]
    head_weight = randn(args.head_dim)
    gate_up = randn(rows, 2 * args.intermediate)

    def silu_eager():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    pairs = [
        (lambda: eager_norm(x, weight), lambda: ops.rms_norm(x, weight, EPS)),
        (lambda: eager_norm(residual + x, weight), lambda: ops.add_rms_norm(x, residual, weight, EPS)),
        (lambda: apply_rotary(eager_norm(q, head_weight), cos_b, sin_b),
         lambda: ops.rope(q, cos, sin, head_weight, EPS)),
        (lambda: apply_rotary(q, cos_b, sin_b), lambda: ops.rope(q, cos, sin, None, 0.0)),
        (silu_eager, lambda: ops.silu_mul(gate_up)),
    ]
    return [f"{mean_us(eager, args.runs):.0f} -> {mean_us(fused, args.runs):.0f}" for eager, fused in pairs]


if __name__ == "__main__":
    main()
