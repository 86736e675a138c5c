"""The forward contexts: one per kind of forward the engine runs. Each forward gets
one of these objects (built once, shared by every layer), so the model code says
only what the model computes; the bookkeeping (positions, where keys go, which
rows need logits) lives here, and the attention itself in the backend chosen at
load (attention_backends.py's AttentionBackend), which a context calls.

- PackedPrefill: prompts concatenated without padding, causal attention per
  sequence, keys written to the cache.
- Decode: one new token per row against its slab of the cache (a view).
- BeamDecode: the beams of a request share its prompt's keys, stored once; each
  round attends to the prompt once for all beams (one batched product), then to
  each beam's own few tokens, and merges the two by log-sum-exp (xGR's staged
  attention; Hydragen and FlashInfer's cascade do the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_backends import AttentionBackend, plain_attention
from .kv_cache import SlabCache


def _equal_runs(values: list) -> list[tuple]:
    """Runs of equal neighbours: (index of the first, how many, the value)."""
    runs: list[tuple] = []
    for i, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, value)
        else:
            runs.append((i, 1, value))
    return runs


class PackedPrefill:
    """Prompts packed end to end: positions restart at 0 for every sequence, or at the tokens it
    found in the prefix cache (cached[i]: those are in its cache row already, and only its other
    tokens are computed: lengths[i] of them). stored: the prefix cache's blocks that each layer's
    keys of these rows also go to (prefix_cache.BlockWrites), or None."""

    __slots__ = ("backend", "lengths", "cached", "kv_lengths", "groups", "positions", "last", "cache", "first_row",
                 "last_only", "scoring", "last_kept", "cu_lengths", "masks", "stored")

    def __init__(self, backend: AttentionBackend, lengths: list[int], device: torch.device,
                 cache: SlabCache | None = None, first_row: int = 0, whole: list[bool] | None = None,
                 cached: list[int] | None = None, stored=None) -> None:
        self.backend = backend  # (attention_backends.py)
        self.lengths = lengths
        # None where no prompt found a cached prefix; else the keys each prompt's last query sees.
        self.cached = cached if cached and any(cached) else None
        self.kv_lengths = None if self.cached is None else [c + n for c, n in zip(self.cached, lengths)]
        # Runs of equal lengths and cached prefixes (start token, count, length, cached): one
        # attention call each for torch's kernels, one write of keys into the cache each.
        skips = cached or [0] * len(lengths)
        self.groups: list[tuple[int, int, int, int]] = []
        start = 0
        for _, count, (n, skip) in _equal_runs(list(zip(lengths, skips))):
            self.groups.append((start, count, n, skip))
            start += count * n
        self.positions = torch.cat([torch.arange(skip, skip + n) for n, skip in zip(lengths, skips)]).to(device)
        ends = torch.tensor(lengths).cumsum(0)
        # Where each sequence starts among the rows, for the flash kernel.
        self.cu_lengths = F.pad(ends, (1, 0)).to(device, torch.int32) if backend.needs_cu_lengths else None
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
        self.masks: dict = {}  # a backend's masks, made at the first layer and read by the others
        self.last_only = False  # set by the model for its last layer: only last tokens' outputs matter
        self.stored = stored

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] -> [tokens (or sequences), heads * dim]."""
        if self.cache is not None:  # the prompts' keys and values into their cache rows
            keys, values = self.cache.keys(layer), self.cache.values(layer)
            row, kv_heads, dim = self.first_row, k.shape[1], k.shape[2]
            for start, count, length, skip in self.groups:
                end, stop = start + count * length, skip + length
                keys[row:row + count, :, skip:stop] = k[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
                values[row:row + count, :, skip:stop] = v[start:end].view(count, length, kv_heads, dim).transpose(1, 2)
                row += count
        if self.stored is not None:
            self.stored.write(layer, k, v)
        return self.backend.prefill(self, layer, q, k, v, scale)


class Decode:
    """One token per live row of a SlabCache: its keys go to position lengths[row]."""

    __slots__ = ("backend", "cache", "positions", "rows", "runs", "reads", "slots", "mask", "sharing")

    def __init__(self, backend: AttentionBackend, cache: SlabCache) -> None:
        self.backend = backend  # (attention_backends.py)
        self.cache = cache
        self.sharing = cache.sharing  # rows that read a shared prefix's one copy (our CPU kernel)
        self.rows = cache.rows
        self.positions = cache.lengths[:self.rows].clone()
        self.reads = self.positions + 1  # keys each row reads, its new one included
        self.runs = None  # for torch's CPU kernel only, found at its first layer (length_runs)
        self.mask = None  # for one masked call (accelerators), which keys each row reads
        # Where each (row, key head)'s new key goes in a layer's slabs seen as [tokens, dim]: found
        # once for every layer (one index_copy_ a layer, faster than advanced indexing's write).
        _, kv_heads, capacity, _ = cache.keys(0).shape
        heads = torch.arange(kv_heads, device=self.positions.device)
        rows = torch.arange(self.rows, device=self.positions.device)
        self.slots = ((rows[:, None] * kv_heads + heads) * capacity + self.positions[:, None]).reshape(-1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        dim = q.shape[2]
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        keys.view(-1, dim).index_copy_(0, self.slots, k.reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, self.slots, v.reshape(-1, dim))
        return self.backend.decode(self, q, keys, values, scale)

    def native_cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """What a native decode step (csrc/small_step.cpp) needs of this step's keys: the slabs,
        where each new key goes, how many each row reads (`sharing` goes beside them); None where its
        attention is not our decode kernel (that step runs in Python)."""
        if self.backend.decode_kernel is None:
            return None
        return self.cache.slabs, self.slots, self.reads

    def length_runs(self) -> list[tuple[int, int, int]]:
        """Runs of rows of equal length (first row, count, keys to read), found once a step."""
        if self.runs is None:
            self.runs = _equal_runs(self.reads.tolist())
        return self.runs


class BeamDecode:
    """A round of beam search: `beams` rows, beams of request i are rows
    [starts[i], starts[i + 1]) and share prompt row i of the prompt cache; their
    own keys live in `own` [layers, 2, beams, kv_heads, rounds, dim] at index step."""

    __slots__ = ("backend", "prompts", "prompt_lengths", "starts", "own", "step", "positions")

    def __init__(self, backend: AttentionBackend, prompts: SlabCache, prompt_lengths: list[int], starts: list[int],
                 own: torch.Tensor, step: int, device: torch.device) -> None:
        self.backend = backend  # (attention_backends.py)
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
        own_keys, own_values = self.own[layer, 0, :beams], self.own[layer, 1, :beams]  # fewer may live than fit
        own_keys[:, :, self.step] = k
        own_values[:, :, self.step] = v
        # Stage 2 first (it is one call for every beam): each beam against its own tokens, a handful
        # a query (one per round so far), in float32 operations: torch's fused kernel's cost is per
        # (batch, head) problem, and a wide beam round makes hundreds of tiny ones.
        own_out, own_lse = plain_attention(q.view(beams, kv_heads, heads // kv_heads, dim).float(),
                                           own_keys[:, :, :self.step + 1].float(),
                                           own_values[:, :, :self.step + 1].float(), scale)
        own_out = own_out.to(q.dtype)
        # Stage 1: all beams of a request against its prompt, merged with stage 2.
        prompt_keys, prompt_values = self.prompts.keys(layer), self.prompts.values(layer)
        outs = []
        for row, (first, end) in enumerate(zip(self.starts, self.starts[1:])):
            if first == end:  # every beam of this request had one way to end (execution/beam.py)
                continue
            length = self.prompt_lengths[row]
            outs.append(self.backend.beam_prompt(q[first:end], prompt_keys[row, :, :length],
                                                 prompt_values[row, :, :length], own_out[first:end],
                                                 own_lse[first:end], scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(beams, heads * dim).to(q.dtype)
