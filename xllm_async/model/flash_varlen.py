"""torch's variable-length flash attention (torch.nn.attention.varlen), as the CUDA backend
(attention_backends.CudaFlashAttention) calls it, and how to tell a kernel that cannot run here
from a call that failed."""

from __future__ import annotations

import inspect
import logging
import re

import torch


class FlashVarlen:
    """torch's variable-length flash attention (torch.nn.attention.varlen). Its arguments moved
    between torch releases (is_causal became window_size, enable_gqa came later): read off its
    signature. Off for good, with one warning, where a call says it cannot run here
    (unsupported()). Any other failure (out of memory, a device fault) fails that forward's
    batch only, as any forward's error does, and the next batch tries it again."""

    def __init__(self) -> None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            self.fn = None
            return
        params = inspect.signature(varlen_attn).parameters
        self.fn = varlen_attn
        self.extra = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        self.gqa = "enable_gqa" in params
        self.scale = "scale" in params

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_lengths: torch.Tensor, longest: int,
                 scale: float) -> torch.Tensor | None:
        extra = dict(self.extra)
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            if self.gqa:
                extra["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.scale:
            extra["scale"] = scale
        elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            return None  # (its own scale is 1/sqrt(dim), the Llama family's)
        try:
            return self.fn(q, k, v, cu_lengths, cu_lengths, longest, longest, **extra)
        except Exception as exc:
            if not unsupported(exc):
                raise
            logging.getLogger("xllm_async.model").warning("varlen flash attention unusable, SDPA instead: %s", exc)
            self.fn = None
            return None


# What torch says when a kernel cannot run on this build, device or shape at all ("GQA is not
# supported with the cuDNN backend", "FlashAttention only supports Ampere GPUs or newer", "no
# kernel image is available"): the same on every later call.
_UNSUPPORTED = re.compile(r"not (yet )?supported|does not support|only supports?|not implemented|unsupported"
                          r"|no kernel image", re.IGNORECASE)


def unsupported(exc: BaseException) -> bool:
    """Whether a kernel's failure means it cannot serve this process (a signature that moved, a
    backend that refuses the device or the shape), not that this call failed (memory, a fault)."""
    if isinstance(exc, torch.OutOfMemoryError):  # (a RuntimeError, whatever its message says)
        return False
    if isinstance(exc, (TypeError, ValueError, NotImplementedError)):  # arguments it does not take
        return True
    return isinstance(exc, RuntimeError) and _UNSUPPORTED.search(str(exc)) is not None
