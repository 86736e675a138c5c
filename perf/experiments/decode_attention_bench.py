"""Our decode attention (xllm_async/model/csrc/decode_attention.cpp) against another version of
itself, in one process: the other (by default the branch point's) is compiled apart from `git show REF:...`
with its operator renamed torch.ops.xllm_old.decode_attention, so both run side by side.

    .venv/bin/python perf/experiments/decode_attention_bench.py                 # SmolLM2's shape, bfloat16
    .venv/bin/python perf/experiments/decode_attention_bench.py --ref 62e89fd --rounds 9 --dtype float32

Shapes: rows x keys (every row the same length), one and two threads, hot (the same call again
and again, its keys in L2) and cold (a layer's slab out of 30 in turn, with 8 MB of other memory
touched between calls, as the step's weights do). Each round times --calls calls of each version
back to back, alternating which goes first; a figure is the median over rounds of per-round
lower quartiles (microseconds a call, Python's dispatch included: ~3 us) and the median of
per-round ratios new / old. Lower quartiles: on a shared 2-vCPU machine a two-thread call waits
milliseconds whenever its other thread loses its core, and those stalls swamp medians. The
machine's memory bandwidth drifts in phases of seconds: the ratio is the figure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time

import _perf_path  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # this checkout's package, not the one the environment installed (a worktree's)
import torch  # noqa: E402

import xllm_async  # noqa: F401,E402  (OpenMP settings before torch loads)
from xllm_async.model import cpu_kernels  # noqa: E402

SOURCE = "xllm_async/model/csrc/decode_attention.cpp"


def old_kernel(ref: str) -> None:
    """Compile REF's decode_attention.cpp alone, its operator renamed xllm_old, and load it."""
    text = subprocess.run(["git", "show", f"{ref}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout
    text = text.replace("TORCH_LIBRARY_FRAGMENT(xllm,", "TORCH_LIBRARY_FRAGMENT(xllm_old,")
    text = text.replace("TORCH_LIBRARY_IMPL(xllm,", "TORCH_LIBRARY_IMPL(xllm_old,")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    source, library = f"/tmp/decode_attention_old_{digest}.cpp", f"/tmp/decode_attention_old_{digest}.so"
    if not os.path.exists(library):
        with open(source, "w") as f:
            f.write(text)
        command = cpu_kernels._compile_command(library)
        first = next(i for i, a in enumerate(command) if a.endswith(".cpp"))
        command = [a for a in command if not a.endswith(".cpp")]
        command[first:first] = [source, "-I", cpu_kernels.CSRC]
        subprocess.run(command, check=True)
    torch.ops.load_library(library)


def inputs(rows: int, keys: int, dtype: torch.dtype, layers: int):
    heads, kv_heads, dim = 9, 3, 64
    q = torch.randn(rows, heads, dim).to(dtype)
    slabs = [torch.randn(2, rows, kv_heads, keys, dim).to(dtype) for _ in range(layers)]
    return q, slabs, torch.full((rows,), keys, dtype=torch.long), dim ** -0.5


def time_calls(op, q, slabs, lengths, scale, calls: int, junk: torch.Tensor | None) -> float:
    times = []
    for i in range(calls):
        slab = slabs[i % len(slabs)]
        if junk is not None:
            junk.add_(1.0)
        start = time.perf_counter()
        op(q, slab[0], slab[1], lengths, scale)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default=None, help="the git revision whose kernel is 'old' (default: where this "
                        "branch left main: a later main's kernel may need headers this tree lacks)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,2,8")
    parser.add_argument("--keys", default="128,256,512,1024")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--modes", default="hot,cold")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    assert cpu_kernels.available() and cpu_kernels.decode_attention() is not None
    if args.ref is None:
        args.ref = subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=True, capture_output=True,
                                  text=True).stdout.strip()[:12]
    assert cpu_kernels.__file__.startswith(ROOT), cpu_kernels.__file__
    old_kernel(args.ref)
    new, old = torch.ops.xllm.decode_attention, torch.ops.xllm_old.decode_attention
    dtype = getattr(torch, args.dtype)
    junk = torch.zeros(2 * 1024 * 1024)  # 8 MB, past both cores' L2
    print(f"decode attention, {args.dtype}, 9 query heads / 3 key heads of 64; new: this tree, old: {args.ref}")
    print("threads mode  rows keys   old us   new us  new/old (median of per-round ratios, min..max)")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for mode in args.modes.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                for keys in (int(k) for k in args.keys.split(",")):
                    q, slabs, lengths, scale = inputs(rows, keys, dtype, 30 if mode == "cold" else 1)
                    mess = junk if mode == "cold" else None
                    for slab in slabs:  # same answers, bit for bit or within a summation order
                        a, b = new(q, slab[0], slab[1], lengths, scale), old(q, slab[0], slab[1], lengths, scale)
                        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=1e-2)
                    olds, news, ratios = [], [], []
                    for round_ in range(args.rounds):
                        pair = [(old, olds), (new, news)]
                        measured = {}
                        for op, into in pair if round_ % 2 == 0 else pair[::-1]:
                            measured[id(into)] = time_calls(op, q, slabs, lengths, scale, args.calls, mess)
                            into.append(measured[id(into)])
                        ratios.append(measured[id(news)] / measured[id(olds)])
                    print(f"{threads:7d} {mode:5s} {rows:4d} {keys:5d} {statistics.median(olds):8.1f} "
                          f"{statistics.median(news):8.1f}  {statistics.median(ratios):.3f} "
                          f"({min(ratios):.3f}..{max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
