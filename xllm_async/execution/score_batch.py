"""Ranking: candidates scored against one copy of their history, on the beam search's machinery.

A score request (engine/score_request.py) is a prompt and the candidates that continue it. The
prompt is prefilled once (Runner.beam_prefill: its keys and values stored once, the prefix cache
serving it where on); then each round feeds every candidate that has one its next token as a
beam whose parent is fixed (Runner.beam_decode): the candidates attend to the one copy of the
prompt plus their own tokens (staged attention, model/attention.py's BeamDecode), never to each
other. The final hidden state of every row a score needs goes through the LM head:
- an item candidate (the request has the item table's trie): its token at depth d, normalised
  over the tokens the trie allows after its prefix, exactly as BeamSearchBatch._table_tops
  normalises (the same LM head columns, mask and float32 sums), so a beam's cumulative_logprob
  and the candidate's score agree;
- a token candidate: its tokens' log-probabilities over the whole vocabulary, summed;
- with labels: the labels' log-probabilities after the candidate's last token.
Requests of one batch share every forward, as beam requests do; a batch never takes joiners.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..engine.request import Delta
from ..engine.score_request import ScoreRequest
from .beam import SharedPromptBatch

# Rows whose whole-vocabulary logits are held at once (a row of 151,936 float32 logits is 0.6 MB).
VOCAB_ROWS = 32


class _Group:
    """One request's candidates as they are fed."""

    __slots__ = ("request", "fed", "last", "rounds", "scores", "nodes")

    def __init__(self, request: ScoreRequest, device) -> None:
        self.request = request
        self.fed = [request.fed(c) for c in request.candidates]  # tokens each candidate feeds
        self.last: list[int] = []  # the candidates fed in the last round, in row order (none: the prompt's row)
        self.rounds = 0  # decode rounds run
        self.scores = torch.zeros(len(request.candidates), dtype=torch.float32, device=device)
        self.nodes = np.zeros(len(request.candidates), dtype=np.int64)  # with a trie: each candidate's node
        request.results = [None] * len(request.candidates)


class _Read:
    """One hidden row's scores to take: the row, its group, the candidates it serves, their depth."""

    __slots__ = ("row", "group", "candidates", "depth")

    def __init__(self, row: int, group: _Group, candidates: list[int], depth: int) -> None:
        self.row = row
        self.group = group
        self.candidates = candidates
        self.depth = depth


def _entries(reads: list[_Read]) -> tuple[list[int], list[int], list[tuple[_Group, int, int]]]:
    """The reads flattened, one entry a candidate: each entry's read (its row among the reads'),
    its candidate, and each group's run of entries (group, first, end): a group's reads are
    consecutive, as rounds lay out their rows."""
    at: list[int] = []
    candidates: list[int] = []
    runs: list[tuple[_Group, int, int]] = []
    for k, read in enumerate(reads):
        first = len(candidates)
        at.extend([k] * len(read.candidates))
        candidates.extend(read.candidates)
        if runs and runs[-1][0] is read.group:
            runs[-1] = (read.group, runs[-1][1], len(candidates))
        else:
            runs.append((read.group, first, len(candidates)))
    return at, candidates, runs


class ScoreBatch(SharedPromptBatch):
    """Score requests that step together on one execution thread, each request answered once all
    its candidates are scored."""

    __slots__ = ()

    def prefill(self) -> list:
        hidden, recorded = self._prefill_prompts([r.own_rows for r in self.requests],
                                                 max(r.feeds for r in self.requests) + 1, _Group)
        self._score(hidden, [_Read(i, g, list(range(len(g.fed))), 0) for i, g in enumerate(self.groups)])
        recorded()
        return self._finish_done()

    def decode(self) -> list:
        if not self._drop_aborted():
            return []
        started = time.monotonic()
        starts = self.state.starts
        tokens, parents, widths, reads = [], [], [], []
        for i, g in enumerate(self.groups):
            step = g.rounds
            before = g.last if step else range(len(g.fed))
            feeding = [j for j in before if g.fed[j] > step]
            where = {j: k for k, j in enumerate(g.last)}
            for j in feeding:
                reads.append(_Read(len(tokens), g, [j], step + 1))
                tokens.append(g.request.candidates[j][step])
                parents.append(starts[i] + (where[j] if step else 0))
            widths.append(len(feeding))
            g.last = feeding
            g.rounds += 1
        hidden = self.runner.beam_decode(self.state, tokens, parents, widths, between_layers=self.between_layers)
        self._score(hidden, reads)
        if self._metrics is not None:
            self._metrics.batch_decoded(time.monotonic() - started, len(tokens))
        return self._finish_done()

    # --- scores of the rows a round computed ---

    def _score(self, hidden: torch.Tensor, reads: list[_Read]) -> None:
        """Take what each read asks of its hidden row: a token's log-probability (added to its
        candidate's score) or the labels' log-probabilities after a candidate's last token."""
        wanted = []
        for read in reads:
            req = read.group.request
            if req.labels is not None:
                done = [j for j in read.candidates if len(req.candidates[j]) == read.depth]
            else:
                done = [j for j in read.candidates if read.depth < len(req.candidates[j])]
            if done:
                read.candidates = done
                wanted.append(read)
        by_trie: dict[int, list[_Read]] = {}
        whole = []
        for read in wanted:
            trie = read.group.request.trie
            if trie is not None and read.group.request.labels is None:
                by_trie.setdefault(id(trie), []).append(read)
            else:
                whole.append(read)
        for start in range(0, len(whole), VOCAB_ROWS):
            self._vocab_scores(hidden, whole[start:start + VOCAB_ROWS])
        for group in by_trie.values():
            self._table_scores(hidden, group)

    def _vocab_scores(self, hidden: torch.Tensor, reads: list[_Read]) -> None:
        """Over the whole vocabulary: each read's tokens' logits less its row's log-sum-exp (float32)."""
        rows = torch.tensor([r.row for r in reads], device=hidden.device)
        logits = self.runner.logits(hidden[rows], as_float=False)
        fused = self.runner.topk_logsumexp()
        # (bfloat16 logits on our kernel: their log-sum-exp without a float32 copy of them)
        lse = fused(logits, 1)[2] if fused is not None else torch.logsumexp(logits.float(), dim=-1)
        depth = reads[0].depth
        at, candidates, runs = _entries(reads)
        at = torch.tensor(at, device=logits.device)
        for group, first, end in runs:  # (a group's candidates at once, never one at a time)
            req, ks, js = group.request, at[first:end], candidates[first:end]
            if req.labels is not None:
                values = (logits[ks][:, req.labels].float() - lse[ks, None]).tolist()
                for j, value in zip(js, values):
                    req.results[j] = value
                continue
            targets = torch.tensor([req.candidates[j][depth] for j in js], device=logits.device)
            group.scores.index_add_(0, torch.tensor(js, device=logits.device),
                                    logits[ks, targets].float() - lse[ks])

    def _table_scores(self, hidden: torch.Tensor, reads: list[_Read]) -> None:
        """Item candidates of one table at one depth: each token's log-probability over the tokens
        the trie allows after the candidate's prefix, as the constrained beam search computes it
        (the LM head over the depth's tokens, the others masked, log-sum-exp in float32)."""
        trie = reads[0].group.request.trie
        depth = reads[0].depth
        vocab = trie.vocab[depth]
        # Each row's node: a decode row serves one candidate; the prompt's row, at the root, all of its own.
        nodes = np.array([r.group.nodes[r.candidates[0]] for r in reads], dtype=np.int64)
        expansion = trie.expand(depth, nodes)
        rows = torch.tensor([r.row for r in reads], device=hidden.device)
        logits = self.runner.logits(hidden[rows], vocab, as_float=False)
        logits.masked_fill_(~expansion.mask, float("-inf"))
        lse = torch.logsumexp(logits.float(), dim=-1)
        at, candidates, runs = _entries(reads)
        targets = [t for group, first, end in runs
                   for t in (group.request.candidates[j][depth] for j in candidates[first:end])]
        columns = torch.searchsorted(vocab, torch.tensor(targets, device=vocab.device))
        ks = torch.tensor(at, device=logits.device)
        values = logits[ks, columns].float() - lse[ks]
        children = expansion.child[np.asarray(at), columns.cpu().numpy()]
        for group, first, end in runs:
            js = candidates[first:end]
            group.scores.index_add_(0, torch.tensor(js, device=values.device), values[first:end])
            group.nodes[js] = children[first:end]

    # --- the end of a request ---

    def _finish_done(self) -> list:
        done = [g for g in self.groups if g.rounds >= g.request.feeds]
        if not done:
            return []
        items = []
        for g in done:
            req = g.request
            if req.labels is None:
                req.results = g.scores.tolist()
            req.finish_reason = "stop"
            items.append((req, Delta(req.index, "", None, None, "stop")))
        self._keep([g for g in self.groups if g.rounds < g.request.feeds])
        return items
