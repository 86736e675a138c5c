"""The elementwise steps of a layer fused into one kernel each, in Triton, for CUDA: the same four
operations as our CPU kernels (cpu_kernels.py), with the same signatures and the same rounding as
transformers' eager code, so that the model code calls either through `module.fused`.

Why: a prefill's elementwise steps in eager torch read and write every value many times (an
RMSNorm in bfloat16: a copy to float32, the norm, a copy back, the weight: ~12 bytes moved per
value where 4 would do), and each of ~38 kernels a layer costs the GPU a few microseconds even
inside a graph (measured on the H200: perf/RESULTS.md, "GPU (H200)").

- rms_norm(x, weight, eps): weight * (x / rms(x)), the norm in float32, rounded to x's dtype
  before the weight's product (as transformers' LlamaRMSNorm / Qwen3RMSNorm);
- add_rms_norm(attn, x, weight, eps) -> (x + attn, rms_norm(x + attn)): the residual add rounded
  first, as the eager add is;
- rope(x, cos, sin, norm_weight, eps): x [tokens, heads, dim] (any strides, the last dimension
  contiguous), optionally RMS-normed per head first (Qwen3's q/k norm), rotated by halves with the
  float32 tables [tokens, dim] rounded to x's dtype, each product and the sum rounded as the
  eager `x * cos + rotate_half(x) * sin` rounds them;
- silu_mul(gate_up) -> silu(gate) * up over the two halves of the fused projection.

Triton is imported lazily: the module imports on machines without it, and `check()` says
whether the kernels compiled and computed right here (once, against the eager code).
Tests run the kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("xllm_async.gpu_kernels")

_lock = threading.Lock()
_kernels = None  # the compiled namespace (_build), once built
_checked: dict[tuple, bool] = {}  # (device, dtype) -> the kernels computed right there


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _build():
    """Define the Triton kernels (on first use: importing triton costs ~1 s)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, sum_ptr, add_ptr, n, x_stride, add_stride, out_stride, eps,
                        ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
        if ADD:  # the residual add, rounded to the dtype first, kept as the new residual
            x = (x.to(tl.float32) + tl.load(add_ptr + row * add_stride + cols, mask=inside,
                                            other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * out_stride + cols, x, mask=inside)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (normed * w).to(x.dtype), mask=inside)

    @triton.jit
    def rope_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, out_ptr, heads, x_token_stride, x_head_stride,
                    table_stride, eps, HALF: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK: tl.constexpr):
        # One token a program, all its heads at once: a program a (token, head) moved 128 values
        # and ran far below the memory's bandwidth (perf/RESULTS.md, "GPU (H200)").
        token = tl.program_id(0)
        head = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        inside = (head < heads) & (cols < HALF)
        base = x_ptr + token * x_token_stride + head * x_head_stride + cols
        a = tl.load(base, mask=inside, other=0.0)
        b = tl.load(base + HALF, mask=inside, other=0.0)
        dtype = a.dtype
        if NORM:  # each head's RMS norm first (Qwen3's q_norm / k_norm), rounded as rms_norm rounds
            af, bf = a.to(tl.float32), b.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(af * af, axis=1) + tl.sum(bf * bf, axis=1)) / (2 * HALF) + eps)
            wa = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
            wb = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
            a = ((af * rstd[:, None]).to(dtype).to(tl.float32) * wa).to(dtype)
            b = ((bf * rstd[:, None]).to(dtype).to(tl.float32) * wb).to(dtype)
        table = token * table_stride + cols
        cos_a = tl.load(cos_ptr + table, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
        cos_b = tl.load(cos_ptr + table + HALF, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
        sin_a = tl.load(sin_ptr + table, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
        sin_b = tl.load(sin_ptr + table + HALF, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
        af, bf = a.to(tl.float32), b.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-b, a): each product rounded, then the sum
        out_a = (af * cos_a).to(dtype).to(tl.float32) + (-bf * sin_a).to(dtype).to(tl.float32)
        out_b = (bf * cos_b).to(dtype).to(tl.float32) + (af * sin_b).to(dtype).to(tl.float32)
        out = out_ptr + (token * heads + head) * (2 * HALF) + cols
        tl.store(out, out_a.to(dtype), mask=inside)
        tl.store(out + HALF, out_b.to(dtype), mask=inside)

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, n, x_stride, out_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n
        gate = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
        up = tl.load(x_ptr + row * x_stride + n + cols, mask=inside, other=0.0)
        gf = gate.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=inside)

    return rms_norm_kernel, rope_kernel, silu_mul_kernel


def _compiled():
    global _kernels
    with _lock:
        if _kernels is None:
            _kernels = _build()
        return _kernels


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with a uniform row stride (a copy only where the layout forbids it)."""
    flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernel = _compiled()[0]
    flat = _rows(x)
    rows, n = flat.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        kernel[(rows,)](flat, weight, out, out, flat, n, flat.stride(0), flat.stride(0), out.stride(0), eps,
                        ADD=False, BLOCK=_next_power_of_2(n))
    return out.view(x.shape)


def add_rms_norm(attn: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _compiled()[0]
    flat, other = _rows(x), _rows(attn)
    rows, n = flat.shape
    total = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if rows:
        kernel[(rows,)](flat, weight, out, total, other, n, flat.stride(0), other.stride(0), out.stride(0), eps,
                        ADD=True, BLOCK=_next_power_of_2(n))
    return total.view(x.shape), out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor | None,
         eps: float) -> torch.Tensor:
    kernel = _compiled()[1]
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        half = dim // 2
        weight = norm_weight if norm_weight is not None else cos  # (unread without NORM)
        kernel[(tokens,)](x, cos, sin, weight, out, heads, x.stride(0), x.stride(1), cos.stride(0), eps,
                          HALF=half, NORM=norm_weight is not None, BLOCK_H=_next_power_of_2(heads),
                          BLOCK=_next_power_of_2(half))
    return out


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernel = _compiled()[2]
    flat = _rows(gate_up)
    rows, n = flat.shape[0], flat.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(SILU_BLOCK, _next_power_of_2(n))
        kernel[(rows, -(-n // block))](flat, out, n, flat.stride(0), out.stride(0), BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


class _Ops:
    """The four operations as the model code calls them (module.fused.rms_norm(...), ...)."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rope = staticmethod(rope)
    silu_mul = staticmethod(silu_mul)


OPS = _Ops()


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What rms_norm computes, in torch's operations (as transformers' eager code rounds)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_rope(x, cos, sin, weight, eps):
    """What rope computes, in torch's operations."""
    if weight is not None:
        x = eager_rms_norm(x, weight, eps)
    half = x.shape[-1] // 2
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s


def check(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels compile and compute what the eager code does, here (once per device and
    dtype; False, with the reason logged, where Triton is missing or a kernel fails or differs)."""
    key = (str(device), dtype)
    if key in _checked:
        return _checked[key]
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 3, 64, generator=gen).to(device, dtype)
        weight = (torch.rand(64, generator=gen) + 0.5).to(device, dtype)
        cos, sin = torch.rand(5, 64, generator=gen).to(device), torch.rand(5, 64, generator=gen).to(device)
        flat, attn = x.view(5, 192), torch.randn(5, 192, generator=gen).to(device, dtype)
        wide = (torch.rand(192, generator=gen) + 0.5).to(device, dtype)
        tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
        torch.testing.assert_close(rms_norm(flat, wide, 1e-6), eager_rms_norm(flat, wide, 1e-6), **tol)
        total, normed = add_rms_norm(attn, flat, wide, 1e-6)
        torch.testing.assert_close(total, flat + attn, **tol)
        torch.testing.assert_close(normed, eager_rms_norm(flat + attn, wide, 1e-6), **tol)
        for w in (None, weight):
            torch.testing.assert_close(rope(x, cos, sin, w, 1e-6), eager_rope(x, cos, sin, w, 1e-6), **tol)
        gate_up = torch.randn(5, 2 * 96, generator=gen).to(device, dtype)
        gate, up = gate_up.float().chunk(2, dim=-1)
        torch.testing.assert_close(silu_mul(gate_up).float(), torch.nn.functional.silu(gate) * up, **tol)
        ok = True
    except Exception as exc:  # noqa: BLE001  (no Triton, no compiler, a wrong answer: the eager code serves)
        log.warning("fused GPU kernels unusable on %s (%s): %s: %s", device, dtype, type(exc).__name__, exc)
        ok = False
    _checked[key] = ok
    return ok


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """On a CUDA device (the caller's to say), in the dtypes the model runs in, where the kernels
    check out (check)."""
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and check(device, dtype)
