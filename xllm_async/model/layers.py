"""The small layers a Llama-family decoder is made of, written for serving:
inputs are packed token rows [tokens, hidden], never [batch, seq, hidden]."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_linear import CHUNK_ROW_STEP, QUANT_MLP_CHUNK_BYTES, PackedWeight, in_chunks, packed_linear
from .quantized import QuantWeight


class Linear(nn.Linear):
    """nn.Linear whose weight can be laid out once for this CPU's faster linear
    (cpu_linear.pack_linears): then `weight` is None and `packed` holds it (PackedWeight); or kept
    quantized (quant_loader.py): then `weight` is None and `quant` holds its blocks (QuantWeight)."""

    packed: PackedWeight | None = None
    quant: QuantWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does, so that
    bfloat16 models round the same way as the reference."""

    fused = None  # set by llama.use_fused_kernels: the kernels' namespace (one pass of our CPU or GPU kernel)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, built once; a forward
    looks its positions up (one gather shared by every layer)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, 1, head_dim] for these positions, broadcast over heads; for the
        fused kernel (cpu_kernels.py) float32 [tokens, head_dim], rounded inside as here."""
        if fused:
            return self.cos[positions], self.sin[positions]
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim], rotated by halves (the Llama/Qwen convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.x's frequency scaling: long wavelengths slowed by factor, short ones kept."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class GatedMlp(nn.Module):
    """SwiGLU with gate and up projections fused into one matrix."""

    fused = None  # set by llama.use_fused_kernels
    chunked = False  # likewise, on CPU: a prefill's rows in chunks that stay in a core's cache (cpu_linear)

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate, bias=bias)
        self.down = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x's rows, + residual where given (the layer's residual add, made as each chunk
        of rows is written rather than in a pass of its own over a prompt's rows)."""
        if not self.fused:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            out = self.down(F.silu(gate) * up)
            return out if residual is None else residual + out
        # (a decode step's few rows never chunk: no arithmetic for them, per layer per token)
        if self.chunked and x.shape[0] > CHUNK_ROW_STEP:
            chunk_bytes = QUANT_MLP_CHUNK_BYTES if self.gate_up.quant is not None else None
            return in_chunks(self.fused_forward, x, self.gate_up.out_features, self.down.out_features, residual,
                             chunk_bytes)
        out = self.fused_forward(x)
        return out if residual is None else out.add_(residual)  # (addition commutes: bit for bit x + mlp)

    def fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of these rows on the fused SiLU x up kernel."""
        return self.down(self.fused.silu_mul(self.gate_up(x)))
