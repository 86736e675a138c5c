"""The Llama family as a server runs it: Llama (SmolLM2), Qwen2 and Qwen3.

They differ in three switches: Qwen2 has biases on q/k/v, Qwen3 normalises
each head's queries and keys, Llama may have biases anywhere. Everything else
(fused QKV, fused gate/up, rotary halves, RMSNorm, tied embeddings) is shared.
A forward takes packed token rows and a forward context (forward_context.py)
and returns the final hidden states of the rows that need logits; the LM head
is a separate call so that beam search can compute only the tokens it may take.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import quantized
from .cpu_linear import (
    EXACT_ROWS,
    PackedWeight,
    argmax_serves,
    packed_argmax,
    packed_linear,
    packed_topk,
    rows_padded,
    topk_serves,
)
from .layers import (
    PLAIN_OPS,
    GatedMlp,
    LayerPlan,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    layer_inputs,
    layer_output,
    norm_args,
)
from .quantized import QuantWeight

FAMILIES = ("llama", "qwen2", "qwen3")


class ModelShape:
    """What the code needs from config.json, read once."""

    def __init__(self, config) -> None:
        self.family = config.model_type
        self.hidden = config.hidden_size
        self.layers = config.num_hidden_layers
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.intermediate = config.intermediate_size
        self.vocab = config.vocab_size
        self.eps = config.rms_norm_eps
        self.max_positions = config.max_position_embeddings
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        self.rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        self.qkv_bias = self.family == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.o_bias = self.family == "llama" and bool(getattr(config, "attention_bias", False))
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.qk_norm = self.family == "qwen3"
        self.tied = bool(getattr(config, "tie_word_embeddings", False))

    def unsupported(self) -> str | None:
        """Why our code cannot run this config (None: it can)."""
        if self.family not in FAMILIES:
            return f"model type {self.family!r} is not one of {', '.join(FAMILIES)}"
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if kind not in (None, "default", "llama3"):
            return f"rope scaling {kind!r} is not implemented"
        if self.heads % self.kv_heads:
            return "attention heads are not a multiple of key/value heads"
        return None


class Attention(nn.Module):
    """An attention block's weights and shapes: its q, k, v projection (one fused linear), its output
    projection, Qwen3's per-head norms. The arithmetic around them is layer_inputs' and layer_output's;
    the attention between them the forward's context's."""

    def __init__(self, shape: ModelShape, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv = Linear(shape.hidden, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o = Linear(self.q_size, shape.hidden, bias=shape.o_bias)
        self.q_norm = RMSNorm(self.head_dim, shape.eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, shape.eps) if shape.qk_norm else None


class DecoderLayer(nn.Module):
    fused = None  # set by use_fused_kernels: the kernels' namespace (else PLAIN_OPS)

    def __init__(self, shape: ModelShape, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(shape.hidden, shape.eps)
        self.attn = Attention(shape, layer)
        self.post_attention_norm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = GatedMlp(shape.hidden, shape.intermediate, shape.mlp_bias)
        self._plan: LayerPlan | None = None

    def plan(self) -> LayerPlan:
        """This layer's LayerPlan, made at its first forward (after the weights are loaded and laid
        out) and again when its kernels change (tests switch them off and on)."""
        if self._plan is None or self._plan.ops is not (self.fused or PLAIN_OPS):
            self._plan = LayerPlan(self)
        return self._plan

    def to_attention(self, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return layer_inputs(self.plan(), x, cos, sin)

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return layer_output(self.plan(), x, attn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx, keep=None) -> torch.Tensor:
        """Both halves around the context's attention (the graph pieces run them apart:
        runtime/graphs.py). keep: on the last layer of a prefill, the rows that need logits."""
        plan = self.plan()
        q, k, v = layer_inputs(plan, x, cos, sin)
        attn = ctx.attend(plan.layer, q, k, v, plan.scale)
        if keep is not None:  # only the rows that need logits go on
            x = x[keep]
            if not ctx.last_only:  # scoring: attention ran for every row, the kept ones go on
                attn = attn[keep]
        elif attn.shape[0] < x.shape[0]:  # x's padding rows (CausalLM.pad_rows) again, as zeros
            attn = F.pad(attn, (0, 0, 0, x.shape[0] - attn.shape[0]))
        return layer_output(plan, x, attn)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm; logits() is the LM head."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        # Its weight given, not drawn: a random init on the meta device imports torch._dynamo (~1.7 s
        # of every start-up), and the checkpoint fills it anyway.
        self.embed = nn.Embedding(shape.vocab, shape.hidden, _weight=torch.empty(shape.vocab, shape.hidden))
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, shape.eps)
        self.rotary = RotaryEmbedding(shape.head_dim, shape.max_positions, shape.rope_theta, shape.rope_scaling)
        self.lm_head = self.embed.weight if shape.tied else nn.Parameter(torch.empty(shape.vocab, shape.hidden))
        # The LM head laid out for the packed linear too (cpu_linear.pack_linears), for logits over the
        # vocabulary or a block of its columns; a copy, since subsets of rows (item tables) and the
        # tied embedding read the plain one.
        self.packed_lm_head: PackedWeight | None = None
        # Or kept quantized (quant_loader.py), for the same logits; the plain one stays for the same reasons.
        self.quant_lm_head: QuantWeight | None = None
        self.pad_rows = False  # set with the packing: token rows padded to padded_rows() sizes
        self.fused = None  # set by use_fused_kernels
        self._small: SmallStep | None = None  # the layers as a small step runs them, made at the first

    def forward(self, tokens: torch.Tensor, ctx, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """tokens [rows] -> final hidden states [rows that need logits, hidden]. between_layers:
        called after every layer (the engine's CPU core rule takes or gives back cores there)."""
        rows = tokens.shape[0]
        if self.fused and rows <= EXACT_ROWS and getattr(ctx, "last", None) is None:
            x = F.embedding(tokens, self.embed.weight)
            cos, sin = self.rotary.lookup(ctx.positions, x.dtype, True)
            return self._small_step().run(x, cos, sin, ctx, between_layers)
        if self.pad_rows:
            # oneDNN compiles a kernel per number of rows (cpu_linear.padded_rows): the rows go through
            # the layers padded to one of a few sizes, and only attention sees the real ones.
            tokens = rows_padded(tokens)
        x = self.embed(tokens)
        cos, sin = self.rotary.lookup(ctx.positions, x.dtype, self.fused)
        last = self.layers[-1]
        for layer in self.layers[:-1]:
            x = layer(x, cos, sin, ctx)
            if between_layers is not None:
                between_layers()
        keep = getattr(ctx, "last", None)
        if keep is not None and not ctx.scoring:
            ctx.last_only = True
        x = last(x, cos, sin, ctx, keep)
        if between_layers is not None:
            between_layers()  # before the LM head (the runner's next call) too
        return self.norm(x if keep is not None else x[:rows])

    def _small_step(self) -> SmallStep:
        if self._small is None or self._small.ops is not self.fused:  # (tests switch the kernels off and on)
            self._small = SmallStep(self)
        return self._small

    @property
    def picks_greedy(self) -> bool:
        """Whether greedy() picks through the LM head's fused pick (our packed head, in a dtype it
        picks exactly), making no [rows, vocab] logits."""
        return self.quant_lm_head is None and argmax_serves(self.packed_lm_head, self.lm_head.dtype)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over logits(hidden), int64 [rows] (the first on ties): the fused pick where
        picks_greedy, else over the logits (torch's argmax: sampling.argmax_rows's answers)."""
        if self.picks_greedy:
            return packed_argmax(hidden, self.packed_lm_head)
        return self.logits(hidden).argmax(-1)

    @property
    def picks_top(self) -> bool:
        """Whether top() picks through the LM head's fused top-k (as picks_greedy: no logits made)."""
        return self.quant_lm_head is None and topk_serves(self.packed_lm_head, self.lm_head.dtype)

    def top(self, hidden: torch.Tensor, width: int):
        """Where picks_top: (values, columns, first NaN columns) of each row's `width` largest logits
        (cpu_linear.packed_topk)."""
        return packed_topk(hidden, self.packed_lm_head, width)

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, as_float: bool = True,
               columns: tuple[int, int] | None = None) -> torch.Tensor:
        """Logits [rows, vocab]; or [rows, len(tokens)] over only these token ids; or over the
        vocabulary's columns [start, end) (a view of the head's rows, nothing copied). float32
        unless as_float is False (then in the model's dtype)."""
        if tokens is None and self.quant_lm_head is not None:
            head = self.quant_lm_head if columns is None else self.quant_lm_head.columns(*columns)
            logits = head.linear(hidden)
            return logits.float() if as_float else logits
        if tokens is None and self.packed_lm_head is not None:
            head = self.packed_lm_head if columns is None else self.packed_lm_head.columns(*columns)
            if head is not None:
                logits = packed_linear(hidden, head)
                return logits.float() if as_float else logits
        if columns is not None:
            weight = self.lm_head[columns[0]:columns[1]]
        else:
            weight = self.lm_head if tokens is None else self.lm_head.index_select(0, tokens)
        rows = hidden.shape[0]
        if self.pad_rows:
            # A beam round's rows (its live beams) take any number, and oneDNN (under torch.matmul)
            # compiles a matmul kernel per number of rows: padded, they meet a few sizes.
            hidden = rows_padded(hidden)
        logits = torch.matmul(hidden, weight.t())[:rows]
        return logits.float() if as_float else logits


class SmallStep:
    """A step of a few rows (a decode step, a beam round) on the fused kernels: the layers' arithmetic
    (layer_inputs, layer_output) over their LayerPlans in a plain loop, without the generic forward's
    module calls and branches (padding rows, the rows kept for logits), which cost a small step more
    host time than its elementwise kernels; or, where it can run, the whole loop natively in one call
    (csrc/small_step.cpp: the same operations in the same order, so the same answers)."""

    __slots__ = ("ops", "layers", "norm", "native")

    def __init__(self, model: CausalLM) -> None:
        self.ops = model.fused
        self.norm = (model.norm.weight, model.norm.eps)
        self.native = _native_plan(model)
        self.layers = [layer.plan() for layer in model.layers]

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx,
            between_layers: Callable[[], None] | None) -> torch.Tensor:
        """Embedded rows [rows, hidden] -> final hidden states, as CausalLM.forward's layers."""
        native_cache = getattr(ctx, "native_cache", None) if self.native and NATIVE_STEP else None
        cache = native_cache() if native_cache is not None else None
        if cache is not None:
            # The whole loop in one call (csrc/small_step.cpp): between_layers once, after it (the
            # step loop asks before every step too; a step is too short to widen in).
            weights, eps, sizes, scale, formats = self.native
            x = torch.ops.xllm.small_step(x, cos, sin, weights, eps, sizes, *cache, scale, formats, TEAM_STEP,
                                          ctx.sharing)
            if between_layers is not None:
                between_layers()
            return x
        attend = ctx.attend
        for plan in self.layers:
            q, k, v = layer_inputs(plan, x, cos, sin)
            x = layer_output(plan, x, attend(plan.layer, q, k, v, plan.scale))
            if between_layers is not None:
                between_layers()
        return self.ops.rms_norm(x, *self.norm)


# Whether decode steps run their layer loop natively where they can (SmallStep.native), and there in
# one OpenMP team where that can run (csrc/team_step.cpp) rather than as operator calls; tests and
# perf/decode_step.py switch them to compare.
NATIVE_STEP = True
TEAM_STEP = True


def _native_plan(model: CausalLM) -> tuple[list, list[float], list[int], float, list[str]] | None:
    """What csrc/small_step.cpp takes for this model (its weights, eps and sizes, flat, the
    attention's scale and each linear's format), where it can run it: our CPU kernels loaded with
    small_step, every linear packed for ours (format "") or kept in GGUF blocks where our quantized
    kernel verified (its format); else None."""
    if model.fused is not torch.ops.xllm or not hasattr(torch.ops.xllm, "small_step"):
        return None
    weights, eps, formats = [], [], []
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        linears = []
        for lin in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
            if lin.quant is not None and quantized.kernel_verified():
                linears.append(lin.quant.packed)
                formats.append(lin.quant.kind)
            elif lin.quant is None and lin.packed is not None and lin.packed.ours is not None:
                linears.append(lin.packed.ours)
                formats.append("")
            else:
                return None
        qkv, o, gate_up, down = linears
        q_norm, q_eps = norm_args(attn.q_norm)
        k_norm, k_eps = norm_args(attn.k_norm)
        weights += [layer.input_norm.weight, qkv, attn.qkv.bias, q_norm, k_norm, o, attn.o.bias,
                    layer.post_attention_norm.weight, gate_up, mlp.gate_up.bias, down, mlp.down.bias]
        eps += [layer.input_norm.eps, q_eps, k_eps, layer.post_attention_norm.eps]
    attn = model.layers[0].attn
    sizes = [len(model.layers), attn.q_size, attn.kv_size, attn.heads, attn.kv_heads, attn.head_dim,
             model.layers[0].mlp.down.in_features]
    # (none where every linear is plain: the call converts the list at every step)
    return weights + [model.norm.weight], eps + [model.norm.eps], sizes, attn.scale, formats if any(formats) else []


def use_fused_kernels(model: nn.Module, ops=None, chunk_mlp: bool = False) -> None:
    """Switch the elementwise steps to fused kernels: every norm, q/k norm + rotary, residual add +
    norm, SiLU x up. ops: their namespace, our CPU kernels' (torch.ops.xllm, the default:
    cpu_kernels.py, bfloat16 or float32) or our GPU kernels' (gpu_kernels.OPS); the caller checks
    that they loaded and take the model's dtype. chunk_mlp: a prefill's MLP in chunks of rows
    (cpu_linear.in_chunks: for a CPU core's cache)."""
    ops = ops if ops is not None else torch.ops.xllm
    for module in model.modules():
        if isinstance(module, (RMSNorm, DecoderLayer, GatedMlp, CausalLM)):
            module.fused = ops
        if isinstance(module, GatedMlp):
            module.chunked = chunk_mlp
