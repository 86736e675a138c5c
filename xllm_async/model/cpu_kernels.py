"""Our fused CPU kernels (csrc/*.cpp), bfloat16 and float32, each one pass over memory where the
eager code makes four to eight (a bfloat16 prefill spent half its time in such passes: perf/RESULTS.md,
"Offline, the ceiling and the server's own cost"):
- elementwise: RMSNorm, residual add + RMSNorm (rms_norm.cpp), rotary embedding after Qwen3's
  per-head norm (rope.cpp), SiLU x up (silu_mul.cpp), sharing elementwise.h; cpu_kernels.cpp
  registers them and holds the library's TORCH_LIBRARY(xllm);
- attention: causal attention over a whole batch of packed prompts in one call
  (varlen_attention.cpp), the same after a cached prefix (cached_attention.cpp) and a beam round's
  prompt stage (prefix_attention.cpp), all on the blocks of attention_*.h (AMX tiles where the CPU
  has them, AVX512-BF16 dot products elsewhere); a decode step's attention in one call
  (decode_attention.cpp);
- a beam round's top k with its log-sum-exp (beam_topk.cpp);
- a structured output's token mask applied to its rows' logits (token_bitmask.cpp, any CPU; called by
  execution/grammar.py through torch's operator table);
- the linear layers and the LM head of small-row steps (linear.cpp: AMX, else AVX512-BF16; float32
  on AVX512 FMAs), and the LM head fused with a greedy or top-k pick (head_pick.cpp, head_topk.cpp:
  the same sums, no logits written; bfloat16 where the linear is AVX512-BF16's, float32 wherever it loaded);
- the linear layers over GGUF's quantized blocks (quant_linear.cpp: AVX512-VNNI; a prompt's rows on
  AMX's bfloat16 tiles where the CPU has them, quant_widened.cpp; model/quantized.py checks it
  against its reference arithmetic and calls it).

`make install` builds the library with the machine's own compiler (`python -m
xllm_async.model.cpu_kernels`) for the CPU it runs on; a server that finds none for its CPU
and torch builds it at start-up (about 10 s, once). Where no compiler works, the model runs its
eager code and start-up says so. The operators are torch.ops.xllm.*; the library links only
torch's C++ libraries (no Python headers).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading

import torch

from .cpu_features import bfloat16_units, cpu_identity
from .head_check import working_head_picks

log = logging.getLogger("xllm_async.cpu_kernels")

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
# Every source there goes into the one library (the headers they share go into library_path's
# digest, so that a change to one rebuilds it): the attention, beam top-k, decode attention and
# linear operators exist only on CPUs with AVX512-BF16 (the prefill attention and the linear on AMX
# where the CPU has it; the quantized linear where it has AVX512-VNNI too).
SOURCES = tuple(sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC) if name.endswith(".cpp")))


def _build_dir() -> str:
    """Beside the source (a checkout); where the package cannot be written to, the user's cache."""
    if os.access(CSRC, os.W_OK):
        return os.path.join(CSRC, "build")
    return os.path.join(os.path.expanduser("~"), ".cache", "xllm_async", "kernels")


_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
# Our attention operators once loaded, where this CPU has AVX512-BF16: torch.ops.xllm.varlen_attention
# (packed prompts) and prefix_attention (a beam round's prompt stage).
_varlen = None
_prefix = None
_cached = None  # varlen_attention_cached: prompts after a cached prefix (model/prefix_cache.py)
_topk = None  # torch.ops.xllm.topk_logsumexp, where this CPU has AVX512-BF16
_decode = None  # torch.ops.xllm.decode_attention, likewise
# Where torch.ops.xllm.linear loaded and computed right: the instruction set it runs on here
# ("amx" or "avx512_bf16"), else None.
_linear_isa: str | None = None
_float32_linear = False  # whether torch.ops.xllm.linear takes float32 here (and computed right)
_float32_fused = False  # whether the elementwise kernels take float32 here (their vector paths)
# The dtypes torch.ops.xllm.linear_argmax picks in here (and picked right); (dtype, "top") where
# linear_topk does too.
_head_pick: frozenset = frozenset()
_failure: str | None = None  # why the library did not load, where it did not
# The instruction sets our library is built for (torch.ops.xllm.linear_isa), as start-up names them.
ISA_NAMES = {"amx": "AMX", "avx512_bf16": "AVX512-BF16"}


def instruction_sets() -> list[str]:
    """The instruction sets our kernels are written for that this CPU has, best first: "amx",
    "avx512_bf16" (its bfloat16 units: cpu_features.py). Where it has either, -march=native builds
    every kernel."""
    return bfloat16_units()


def library_path() -> str:
    """The library for this source, this torch and this CPU (built for its instruction set)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(CSRC)):  # the sources and the headers they share
        if name.endswith((".cpp", ".h")):
            with open(os.path.join(CSRC, name), "rb") as f:
                digest.update(f.read())
    digest.update(torch.__version__.encode())
    digest.update(cpu_identity().encode())
    return os.path.join(_build_dir(), f"cpu_kernels-{digest.hexdigest()[:16]}.so")


def _compile_command(output: str) -> list[str]:
    root = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [os.environ.get("CXX", "g++"), "-O3", "-march=native", "-ffast-math", "-fno-finite-math-only",
            "-fopenmp", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
            "-I", os.path.join(root, "include"), "-I", os.path.join(root, "include", "torch", "csrc", "api", "include"),
            *SOURCES, "-L", os.path.join(root, "lib"), "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{os.path.join(root, 'lib')}", "-o", output]


def build() -> str:
    """Compile the library unless it is there; returns its path. Raises on failure."""
    path = library_path()
    if os.path.exists(path):
        return path
    log.info("building the fused CPU kernels for this CPU (once): %s", path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Into a temporary name, then renamed: servers starting side by side never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        result = subprocess.run(_compile_command(partial), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {CSRC}/*.cpp failed:\n{result.stderr[-2000:]}")
        os.replace(partial, path)
        for name in os.listdir(os.path.dirname(path)):  # builds of an older source or torch
            if name.startswith("cpu_kernels-") and name.endswith(".so") and name != os.path.basename(path):
                os.unlink(os.path.join(os.path.dirname(path), name))
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def _working_attention():
    """Our attention operators if this build has them (CPUs with AVX512-BF16) and they run here."""
    varlen = getattr(torch.ops.xllm, "varlen_attention", None)
    prefix = getattr(torch.ops.xllm, "prefix_attention", None)
    cached = getattr(torch.ops.xllm, "varlen_attention_cached", None)
    if varlen is not None and prefix is not None and cached is not None:
        try:  # (the kernels ask Linux for AMX state on their first call; a refusal raises)
            x = torch.zeros(2, 1, 16, dtype=torch.bfloat16)
            varlen(x, x, x, [2], 1.0, False)
            prefix(x, x[None, :, 0], x[None, :, 0], 1.0)
            slab = torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16)  # [prompts, kv_heads, capacity, dim]
            cached(x[:1], slab, slab, [1], [2], 1.0, False)
        except RuntimeError as exc:
            log.warning("attention kernels unusable here: %s", exc)
            varlen = prefix = cached = None
    if varlen is not None:  # (built for the same instruction set as our linear: linear_isa says which)
        log.info("packed attention: our %s kernels, one call a batch", ISA_NAMES[torch.ops.xllm.linear_isa()])
    else:
        log.info("packed attention: torch's kernel, a call per prompt length (no AVX512-BF16 here)")
    return varlen, prefix, cached


def _working_linear() -> str | None:
    """Our linear (csrc/linear.cpp)'s instruction set if this build has it and it computes here
    (on AMX, torch's brgemm needs oneDNN enabled and AMX granted by Linux); else None."""
    if not hasattr(torch.ops.xllm, "linear"):
        return None
    isa = torch.ops.xllm.linear_isa()
    try:
        weight = torch.ones(3, 4, dtype=torch.bfloat16)
        out = torch.ops.xllm.linear(torch.ones(2, 4, dtype=torch.bfloat16), torch.ops.xllm.pack_linear(weight),
                                    None, 3)
    except RuntimeError as exc:
        log.warning("our %s linear unusable here: %s", isa, exc)
        return None
    if not bool((out == 4).all()):
        log.warning("our %s linear computed wrong here: oneDNN's linear serves", isa)
        return None
    return isa


def _working_float32_linear() -> bool:
    """Whether our linear's float32 loop (csrc/linear.cpp, AVX512 FMAs) is in this build and
    computes right here."""
    if not hasattr(torch.ops.xllm, "linear"):
        return False
    try:
        weight = torch.arange(12, dtype=torch.float32).view(3, 4)
        out = torch.ops.xllm.linear(torch.ones(2, 4), torch.ops.xllm.pack_linear(weight), None, 3)
    except RuntimeError as exc:
        log.warning("our float32 linear unusable here: %s", exc)
        return False
    return bool((out == weight.sum(1)).all())


def _working_float32_fused() -> bool:
    """Whether the elementwise kernels' float32 paths are in this build (AVX512-BF16) and compute
    right here: an RMSNorm of ones is its weight."""
    try:
        out = torch.ops.xllm.rms_norm(torch.ones(2, 16), torch.full((16,), 3.0), 1e-6)
    except RuntimeError:  # (a build without the vector paths refuses float32)
        return False
    return bool(torch.allclose(out, torch.full((2, 16), 3.0)))


def available() -> bool:
    """Load the library (building it first if needed) once per process; False where that fails."""
    global _loaded, _failure, _varlen, _prefix, _cached, _topk, _decode, _linear_isa, _float32_linear
    global _float32_fused, _head_pick
    with _lock:
        if _loaded is None:
            try:
                torch.ops.load_library(build())
                _loaded = True
                _varlen, _prefix, _cached = _working_attention()
                _topk = getattr(torch.ops.xllm, "topk_logsumexp", None)
                _decode = getattr(torch.ops.xllm, "decode_attention", None)
                _linear_isa = _working_linear()
                _float32_linear = _working_float32_linear()
                _float32_fused = _working_float32_fused()
                _head_pick = working_head_picks(_linear_isa, _float32_linear)
            except Exception as exc:  # no compiler, no headers: the eager code still runs
                log.warning("fused CPU kernels unavailable, bfloat16 runs eager elementwise code: %s", exc)
                _loaded, _failure = False, f"{type(exc).__name__}: {exc}"
        return _loaded


def verified() -> dict[str, bool]:
    """Each of our kernels by name, and whether it loaded here and passed its start-up check
    (the tests fail, not skip, a False on a CPU with instruction_sets())."""
    loaded = available()
    return {"elementwise": loaded, "float32 elementwise": loaded and _float32_fused,
            "packed attention": loaded and all(k is not None for k in (_varlen, _prefix, _cached)),
            "beam top-k": loaded and _topk is not None, "decode attention": loaded and _decode is not None,
            "linear": loaded and _linear_isa is not None, "float32 linear": loaded and _float32_linear,
            "token bitmask": loaded and hasattr(torch.ops.xllm, "apply_token_bitmask"),
            # (every dtype whose linear is ours and exact to pick from: float32, and bfloat16 without AMX)
            "head pick": loaded and {torch.float32, (torch.float32, "top")} <= _head_pick  # (greedy and top-k)
            and (_linear_isa != "avx512_bf16" or {torch.bfloat16, (torch.bfloat16, "top")} <= _head_pick)}


def load_failure() -> str | None:
    """Why the library did not load (the compiler's complaint), where it did not."""
    return _failure


def our_linear() -> str | None:
    """The instruction set our linear (csrc/linear.cpp) computes on here, "amx" or "avx512_bf16",
    once the library loaded and the linear ran right; else None."""
    return _linear_isa if available() else None


def our_float32_linear() -> bool:
    """Whether our linear takes float32 rows here (csrc/linear.cpp's AVX512 FMA loop)."""
    return _float32_linear if available() else False


def head_pick(dtype: torch.dtype) -> bool:
    """Whether torch.ops.xllm.linear_argmax picks exactly what argmax over our linear's logits would,
    for a model in this dtype here."""
    return dtype in _head_pick if available() else False


def head_topk(dtype: torch.dtype) -> bool:
    """Whether torch.ops.xllm.linear_topk gives exactly the largest of our linear's logits, in torch's
    stable descending order, for a model in this dtype here."""
    return (dtype, "top") in _head_pick if available() else False


def varlen_attention():
    """Our packed causal attention (csrc/varlen_attention.cpp) once the library is loaded, or None."""
    return _varlen if _loaded else None


def cached_attention():
    """Our packed causal attention for prompts after a cached prefix (csrc/cached_attention.cpp:
    their keys read from their cache rows) once loaded, or None."""
    return _cached if _loaded else None


def topk_logsumexp():
    """A logits block's top k and log-sum-exp in two passes (csrc/beam_topk.cpp) once loaded, or None."""
    return _topk if _loaded else None


def decode_attention():
    """A decode step's attention, every row in one call, bfloat16 or float32 (csrc/decode_attention.cpp), or None."""
    return _decode if _loaded else None


def prefix_attention():
    """Our beam-round prompt-stage attention (csrc/prefix_attention.cpp) once loaded, or None."""
    return _prefix if _loaded else None


def candidate_attention():
    """A ranking request's candidate rows' own stage of attention merged with their prompt's
    (csrc/candidate_attention.cpp) once loaded, or None."""
    return getattr(torch.ops.xllm, "candidate_attention", None) if _loaded else None


def wanted(dtype: torch.dtype) -> bool:
    """Whether the elementwise kernels serve a CPU model in this dtype: bfloat16 wherever the
    library loaded; float32 where its vector paths take float32 too (CPUs with AVX512-BF16). The
    tests compare float32 with transformers token for token: a fused norm sums its squares in
    another order, nothing else differs."""
    if not available():
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float32 and _float32_fused)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    try:
        print(build())
    except Exception as exc:  # make install goes on: the server falls back to the eager code
        print(f"fused CPU kernels not built: {exc}", file=sys.stderr)
