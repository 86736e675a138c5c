"""How attention is computed, one object per way, chosen once when the model loads
(runtime/backends.py choose_attention), as vLLM's attention backends are. AttentionBackend
declares what every backend answers a forward's context (forward_context.py) and the optional
capabilities a context reads; tests/test_contracts.py checks every backend against it.

SdpaAttention: torch's kernels on a CPU. CpuKernelAttention: ours (csrc/), where they take
the dtype and the head shape, torch's for the rest. MaskedSdpaAttention: accelerators, every
decode row in one masked call. CudaFlashAttention: that, with packed prompts in one call of
torch's varlen flash attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from .flash_varlen import FlashVarlen

# The fused CPU attention kernel behind scaled_dot_product_attention, called directly for the
# log-sum-exp it also returns (None where this torch has no such operator).
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# In bfloat16 (and float16) torch's fused CPU attention runs on oneDNN micro-kernels that it
# compiles for each shape of block it meets, a block's rows and keys being what is left of a
# sequence after whole blocks, and keeps for good, in every thread. Prompts of any length met
# new shapes without end (each thread's memory grew with them: perf/RESULTS.md, "The soak"),
# and odd lengths ran slower too. So there, sequences reach the kernel in multiples of
# ATTENTION_MULTIPLE tokens. Float32 takes another path, and neither grows nor gains.
ATTENTION_MULTIPLE = 16


def _pad_tokens(x: torch.Tensor, to: int) -> torch.Tensor:
    """[..., tokens, dim] with zero tokens after the real ones, up to `to`."""
    return x if x.shape[-2] == to else F.pad(x, (0, 0, 0, to - x.shape[-2]))


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial attentions over disjoint keys -> attention over all of them."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * (lse_a - lse).exp() + out_b * (lse_b - lse).exp()


def plain_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T) v and each query's log-sum-exp (float32), in plain operations: the products
    in the inputs' dtype (a caller that wants them in float32 hands float32 in), the softmax in
    float32. The one attention written out in Python; every other is a kernel's."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).float()
    peak = scores.amax(dim=-1, keepdim=True)
    weights = (scores - peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = (torch.matmul(weights.to(values.dtype), values) / total).to(values.dtype)
    return out, peak + total.log()


def _after(skip: int, length: int, rows: int, keys: int, device: torch.device) -> torch.Tensor:
    """The causal mask [rows, keys] of `length` queries that follow `skip` cached keys, padded with
    rows and keys after them (ATTENTION_MULTIPLE): a padding key is seen by no real query."""
    seen = torch.arange(skip, skip + rows, device=device).clamp_(max=skip + length - 1)
    return torch.arange(keys, device=device) <= seen[:, None]


class AttentionBackend(ABC):
    """What every attention backend answers a forward's context (forward_context.py), and the
    optional capabilities a context may use, declared here (None or False: this backend has
    none) and never sniffed."""

    # PackedPrefill builds its sequences' starts on the device (cu_lengths): the flash kernel's input.
    needs_cu_lengths: bool = False
    # Our native decode attention (csrc/decode_attention.cpp), where this backend's decode() is it:
    # then a decode step may run its whole layer loop natively (Decode.native_cache, csrc/small_step.cpp).
    decode_kernel = None

    @abstractmethod
    def prefill(self, ctx, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Causal attention of ctx's packed prompts (a PackedPrefill; their keys already in its cache,
        where it has one): q [tokens, heads, dim], k, v [tokens, kv_heads, dim] -> [tokens (or one per
        sequence where ctx.last_only), heads * dim]."""

    @abstractmethod
    def decode(self, ctx, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """A decode step's rows (ctx: a Decode) against their cache slabs, the new keys already in:
        q [rows, heads, dim] -> [rows, heads * dim]."""

    @abstractmethod
    def beam_prompt(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, own_out: torch.Tensor,
                    own_lse: torch.Tensor, scale: float) -> torch.Tensor:
        """One request's beams q [beams, heads, dim] against its prompt's keys/values [kv_heads,
        prompt, dim], merged with own_out/own_lse [beams, kv_heads, group, ...] (their attention over
        their own tokens, BeamDecode) -> [beams, kv_heads, group, dim]."""


class SdpaAttention(AttentionBackend):
    """torch's attention on a CPU: a packed prefill in a call per run of equal lengths, a decode
    step in a call per run of rows of equal length (never one masked call over the longest row:
    that kernel blocks its keys by their number, so a row's sums, and in bfloat16 its greedy
    tokens, would depend on the rows beside it)."""

    def __init__(self, dtype: torch.dtype, flash=FLASH_CPU) -> None:
        self.multiple = 1 if dtype == torch.float32 else ATTENTION_MULTIPLE
        self.flash = flash  # the fused CPU kernel that returns the log-sum-exp (None: plain operations)

    def span(self, n: int) -> int:
        """How many tokens a sequence of n reaches torch's kernel with (ATTENTION_MULTIPLE)."""
        return -(-n // self.multiple) * self.multiple

    def prefill(self, ctx, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        outs = []
        row = ctx.first_row
        for start, count, length, skip in ctx.groups:
            end = start + count * length
            if ctx.cache is not None:  # (attended where they were just stored, after a cached prefix)
                kg = ctx.cache.keys(layer)[row:row + count, :, :skip + length]
                vg = ctx.cache.values(layer)[row:row + count, :, :skip + length]
            else:
                kg = k[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
                vg = v[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
            qg = q[start:end].view(count, length, heads, dim)
            if ctx.last_only:  # (one query a sequence: a shape the kernel does not compile for)
                out = F.scaled_dot_product_attention(qg[:, -1:].transpose(1, 2), kg, vg, scale=scale,
                                                     enable_gqa=True)
            elif skip:  # after a cached prefix: torch's is_causal aligns the queries with the first keys
                rows, keys = self.span(length), self.span(skip + length)
                mask = ctx.masks.get((skip, length))
                if mask is None:
                    mask = ctx.masks[skip, length] = _after(skip, length, rows, keys, q.device)
                out = F.scaled_dot_product_attention(_pad_tokens(qg.transpose(1, 2), rows), _pad_tokens(kg, keys),
                                                     _pad_tokens(vg, keys), attn_mask=mask, scale=scale,
                                                     enable_gqa=True)[:, :, :length]
            else:
                # Causal, so padding tokens after a sequence (ATTENTION_MULTIPLE) change none of its rows.
                span = self.span(length)
                out = F.scaled_dot_product_attention(_pad_tokens(qg.transpose(1, 2), span), _pad_tokens(kg, span),
                                                     _pad_tokens(vg, span), is_causal=True, scale=scale,
                                                     enable_gqa=True)[:, :, :length]
            outs.append(out.transpose(1, 2).reshape(-1, heads * dim))
            row += count
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def decode(self, ctx, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        # Grouped-query attention without repeating keys: the heads sharing a key head are one
        # matrix of queries against it, through torch's fused kernel (not matmul-softmax-matmul).
        rows, heads, dim = q.shape
        kv_heads = keys.shape[1]
        qg = q.view(rows, kv_heads, heads // kv_heads, dim)
        outs = [F.scaled_dot_product_attention(qg[first:first + count], keys[first:first + count, :, :span],
                                               values[first:first + count, :, :span], scale=scale)
                for first, count, span in ctx.length_runs()]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(rows, heads * dim)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [batch, heads, queries, dim] against keys/values [batch, heads, keys, dim] ->
        softmax(q k^T) v, and each query's log-sum-exp [batch, heads, queries, 1] (float32, for
        merging): through the fused kernel, which returns the log-sum-exp too and never holds the
        scores (perf/experiments/cpu_attention.py compares it with plain operations)."""
        if self.flash is None or not q.numel():  # (it faults on no queries)
            return plain_attention(q, keys, values, scale)
        queries, span = q.shape[-2], keys.shape[-2]
        rows, padded = self.span(queries), self.span(span)
        mask = None
        if padded != span:  # the padding keys masked out (ATTENTION_MULTIPLE)
            keys, values = _pad_tokens(keys, padded), _pad_tokens(values, padded)
            mask = torch.zeros(1, 1, 1, padded, dtype=q.dtype, device=q.device)
            mask[..., span:] = float("-inf")
        out, lse = self.flash(_pad_tokens(q, rows), keys, values, 0.0, False, attn_mask=mask, scale=scale)[:2]
        return out[..., :queries, :], lse[..., :queries, None]

    def beam_prompt(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, own_out: torch.Tensor,
                    own_lse: torch.Tensor, scale: float) -> torch.Tensor:
        """All beams in one product: [kv_heads, beams x group, dim] against [kv_heads, prompt, dim]."""
        width, _, dim = q.shape
        kv_heads, group = own_out.shape[1], own_out.shape[2]
        qr = q.view(width, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, width * group, dim)
        out, lse = self.attend(qr, keys[None], values[None], scale)
        own = own_out.permute(1, 0, 2, 3).reshape(kv_heads, width * group, dim)
        merged = _merge(out[0], lse[0], own, own_lse.permute(1, 0, 2, 3).reshape(kv_heads, width * group, 1))
        return merged.view(kv_heads, width, group, dim).permute(1, 0, 2, 3)


# What our attention kernels take (csrc/varlen_attention.cpp, csrc/decode_attention.cpp).
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


class CpuKernelAttention(SdpaAttention):
    """Our CPU kernels: a packed prefill's whole batch in one call (csrc/varlen_attention.cpp), a
    decode step's rows in one call (csrc/decode_attention.cpp: continuous batching's rows mostly
    differ in length), a beam round's prompt stage with the beams' rows as they are and the keys
    packed once. A kernel that is None (it does not take this head shape, or did not load) leaves
    its question to torch's kernels (SdpaAttention)."""

    def __init__(self, dtype: torch.dtype, varlen=None, decode=None, prefix=None, cached=None) -> None:
        super().__init__(dtype)
        self.varlen_kernel, self.decode_kernel, self.prefix_kernel = varlen, decode, prefix
        self.cached_kernel = cached if varlen is not None else None  # prompts after a cached prefix

    @classmethod
    def takes(cls, dtype: torch.dtype, head_dim: int, group: int) -> tuple[bool, bool, bool]:
        """Whether our varlen, decode and prefix kernels take this dtype, head width and number of
        query heads a key head."""
        if dtype not in KERNEL_DTYPES:
            return False, False, False
        width = head_dim % 16 == 0 and head_dim <= 512
        return width, width and head_dim <= 256 and group <= 8, width

    def prefill(self, ctx, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        if ctx.cached is not None:  # (keys from the prompts' cache rows: the cached prefix and the new ones)
            if self.cached_kernel is None:
                return super().prefill(ctx, layer, q, k, v, scale)
            rows = slice(ctx.first_row, ctx.first_row + len(ctx.lengths))
            out = self.cached_kernel(q, ctx.cache.keys(layer)[rows], ctx.cache.values(layer)[rows], ctx.lengths,
                                     ctx.kv_lengths, scale, ctx.last_only)
            return out.view(-1, q.shape[1] * q.shape[2])
        if self.varlen_kernel is None:
            return super().prefill(ctx, layer, q, k, v, scale)
        return self.varlen_kernel(q, k, v, ctx.lengths, scale, ctx.last_only).view(-1, q.shape[1] * q.shape[2])

    def decode(self, ctx, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        if self.decode_kernel is None:
            return super().decode(ctx, q, keys, values, scale)
        return self.decode_kernel(q, keys, values, ctx.reads, scale, ctx.sharing).view(q.shape[0], -1)

    def beam_prompt(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, own_out: torch.Tensor,
                    own_lse: torch.Tensor, scale: float) -> torch.Tensor:
        if self.prefix_kernel is None:
            return super().beam_prompt(q, keys, values, own_out, own_lse, scale)
        out, lse = self.prefix_kernel(q, keys, values, scale)
        return _merge(out.view(own_out.shape), lse.view(own_lse.shape), own_out, own_lse)


class MaskedSdpaAttention(SdpaAttention):
    """torch's attention on an accelerator: a decode step's rows in one call over the longest
    row's keys, the rest masked (a call per run of lengths would read the lengths back from the
    device, a wait at every step); there sums depend on the batch's shape anyway, through the
    kernels' own choices. Sequences reach the kernels at their own lengths."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype, flash=None)  # (log-sum-exps in plain operations)
        self.multiple = 1

    def decode(self, ctx, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        rows, heads, dim = q.shape
        kv_heads = keys.shape[1]
        span = ctx.cache.max_length + 1
        if ctx.mask is None:  # (made at the first layer, read by every other)
            ctx.mask = (torch.arange(span, device=q.device) < ctx.reads[:, None]).view(rows, 1, 1, span)
        out = F.scaled_dot_product_attention(q.view(rows, kv_heads, heads // kv_heads, dim), keys[:rows, :, :span],
                                             values[:rows, :, :span], attn_mask=ctx.mask, scale=scale)
        return out.reshape(rows, heads * dim)


class CudaFlashAttention(MaskedSdpaAttention):
    """MaskedSdpaAttention with a packed prefill's attention in one call of torch's varlen flash
    attention (FlashVarlen: CUDA, bfloat16 and float16), whatever its sequences' lengths; the
    SDPA calls serve where it cannot run."""

    needs_cu_lengths = True

    def __init__(self, dtype: torch.dtype, flash_varlen: FlashVarlen) -> None:
        super().__init__(dtype)
        self.flash_varlen = flash_varlen

    def prefill(self, ctx, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        if self.flash_varlen.fn is not None and ctx.cached is None:  # (the keys just computed are all it sees)
            out = self.flash_varlen(q, k, v, ctx.cu_lengths, max(ctx.lengths), scale)
            if out is not None:
                return (out[ctx.last] if ctx.last_only else out).reshape(-1, q.shape[1] * q.shape[2])
        return super().prefill(ctx, layer, q, k, v, scale)
