"""A ranking request's whole forward in one (execution/score_batch.py): the prompts packed, and
after them every candidate's tokens, each candidate attending to its prompt and causally to its
own earlier tokens, never to another candidate. The candidates' tokens are given (teacher
forcing), so all of them go through the layers at once rather than a round per token.

Attention of the candidate rows is staged as a beam round's (BeamDecode): stage 2, each candidate
against its own tokens (a small causal product, float32, candidates of one length at once);
stage 1, all candidate rows of a prompt against its keys in one product (the backend's
beam_prompt: our prefix kernel on CPU), merged with stage 2 by log-sum-exp. No mask of
(prompt + candidates)^2 is ever made, and the prompt's keys are read from its cache row, where
the prompt's part of the forward (PackedPrefill, the prefix cache's tokens included) stored them
the same layer.
"""

from __future__ import annotations

import torch

from .attention_backends import plain_attention
from .forward_context import PackedPrefill


class _Run:
    """Candidates of one fed length: their rows (None: all candidate rows, in order) and the causal
    mask of their queries, as stage 2 lays them out (token-major, the heads of a key head within)."""

    __slots__ = ("length", "count", "rows", "masks")

    def __init__(self, length: int, rows: list[int], whole: bool, device: torch.device) -> None:
        self.length = length
        self.count = len(rows) // length
        self.rows = None if whole else torch.tensor(rows, device=device)
        self.masks: dict[int, torch.Tensor] = {}  # by query heads a key head

    def mask(self, group: int, device: torch.device) -> torch.Tensor:
        mask = self.masks.get(group)
        if mask is None:
            token = torch.arange(self.length * group, device=device) // group
            mask = self.masks[group] = torch.arange(self.length, device=device)[None, :] <= token[:, None]
        return mask


class CandidatePrefill:
    """prompts: the prompts' PackedPrefill (it must keep their keys: a cache, prompt i in its row
    first_row + i); prompt_lengths: each prompt's whole length (its cached prefix included);
    fed[i]: the number of tokens of each of request i's candidates that are fed (each > 0), their
    rows after all the prompts' rows, request by request, candidate by candidate.

    The forward keeps (for logits) each prompt's last row, then every candidate row, in order."""

    __slots__ = ("prompts", "backend", "prompt_lengths", "prompt_rows", "spans", "runs", "positions", "last", "scoring",
                 "last_only", "last_kept")

    def __init__(self, prompts: PackedPrefill, prompt_lengths: list[int], fed: list[list[int]],
                 device: torch.device) -> None:
        if prompts.cache is None:
            raise ValueError("candidates read their prompt's keys from its cache row: the prompts need one")
        self.prompts = prompts
        self.backend = prompts.backend
        self.prompt_lengths = prompt_lengths
        self.prompt_rows = sum(prompts.lengths)
        self.spans: list[tuple[int, int]] = []  # each request's candidate rows [first, end), among the candidates'
        positions, by_length = [], {}
        row = 0
        for length, counts in zip(prompt_lengths, fed):
            first = row
            for count in counts:
                by_length.setdefault(count, []).extend(range(row, row + count))
                positions.extend(range(length, length + count))
                row += count
            self.spans.append((first, row))
        self.runs = [_Run(n, rows, len(by_length) == 1, device) for n, rows in sorted(by_length.items())]
        self.positions = torch.cat([prompts.positions, torch.tensor(positions, dtype=torch.long, device=device)])
        ends = torch.tensor(prompts.lengths).cumsum(0) - 1
        self.last = torch.cat([ends, self.prompt_rows + torch.arange(row)]).to(device)
        self.scoring = True  # attention for every row; the model keeps `last`'s
        self.last_only = False
        self.last_kept = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        n = self.prompt_rows
        prompt_out = self.prompts.attend(layer, q[:n], k[:n], v[:n], scale)
        qc, kc, vc = q[n:], k[n:], v[n:]
        rows, heads, dim = qc.shape
        if not rows:
            return prompt_out
        kv_heads = kc.shape[1]
        group = heads // kv_heads
        own_out, own_lse = self._own(qc, kc, vc, scale, group)
        keys, values = self.prompts.cache.keys(layer), self.prompts.cache.values(layer)
        outs = [prompt_out]
        for i, (first, end) in enumerate(self.spans):
            if first == end:
                continue
            row, length = self.prompts.first_row + i, self.prompt_lengths[i]
            outs.append(self.backend.beam_prompt(qc[first:end], keys[row, :, :length], values[row, :, :length],
                                                 own_out[first:end], own_lse[first:end], scale
                                                 ).reshape(end - first, heads * dim).to(q.dtype))
        return torch.cat(outs)

    def _own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 2: each candidate row against its candidate's tokens up to itself -> [rows, kv_heads,
        group, dim] in q's dtype and their log-sum-exps [rows, kv_heads, group, 1] (float32)."""
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        out = lse = None
        if len(self.runs) > 1:
            out = torch.empty(rows, kv_heads, group, dim, dtype=q.dtype, device=q.device)
            lse = torch.empty(rows, kv_heads, group, 1, dtype=torch.float32, device=q.device)
        for run in self.runs:
            n, count = run.length, run.count
            qr, kr, vr = (q, k, v) if run.rows is None else (q[run.rows], k[run.rows], v[run.rows])
            qr = qr.view(count, n, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(count, kv_heads, n * group, dim)
            kr = kr.view(count, n, kv_heads, dim).transpose(1, 2)
            vr = vr.view(count, n, kv_heads, dim).transpose(1, 2)
            o, s = plain_attention(qr.float(), kr.float(), vr.float(), scale, run.mask(group, q.device))
            o = o.view(count, kv_heads, n, group, dim).transpose(1, 2).reshape(count * n, kv_heads, group, dim)
            s = s.view(count, kv_heads, n, group, 1).transpose(1, 2).reshape(count * n, kv_heads, group, 1)
            if out is None:
                return o.to(q.dtype), s
            out[run.rows] = o.to(q.dtype)
            lse[run.rows] = s
        return out, lse
