"""The small layers a Llama-family decoder is made of, written for serving:
inputs are packed token rows [tokens, hidden], never [batch, seq, hidden]; and a
decoder layer's arithmetic, once (layer_inputs and layer_output over a LayerPlan),
on the fused kernels or on PLAIN_OPS, the same operations in torch's operators."""

from __future__ import annotations

import math
from types import SimpleNamespace

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
        return (self.fused or PLAIN_OPS).rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch's operators, in float32 as transformers computes it."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, built once; a forward
    looks its positions up (one gather shared by every layer)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        # On the CPU even inside a meta-device block (loader.empty_model): arange on the meta device goes
        # through torch._refs, which imports torch._dynamo (~1.7 s of every start-up). .to() moves them.
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu) / head_dim))
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq)
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


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor | None,
         eps: float) -> torch.Tensor:
    """x's heads normed (where norm_weight is given: Qwen3's q/k norm), then rotated."""
    return apply_rotary(x if norm_weight is None else rms_norm(x, norm_weight, eps), cos, sin)


def add_rms_norm(attn: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (x + attn, its norm)."""
    x = x + attn
    return x, rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# The fused kernels' operations (torch.ops.xllm, gpu_kernels.OPS) in torch's operators: the layer's
# arithmetic (llama.layer_inputs, layer_output) runs on these where no fused kernels serve. The rotary
# tables they take are RotaryEmbedding.lookup's unfused ones.
PLAIN_OPS = SimpleNamespace(rms_norm=rms_norm, rope=rope, add_rms_norm=add_rms_norm, silu_mul=silu_mul)


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
            out = self.down.forward(silu_mul(self.gate_up.forward(x)))
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
        # (each linear's forward called directly: a small step's host time is in such calls)
        return self.down.forward(self.fused.silu_mul(self.gate_up.forward(x)))


def norm_args(norm: RMSNorm | None) -> tuple[torch.Tensor | None, float]:
    """The fused rotary kernel's optional per-head norm: its weight and epsilon."""
    return (None, 0.0) if norm is None else (norm.weight, norm.eps)


class LayerPlan:
    """A decoder layer (llama.DecoderLayer) as its arithmetic reads it: the operations' namespace
    (the fused kernels', or PLAIN_OPS), its weights and shapes, and its linears' and MLP's forwards
    (called directly: whatever Linear holds, packed or quantized, its forward computes), read once,
    so that a step of a few rows spends no host time on module calls and look-ups (llama.SmallStep)."""

    __slots__ = ("ops", "layer", "in_weight", "in_eps", "qkv", "sizes", "q_shape", "kv_shape", "q_norm", "q_eps",
                 "k_norm", "k_eps", "scale", "o", "post_weight", "post_eps", "mlp")

    def __init__(self, layer) -> None:
        attn = layer.attn
        self.ops = layer.fused or PLAIN_OPS
        self.layer, self.scale = attn.layer, attn.scale
        self.in_weight, self.in_eps = layer.input_norm.weight, layer.input_norm.eps
        self.qkv, self.o, self.mlp = attn.qkv.forward, attn.o.forward, layer.mlp.forward
        self.sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        self.q_shape, self.kv_shape = (-1, attn.heads, attn.head_dim), (-1, attn.kv_heads, attn.head_dim)
        self.q_norm, self.q_eps = norm_args(attn.q_norm)
        self.k_norm, self.k_eps = norm_args(attn.k_norm)
        self.post_weight, self.post_eps = layer.post_attention_norm.weight, layer.post_attention_norm.eps


# A decoder layer's arithmetic, written once: every forward runs its layers through these two
# (llama.CausalLM.forward through DecoderLayer, the graph pieces likewise, SmallStep directly); only
# csrc/small_step.cpp repeats them, natively, tested bit for bit against them.

def layer_inputs(p: LayerPlan, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's first half: its input rows -> q [rows, heads, dim], k, v [rows, kv_heads, dim],
    normed and rotated. x may carry padding rows after the batch's tokens (CausalLM.pad_rows): the
    projection takes them, nothing after it."""
    ops = p.ops
    qkv = p.qkv(ops.rms_norm(x, p.in_weight, p.in_eps))
    if qkv.shape[0] != cos.shape[0]:
        qkv = qkv[:cos.shape[0]]
    q, k, v = qkv.split_with_sizes(p.sizes, -1)
    return (ops.rope(q.view(p.q_shape), cos, sin, p.q_norm, p.q_eps),
            ops.rope(k.view(p.kv_shape), cos, sin, p.k_norm, p.k_eps), v.view(p.kv_shape))


def layer_output(p: LayerPlan, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The layer's second half: its input rows and their attention [rows, heads * dim] -> its output
    rows (the o projection, the residual add and the norm, the MLP and its residual add)."""
    x, normed = p.ops.add_rms_norm(p.o(attn), x, p.post_weight, p.post_eps)
    return p.mlp(normed, x)
