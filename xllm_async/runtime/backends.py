"""What computes a model on its device, chosen once when it loads, from the device, the dtype
and the model's shapes (as vLLM's get_attn_backend does): the attention backend, the packed
linear, the fused elementwise kernels, the beam top-k. The model's code and the engine then call
what was chosen, with no device branches of their own."""

from __future__ import annotations

import torch

from ..model import cpu_kernels, cpu_linear, gpu_kernels
from ..model.attention_backends import (
    AttentionBackend,
    CpuKernelAttention,
    CudaFlashAttention,
    MaskedSdpaAttention,
    SdpaAttention,
)
from ..model.flash_varlen import FlashVarlen
from .device import fast_cpu_dtype


def on_host(device: torch.device) -> bool:
    """Whether the model runs on the CPU (its weights in host memory, host_memory.py)."""
    return device.type == "cpu"


def preferred_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype a model runs in on this device whatever its checkpoint says: on CPU the fastest
    the CPU has (device.fast_cpu_dtype); None elsewhere (the checkpoint's own)."""
    return fast_cpu_dtype() if on_host(device) else None


def choose_attention(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> AttentionBackend:
    """The attention backend for this device, dtype, head width and query heads per key head."""
    if on_host(device):
        wanted = CpuKernelAttention.takes(dtype, head_dim, group) if cpu_kernels.available() else (False,) * 3
        kernels = [kernel() if takes else None for kernel, takes in zip(
            (cpu_kernels.varlen_attention, cpu_kernels.decode_attention, cpu_kernels.prefix_attention), wanted)]
        if not any(kernels):
            return SdpaAttention(dtype)
        return CpuKernelAttention(dtype, *kernels, cached=cpu_kernels.cached_attention())
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        flash = FlashVarlen()
        if flash.fn is not None:
            return CudaFlashAttention(dtype, flash)
    return MaskedSdpaAttention(dtype)


def choose_linear(device: torch.device, dtype: torch.dtype) -> str | None:
    """The packed linear for this device and dtype (cpu_linear.linear_packing: "ours" or
    "onednn"), or None: plain F.linear (accelerators)."""
    return cpu_linear.linear_packing(dtype) if on_host(device) else None


def linear_name(packing: str, dtype: torch.dtype) -> str:
    """What start-up logs for the packed linear layers."""
    if packing != "ours":
        return "oneDNN's linear"
    if dtype == torch.float32:
        return "our float32 AVX512 linear"
    return f"our {cpu_kernels.ISA_NAMES[cpu_kernels.our_linear()]} linear"


def choose_fused(device: torch.device, dtype: torch.dtype):
    """(the fused elementwise kernels' namespace, whether a prefill's MLP runs in chunks, what
    start-up says), or None where no fused kernels serve this device and dtype."""
    if on_host(device):
        if not cpu_kernels.wanted(dtype):
            return None
        return torch.ops.xllm, True, f"our fused {str(dtype).removeprefix('torch.')} CPU kernels"
    if device.type == "cuda" and gpu_kernels.wanted(device, dtype):
        return gpu_kernels.OPS, False, "our fused Triton kernels"
    return None


def choose_beam_topk(device: torch.device, dtype: torch.dtype):
    """Our beam top-k kernel (csrc/beam_topk.cpp) where logits in the model's dtype are bfloat16 on
    a CPU that has it, else None (torch.topk and torch.logsumexp)."""
    if not on_host(device) or dtype != torch.bfloat16 or not cpu_kernels.available():
        return None
    return cpu_kernels.topk_logsumexp()
