"""A ranking request's whole forward in one (execution/score_batch.py): the prompts packed, and
after them its candidates' tokens, each attending to its prompt and to its own earlier tokens,
never to another candidate's. The tokens are given (teacher forcing), so all of them go through
the layers at once rather than a round per token; candidates that share a prefix share its rows
(the same tokens after the same prompt have the same keys and states), so the rows are a tree.

Attention of the candidate rows is staged as a beam round's (BeamDecode): stage 2, each row
against its ancestors and itself (a few keys, float32, the rows of one depth at once); stage 1,
all candidate rows of a prompt against its keys in one product (the backend's beam_prompt: our
prefix kernel on CPU), merged with stage 2 by log-sum-exp. No mask of (prompt + candidates)^2 is
ever made, and the prompt's keys are read from its cache row, where the prompt's part of the
forward (PackedPrefill, the prefix cache's tokens included) stored them the same layer.

On a CPU with our kernels, stage 2 and the merge are one kernel call over all candidate rows
(csrc/candidate_attention.cpp), after stage 1's prefix kernel: in torch operators they were a
dozen passes over the rows per depth, more time than stage 1 (1,000 items on the medium Qwen3).
"""

from __future__ import annotations

import torch

from . import cpu_kernels
from .attention_backends import plain_attention
from .forward_context import PackedPrefill


class _Level:
    """The candidate rows at one depth (their index among the candidate rows) and each one's
    ancestors, itself last ([rows, depth + 1]): the keys its stage 2 reads."""

    __slots__ = ("rows", "ancestors", "whole")

    def __init__(self, rows: list[int], ancestors: list[list[int]], device: torch.device) -> None:
        self.whole = rows == list(range(rows[0], rows[0] + len(rows)))  # a slice of the rows
        self.rows = slice(rows[0], rows[0] + len(rows)) if self.whole else torch.tensor(rows, device=device)
        self.ancestors = torch.tensor(ancestors, device=device)


class CandidatePrefill:
    """prompts: the prompts' PackedPrefill (it must keep their keys: a cache, prompt i in its row
    first_row + i); prompt_lengths: each prompt's whole length (its cached prefix included);
    trees[i]: request i's candidate rows as (tokens, parents), parents[r] the row r continues
    (-1: the prompt; a parent before its children): candidates that share a prefix share its rows.
    Their rows come after all the prompts' rows, request by request.

    The forward keeps (for logits) each prompt's last row, then every candidate row, in order."""

    __slots__ = ("prompts", "backend", "prompt_lengths", "prompt_rows", "spans", "levels", "positions", "last",
                 "scoring", "last_only", "last_kept", "kernel", "ancestors")

    def __init__(self, prompts: PackedPrefill, prompt_lengths: list[int], trees: list[tuple[list[int], list[int]]],
                 device: torch.device) -> None:
        if prompts.cache is None:
            raise ValueError("candidates read their prompt's keys from its cache row: the prompts need one")
        self.prompts = prompts
        self.backend = prompts.backend
        self.prompt_lengths = prompt_lengths
        self.prompt_rows = sum(prompts.lengths)
        self.spans: list[tuple[int, int]] = []  # each request's candidate rows [first, end), among the candidates'
        positions: list[int] = []
        chains: list[list[int]] = []  # each candidate row's ancestors, itself last
        for length, (tokens, parents) in zip(prompt_lengths, trees):
            first = len(chains)
            for row, parent in enumerate(parents):
                chains.append((chains[first + parent] if parent >= 0 else []) + [first + row])
                positions.append(length + len(chains[-1]) - 1)
            self.spans.append((first, len(chains)))
        by_depth: dict[int, list[int]] = {}
        for row, chain in enumerate(chains):
            by_depth.setdefault(len(chain), []).append(row)
        self.levels = [_Level(rows, [chains[r] for r in rows], device) for _, rows in sorted(by_depth.items())]
        # Our kernel (stage 2 and the merge at once) where stage 1 runs on our prefix kernel: each
        # row's ancestors, root first and itself last, -1 after them.
        prefix = getattr(self.backend, "prefix_kernel", None)
        self.kernel = cpu_kernels.candidate_attention() if prefix is not None and device.type == "cpu" else None
        self.ancestors = None
        if self.kernel is not None and chains:
            depth = max(len(c) for c in chains)
            self.ancestors = torch.tensor([c + [-1] * (depth - len(c)) for c in chains], dtype=torch.long)
        self.positions = torch.cat([prompts.positions, torch.tensor(positions, dtype=torch.long, device=device)])
        ends = torch.tensor(prompts.lengths).cumsum(0) - 1
        self.last = torch.cat([ends, self.prompt_rows + torch.arange(len(chains))]).to(device)
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
        keys, values = self.prompts.cache.keys(layer), self.prompts.cache.values(layer)
        if self.kernel is not None:
            return torch.cat([prompt_out, self._kernel_attend(qc, kc, vc, keys, values, scale).view(rows, -1)])
        group = heads // kc.shape[1]
        own_out, own_lse = self._own(qc, kc, vc, scale, group)
        outs = [prompt_out]
        for i, (first, end) in enumerate(self.spans):
            if first == end:
                continue
            row, length = self.prompts.first_row + i, self.prompt_lengths[i]
            outs.append(self.backend.beam_prompt(qc[first:end], keys[row, :, :length], values[row, :, :length],
                                                 own_out[first:end], own_lse[first:end], scale
                                                 ).reshape(end - first, heads * dim).to(q.dtype))
        return torch.cat(outs)

    def _kernel_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, scale: float) -> torch.Tensor:
        """Stage 1 on the prefix kernel, a request's rows at a time, then stage 2 merged with it on
        ours for all rows at once -> [rows, heads, dim]."""
        outs, sums = [], []
        for i, (first, end) in enumerate(self.spans):
            if first < end:
                row, length = self.prompts.first_row + i, self.prompt_lengths[i]
                out, lse = self.backend.prefix_kernel(q[first:end], keys[row, :, :length], values[row, :, :length],
                                                      scale)
                outs.append(out)
                sums.append(lse)
        out, lse = (outs[0], sums[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(sums))
        return self.kernel(q, k, v, self.ancestors, out, lse, scale)

    def _own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 2: each candidate row against its ancestors' keys and its own, a depth at a time (in
        float32, as a beam round's) -> [rows, kv_heads, group, dim] in q's dtype and the log-sum-exps
        [rows, kv_heads, group, 1] (float32)."""
        rows, heads, dim = q.shape
        kv_heads, dtype = k.shape[1], q.dtype
        q, k, v = q.float().view(rows, kv_heads, group, dim), k.float(), v.float()  # (once for every depth)
        if len(self.levels) == 1:
            level = self.levels[0]
            out, lse = plain_attention(q, k[level.ancestors].transpose(1, 2), v[level.ancestors].transpose(1, 2), scale)
            return out.to(dtype), lse
        out = torch.empty(rows, kv_heads, group, dim, dtype=dtype, device=q.device)
        lse = torch.empty(rows, kv_heads, group, 1, dtype=torch.float32, device=q.device)
        for level in self.levels:
            o, s = plain_attention(q[level.rows], k[level.ancestors].transpose(1, 2),
                                   v[level.ancestors].transpose(1, 2), scale)
            out[level.rows] = o.to(dtype)
            lse[level.rows] = s
        return out, lse
