"""What one score request's packed forward feeds and what the LM head reads of it (ScoreBatch on a
runner that packs_candidates): its candidates' tokens as a tree of rows (runner.score_prefill),
candidates that share a prefix sharing its rows, and the reads each score needs.

A token read at depth d takes the row of the candidate's first d tokens (the prompt's last row at
depth 0). An item of the table (its trie) needs no read where its prefix allows one token only:
that token's log-probability, normalised over the allowed tokens, is exactly 0 (the constrained
beam search skips those rounds alike: BeamSearchBatch._forced), so a candidate feeds its tokens
up to its last depth that has a choice only. With semantic ids most items' last code is the only
one their prefix allows.
"""

from __future__ import annotations

import numpy as np
import torch


def table_logprobs(runner, hidden: torch.Tensor, vocab: torch.Tensor, allowed: torch.Tensor,
                   rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Each (rows[e], columns[e])'s log-probability over the tokens allowed[row] lets that row take:
    the LM head over the depth's vocabulary only, the others masked, the log-sum-exp in float32, as
    the constrained beam search normalises (BeamSearchBatch._table_tops), so that a candidate's
    score equals its beam's cumulative_logprob. hidden: one row per distinct node."""
    logits = runner.logits(hidden, vocab, as_float=False)
    logits.masked_fill_(~allowed, float("-inf"))
    lse = torch.logsumexp(logits.float(), dim=-1)
    rows, columns = rows.to(logits.device), columns.to(logits.device)
    return logits[rows, columns].float() - lse[rows]


class TableWalk:
    """Item candidates' paths down their trie, found before the forward: per depth, the distinct
    nodes they are at (`nodes`, each candidate's among them `inverse`), those nodes' allowed tokens
    (`expansion`), each candidate's token as a column of the depth's vocabulary (`columns`), and
    whether its node has a choice there (`chosen`)."""

    __slots__ = ("trie", "depths", "fed")

    def __init__(self, trie, candidates: list[list[int]]) -> None:
        self.trie = trie
        tokens = np.asarray(candidates, dtype=np.int64)  # (items of one table: one length)
        count, length = tokens.shape
        nodes = np.zeros(count, dtype=np.int64)
        self.depths = []
        chosen = np.zeros((count, length), dtype=bool)
        for depth in range(length):
            distinct, inverse = np.unique(nodes, return_inverse=True)
            expansion = trie.expand(depth, distinct)
            columns = np.searchsorted(trie.vocab[depth].cpu().numpy(), tokens[:, depth])
            chosen[:, depth] = expansion.counts[inverse] > 1
            self.depths.append((inverse, expansion, columns, chosen[:, depth].copy()))
            nodes = expansion.child[inverse, columns]
        # Tokens each candidate feeds: up to its last depth with a choice (that read takes the row of
        # the tokens before it), none where it never has one.
        last = length - 1 - np.argmax(chosen[:, ::-1], axis=1)
        self.fed = np.where(chosen.any(axis=1), last, 0).tolist()

    def score(self, runner, hidden: torch.Tensor, rows: list[list[int]], prompt_row: int, first_row: int,
              scores: torch.Tensor) -> None:
        """Add each candidate's log-probability at every depth where it has a choice to `scores`: the
        LM head over the depth's tokens at one row per distinct node (table_logprobs).
        rows[j]: candidate j's rows (its tokens' rows among the request's, from first_row on)."""
        device = scores.device
        for depth, (inverse, expansion, columns, chosen) in enumerate(self.depths):
            wanted = np.flatnonzero(chosen)
            if not wanted.size:
                continue
            nodes, first = np.unique(inverse[wanted], return_index=True)  # one candidate per node read
            at = [prompt_row if depth == 0 else first_row + rows[j][depth - 1] for j in wanted[first]]
            allowed = expansion.mask[torch.from_numpy(nodes).to(expansion.mask.device)]
            values = table_logprobs(runner, hidden[torch.tensor(at, device=hidden.device)], self.trie.vocab[depth],
                                    allowed, torch.from_numpy(np.searchsorted(nodes, inverse[wanted])),
                                    torch.from_numpy(columns[wanted]))
            scores.index_add_(0, torch.from_numpy(wanted).to(device), values.to(device))


class CandidatePlan:
    """One request's rows (tokens, parents: runner.score_prefill's tree), each candidate's rows
    (`paths`), and either its TableWalk (item candidates) or its whole-vocabulary reads
    (depth, row among its rows or -1 for the prompt's last, the candidates read there)."""

    __slots__ = ("tokens", "parents", "paths", "walk", "reads")

    def __init__(self, request) -> None:
        candidates = request.candidates
        self.walk = TableWalk(request.trie, candidates) if request.trie is not None and request.labels is None \
            else None
        fed = self.walk.fed if self.walk is not None else [request.fed(c) for c in candidates]
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.paths: list[list[int]] = []
        rows: dict[tuple[int, ...], int] = {}
        for candidate, count in zip(candidates, fed):
            path, parent = [], -1
            for depth in range(count):
                prefix = tuple(candidate[:depth + 1])
                row = rows.get(prefix)
                if row is None:
                    row = rows[prefix] = len(self.tokens)
                    self.tokens.append(candidate[depth])
                    self.parents.append(parent)
                path.append(row)
                parent = row
            self.paths.append(path)
        self.reads: list[tuple[int, int, list[int]]] = []
        if self.walk is None:
            by_read: dict[tuple[int, int], list[int]] = {}
            for j, (candidate, path) in enumerate(zip(candidates, self.paths)):
                depths = [len(candidate)] if request.labels is not None else range(len(candidate))
                for depth in depths:
                    by_read.setdefault((depth, path[depth - 1] if depth else -1), []).append(j)
            self.reads = sorted(((depth, row, js) for (depth, row), js in by_read.items()), key=lambda r: r[0])
