"""Attention for the three kinds of forward the engine runs. Each forward gets
one of these context objects (built once, shared by every layer), so the model
code says only what the model computes; the bookkeeping lives here.

- PackedPrefill: prompts concatenated without padding, causal attention per
  sequence, keys written to the cache. In bfloat16 or float32 on a CPU with
  AVX512-BF16 (bfloat16 on AMX tiles where it has them), one call of our kernel
  for the whole batch (csrc/varlen_attention.cpp); elsewhere torch's kernel, a
  call per run of equal-length neighbours.
- Decode: one new token per row against its slab of the cache (a view).
- BeamDecode: the beams of a request share its prompt's keys, stored once; each
  round attends to the prompt once for all beams (one batched product), then to
  each beam's own few tokens, and merges the two by log-sum-exp (xGR's staged
  attention; Hydragen and FlashInfer's cascade do the same).
"""

from __future__ import annotations

import inspect
import logging
import re

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .kv_cache import SlabCache

# The fused CPU attention kernel behind scaled_dot_product_attention, called directly for the
# log-sum-exp it also returns (None where this torch has no such operator).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


# In bfloat16 (and float16) torch's fused CPU attention runs on oneDNN micro-kernels that it
# compiles for each shape of block it meets, a block's rows and keys being what is left of a
# sequence after whole blocks, and keeps for good, in every thread. Prompts of any length met
# new shapes without end: 1,800 bfloat16 prefills of 30-2,000 tokens grew a thread by 190 MB
# here (Intel Xeon, AMX), and odd lengths ran slower too (511 tokens 2.0 ms, 512 tokens 1.4 ms).
# So there, sequences reach the kernel in multiples of ATTENTION_MULTIPLE tokens: +19 MB, flat,
# and prompts of 30-608 tokens 10% faster. Float32 takes another path, neither grows nor gains.
ATTENTION_MULTIPLE = 16


def _padded_span(n: int, q: torch.Tensor) -> int:
    """How many tokens a sequence of n reaches the fused kernel with (n itself in float32)."""
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return n
    return -(-n // ATTENTION_MULTIPLE) * ATTENTION_MULTIPLE


def _pad_tokens(x: torch.Tensor, to: int) -> torch.Tensor:
    """[..., tokens, dim] with zero tokens after the real ones, up to `to`."""
    return x if x.shape[-2] == to else F.pad(x, (0, 0, 0, to - x.shape[-2]))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [batch, heads, queries, dim] against keys/values [batch, heads, keys, dim] ->
    softmax(q k^T) v, and each query's log-sum-exp [batch, heads, queries, 1] (float32, for merging).

    On CPU through the fused kernel scaled_dot_product_attention runs, which returns the
    log-sum-exp too and never holds the scores: a beam round's prompt stage (256 queries x
    1,000 keys x 4 heads, float32) 5.5 -> 1.6 ms a layer here. Elsewhere in plain operations."""
    if q.device.type == "cpu" and _FLASH_CPU is not None and q.numel():  # (it faults on no queries)
        queries, span = q.shape[-2], keys.shape[-2]
        rows, padded = _padded_span(queries, q), _padded_span(span, q)
        mask = None
        if padded != span:  # the padding keys masked out (ATTENTION_MULTIPLE)
            keys, values = _pad_tokens(keys, padded), _pad_tokens(values, padded)
            mask = torch.zeros(1, 1, 1, padded, dtype=q.dtype, device=q.device)
            mask[..., span:] = float("-inf")
        out, lse = _FLASH_CPU(_pad_tokens(q, rows), keys, values, 0.0, False, attn_mask=mask, scale=scale)[:2]
        return out[..., :queries, :], lse[..., :queries, None]
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).float()
    peak = scores.amax(dim=-1, keepdim=True)
    weights = (scores - peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = (torch.matmul(weights.to(values.dtype), values) / total).to(values.dtype)
    return out, peak + total.log()


def _attend_few(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As _attend, for a handful of keys a query (a beam's own tokens: one per round so far), in
    float32 operations: the fused kernel's cost is per (batch, head) problem, and a beam-128
    round's 512 tiny ones took it 1.4 ms a layer against 0.4 here."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)).mul_(scale)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = (scores - peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return (torch.matmul(weights, values.float()) / total).to(q.dtype), peak + total.log()


# What our attention kernels take: bfloat16 and float32 (csrc/decode_attention.cpp since the
# sixteenth session; csrc/varlen_attention.cpp since the eighteenth, float32 on FMAs, where
# torch's kernel was 2.6-3.7x slower: perf/cpu_attention.py).
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _kernel_width(dim: int) -> bool:
    """Head widths our attention kernels take (csrc/varlen_attention.cpp)."""
    return dim % 16 == 0 and dim <= 512


def _equal_runs(values: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal neighbours: (index of the first, how many, the value)."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, value)
        else:
            runs.append((i, 1, value))
    return runs


class _FlashVarlen:
    """torch's variable-length flash attention (torch.nn.attention.varlen: CUDA, bfloat16 and
    float16): a packed prefill's attention in one call, whatever its sequences' lengths, where
    torch's SDPA took a call per run of equal lengths. Its arguments moved between torch releases
    (is_causal became window_size, enable_gqa came later): read off its signature. Off for good,
    with one warning, where a call says it cannot run here (unsupported()): the SDPA calls serve
    as before. Any other failure (out of memory, a device fault) fails that forward's batch only,
    as any forward's error does, and the next batch tries it again."""

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

    def usable(self, q: torch.Tensor) -> bool:
        return self.fn is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)

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


_VARLEN = _FlashVarlen()


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial attentions over disjoint keys -> attention over all of them."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * (lse_a - lse).exp() + out_b * (lse_b - lse).exp()


class PackedPrefill:
    """Prompts packed end to end: positions restart at 0 for every sequence."""

    __slots__ = ("lengths", "groups", "positions", "last", "cache", "first_row", "last_only", "scoring",
                 "last_kept", "cu_lengths")

    def __init__(self, lengths: list[int], device: torch.device, cache: SlabCache | None = None,
                 first_row: int = 0, whole: list[bool] | None = None) -> None:
        self.lengths = lengths
        # Runs of equal lengths (start token, count, length): one attention call each.
        self.groups: list[tuple[int, int, int]] = []
        start = 0
        for _, count, n in _equal_runs(lengths):
            self.groups.append((start, count, n))
            start += count * n
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        ends = torch.tensor(lengths).cumsum(0)
        # Where each sequence starts among the rows, for the flash kernel (accelerators only).
        self.cu_lengths = None if device.type == "cpu" else F.pad(ends, (1, 0)).to(device, torch.int32)
        self.last = (ends - 1).to(device)  # each sequence's last token in the packed rows
        self.last_kept = None  # where each last token is among the rows kept (None: they are all the rows)
        # Scoring (whole[i]: every position of sequence i needs its logits, for prompt logprobs): the
        # last layer keeps all of that sequence's rows and only the last row of the others.
        self.scoring = bool(whole) and any(whole)
        if self.scoring:
            kept, last_kept, start = [], [], 0
            for n, every in zip(lengths, whole):
                kept.extend(range(start, start + n) if every else (start + n - 1,))
                last_kept.append(len(kept) - 1)
                start += n
            self.last = torch.tensor(kept, device=device)
            self.last_kept = torch.tensor(last_kept, device=device)
        self.cache = cache
        self.first_row = first_row
        self.last_only = False  # set by the model for its last layer: only last tokens' outputs matter

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] -> [tokens (or sequences), heads * dim]."""
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        kernel = cpu_kernels.varlen_attention()
        self._store(layer, k, v)
        if kernel is not None and q.dtype in _KERNEL_DTYPES and q.device.type == "cpu" and _kernel_width(dim):
            return kernel(q, k, v, self.lengths, scale, self.last_only).view(-1, heads * dim)
        if _VARLEN.usable(q):  # (the keys just computed are all a prompt attends to, cached or not)
            out = _VARLEN(q, k, v, self.cu_lengths, max(self.lengths), scale)
            if out is not None:
                return (out[self.last] if self.last_only else out).reshape(-1, heads * dim)
        outs = []
        row = self.first_row
        for start, count, length in self.groups:
            end = start + count * length
            if self.cache is not None:  # (attended where they were just stored)
                kg = self.cache.keys(layer)[row:row + count, :, :length]
                vg = self.cache.values(layer)[row:row + count, :, :length]
            else:
                kg = k[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
                vg = v[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
            qg = q[start:end].view(count, length, heads, dim)
            if self.last_only:  # (one query a sequence: a shape the kernel does not compile for)
                out = F.scaled_dot_product_attention(qg[:, -1:].transpose(1, 2), kg, vg, scale=scale,
                                                     enable_gqa=True)
            else:
                # Causal, so padding tokens after a sequence (ATTENTION_MULTIPLE) change none of its rows.
                span = _padded_span(length, q)
                out = F.scaled_dot_product_attention(_pad_tokens(qg.transpose(1, 2), span), _pad_tokens(kg, span),
                                                     _pad_tokens(vg, span), is_causal=True, scale=scale,
                                                     enable_gqa=True)[:, :, :length]
            outs.append(out.transpose(1, 2).reshape(-1, heads * dim))
            row += count
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompts' keys and values into their cache rows (where they have a cache)."""
        if self.cache is None:
            return
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        row, kv_heads, dim = self.first_row, k.shape[1], k.shape[2]
        for start, count, length in self.groups:
            end = start + count * length
            keys[row:row + count, :, :length] = k[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
            values[row:row + count, :, :length] = v[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
            row += count


def _one_masked_call(q: torch.Tensor) -> bool:
    """Whether a decode step's attention runs as one masked call (Decode.attend): on accelerators."""
    return q.device.type != "cpu"


class Decode:
    """One token per live row of a SlabCache: its keys go to position lengths[row]."""

    __slots__ = ("cache", "positions", "rows", "runs", "reads", "slots", "mask")

    def __init__(self, cache: SlabCache) -> None:
        self.cache = cache
        self.rows = cache.rows
        self.positions = cache.lengths[:self.rows].clone()
        self.reads = self.positions + 1  # keys each row reads, its new one included
        self.runs = None  # for torch's kernel only, found at its first layer (_runs)
        self.mask = None  # on accelerators, which keys each row reads, made at the first layer (attend)
        # Where each (row, key head)'s new key goes in a layer's slabs seen as [tokens, dim]: found
        # once for every layer. One index_copy_ a layer took 3.5-7 us against 5.7-11 us for the
        # advanced-indexing write with its arange (1-64 rows, perf/RESULTS.md, fourteenth session).
        _, kv_heads, capacity, _ = cache.keys(0).shape
        heads = torch.arange(kv_heads, device=self.positions.device)
        rows = torch.arange(self.rows, device=self.positions.device)
        self.slots = ((rows[:, None] * kv_heads + heads) * capacity + self.positions[:, None]).reshape(-1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        keys.view(-1, dim).index_copy_(0, self.slots, k.reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, self.slots, v.reshape(-1, dim))
        kernel = cpu_kernels.decode_attention()
        if (kernel is not None and q.dtype in _KERNEL_DTYPES and q.device.type == "cpu" and dim % 32 == 0
                and dim <= 256 and heads // kv_heads <= 8):
            # Every row in one call of our kernel (csrc/decode_attention.cpp), not a call per run of
            # equal lengths: continuous batching's rows mostly differ.
            return kernel(q, keys, values, self.reads, scale).view(rows, heads * dim)
        # Grouped-query attention without repeating keys: the heads sharing a key head are one
        # matrix of queries against it. torch's fused CPU kernel, not matmul-softmax-matmul: a
        # SmolLM2 step's attention (1 row, 3 x 3 heads, 256 keys, bfloat16) 117 -> 28 us a layer.
        qg = q.view(rows, kv_heads, heads // kv_heads, dim)
        if _one_masked_call(q):
            # On an accelerator every row in one call over the longest row's keys, the rest masked:
            # _runs would read the lengths back from the device (a wait at every step) and make a
            # call per run. (Sums then depend on the batch's longest row; on these devices they
            # depend on the batch's shape anyway, through the kernels' own choices.)
            span = self.cache.max_length + 1
            if self.mask is None:
                self.mask = (torch.arange(span, device=q.device) < self.reads[:, None]).view(rows, 1, 1, span)
            out = F.scaled_dot_product_attention(qg, keys[:rows, :, :span], values[:rows, :, :span],
                                                 attn_mask=self.mask, scale=scale)
            return out.reshape(rows, heads * dim)
        outs = [F.scaled_dot_product_attention(qg[first:first + count], keys[first:first + count, :, :span],
                                               values[first:first + count, :, :span], scale=scale)
                for first, count, span in self._runs()]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(rows, heads * dim)

    def _runs(self) -> list[tuple[int, int, int]]:
        """Runs of rows of equal length (first row, count, keys to read): one call of torch's kernel
        each, over exactly the keys of those rows. Never one call over the batch's longest row with
        the rest masked: that kernel blocks its keys by their number, so a row's sums (and in
        bfloat16 its greedy tokens) would depend on the rows beside it."""
        if self.runs is None:
            self.runs = _equal_runs(self.reads.tolist())
        return self.runs


class BeamDecode:
    """A round of beam search: `beams` rows, beams of request i are rows
    [starts[i], starts[i + 1]) and share prompt row i of the prompt cache; their
    own keys live in `own` [layers, 2, beams, kv_heads, rounds, dim] at index step."""

    __slots__ = ("prompts", "prompt_lengths", "starts", "own", "step", "positions")

    def __init__(self, prompts: SlabCache, prompt_lengths: list[int], starts: list[int], own: torch.Tensor,
                 step: int, device: torch.device) -> None:
        self.prompts = prompts
        self.prompt_lengths = prompt_lengths
        self.starts = starts
        self.own = own
        self.step = step
        widths = [b - a for a, b in zip(starts, starts[1:])]
        self.positions = torch.tensor([n + step for n, w in zip(prompt_lengths, widths) for _ in range(w)],
                                      device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        beams, heads, dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        own_keys, own_values = self.own[layer, 0, :beams], self.own[layer, 1, :beams]  # fewer may live than fit
        own_keys[:, :, self.step] = k
        own_values[:, :, self.step] = v
        qg = q.view(beams, kv_heads, group, dim)
        # Stage 2 first (it is one call for every beam): each beam against its own tokens.
        own_out, own_lse = _attend_few(qg, own_keys[:, :, :self.step + 1], own_values[:, :, :self.step + 1], scale)
        # Stage 1: all beams of a request against its prompt, one product per request:
        # [kv_heads, beams x group, dim] against [kv_heads, prompt, dim].
        prompt_keys, prompt_values = self.prompts.keys(layer), self.prompts.values(layer)
        kernel = cpu_kernels.prefix_attention()
        if q.dtype not in _KERNEL_DTYPES or q.device.type != "cpu" or not _kernel_width(dim):
            kernel = None
        outs = []
        for row, (first, end) in enumerate(zip(self.starts, self.starts[1:])):
            width, length = end - first, self.prompt_lengths[row]
            if not width:  # every beam of this request had one way to end (engine/beam.py)
                continue
            if kernel is not None:  # (our kernel: the beams' rows as they are, keys packed once)
                out, lse = kernel(q[first:end], prompt_keys[row, :, :length], prompt_values[row, :, :length], scale)
                outs.append(_merge(out.view(width, kv_heads, group, dim), lse.view(width, kv_heads, group, 1),
                                   own_out[first:end], own_lse[first:end]))
                continue
            qr = qg[first:end].permute(1, 0, 2, 3).reshape(1, kv_heads, width * group, dim)
            out, lse = _attend(qr, prompt_keys[row:row + 1, :, :length], prompt_values[row:row + 1, :, :length],
                               scale)
            own = own_out[first:end].permute(1, 0, 2, 3).reshape(kv_heads, width * group, dim)
            merged = _merge(out[0], lse[0], own,
                            own_lse[first:end].permute(1, 0, 2, 3).reshape(kv_heads, width * group, 1))
            outs.append(merged.view(kv_heads, width, group, dim).permute(1, 0, 2, 3))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(beams, heads * dim).to(q.dtype)
