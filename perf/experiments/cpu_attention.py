"""Our attention and beam top-k kernels (xllm_async/model/csrc/varlen_attention.cpp,
beam_topk.cpp) against the torch operators they replace, in one process, on the shapes a server
meets: a packed prefill of 16 prompts, a 128-beam round's prompt stage, a block of its logits.

    .venv/bin/python perf/experiments/cpu_attention.py                        # one thread, bfloat16
    .venv/bin/python perf/experiments/cpu_attention.py --threads 2
    .venv/bin/python perf/experiments/cpu_attention.py --threads 2 --dtype float32   # (no top-k row: bfloat16 only)

torch's side: scaled_dot_product_attention (its fused CPU kernel) in one call for equal lengths,
a call per prompt (each padded to a multiple of 16, as attention.py did) for mixed ones; the
prompt stage through attention_backends.SdpaAttention.attend; torch.topk and torch.logsumexp. Each figure is the best
of --repeats medians of --runs calls, in milliseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
import torch.nn.functional as F
from cli import cpu_model

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.model import attention_backends, cpu_kernels


def best_ms(fn, runs: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    medians = []
    for _ in range(repeats):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians) * 1e3


def torch_per_prompt(q, k, v, lengths):
    outs, start = [], 0
    torch_kernels = attention_backends.SdpaAttention(q.dtype)
    for n in lengths:
        span = torch_kernels.span(n)  # (bfloat16: a multiple of 16, as SdpaAttention pads for torch's kernel)
        qs, ks, vs = (F.pad(x[None, start:start + n].transpose(1, 2), (0, 0, 0, span - n)) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # (4-d: the fused kernel)
        outs.append(out[0, :, :n].transpose(0, 1))
        start += n
    return torch.cat(outs)


def prefill_row(heads: int, kv_heads: int, dim: int, name: str, lengths: list[int], args) -> str:
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, dim).to(args.dtype) for h in (heads, kv_heads, kv_heads))
    if len(set(lengths)) == 1:
        qb, kb, vb = (x.view(len(lengths), lengths[0], -1, dim).transpose(1, 2).contiguous() for x in (q, k, v))
        theirs = best_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True),
                         args.runs, args.repeats)
    else:
        theirs = best_ms(lambda: torch_per_prompt(q, k, v, lengths), args.runs, args.repeats)
    ours = best_ms(lambda: torch.ops.xllm.varlen_attention(q, k, v, lengths, dim ** -0.5, False),
                   args.runs, args.repeats)
    return f"| prefill {name} tokens, {heads} heads ({kv_heads} key heads) of {dim} | {theirs:.2f} | {ours:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available() or cpu_kernels.varlen_attention() is None:
        raise SystemExit("our attention kernels are not available here (they need AVX512-BF16)")
    rng = random.Random(0)
    print(f"{cpu_model()}, {args.threads} thread(s), {str(args.dtype).removeprefix('torch.')}, ms\n")
    print("| case | torch | ours |\n|---|---|---|")
    for heads, kv_heads, dim in ((8, 4, 32), (16, 8, 128)):
        for name, lengths in (("16 x 320", [320] * 16), ("16 of 30-608", [rng.randint(30, 608) for _ in range(16)])):
            print(prefill_row(heads, kv_heads, dim, name, lengths, args))
    beams, heads, kv_heads, dim, length = 128, 8, 4, 64, 1000
    q = torch.randn(beams, heads, dim).to(args.dtype)
    k, v = (torch.randn(kv_heads, length, dim).to(args.dtype) for _ in range(2))
    qg = q.view(beams, kv_heads, heads // kv_heads, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim)
    torch_kernels = attention_backends.SdpaAttention(args.dtype)
    theirs = best_ms(lambda: torch_kernels.attend(qg, k[None], v[None], dim ** -0.5), args.runs, args.repeats)
    ours = best_ms(lambda: torch.ops.xllm.prefix_attention(q, k, v, dim ** -0.5), args.runs, args.repeats)
    print(f"| beam round's prompt stage: {beams} beams x {heads} heads of {dim}, {length} keys "
          f"| {theirs:.2f} | {ours:.2f} |")
    logits = (torch.randn(128, 16384) * 3).to(torch.bfloat16)
    topk = cpu_kernels.topk_logsumexp()
    if topk is not None and args.dtype == torch.bfloat16:
        theirs = best_ms(lambda: (logits.topk(128, dim=-1), torch.logsumexp(logits.float(), dim=-1)),
                         args.runs, args.repeats)
        ours = best_ms(lambda: topk(logits, 128), args.runs, args.repeats)
        print(f"| top 128 and log-sum-exp of 128 x 16,384 logits | {theirs:.2f} | {ours:.2f} |")


if __name__ == "__main__":
    main()
