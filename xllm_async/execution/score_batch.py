"""Ranking: candidates scored against one copy of their history.

A score request (engine/score_request.py) is a prompt and the candidates that continue it. On our
runner (packs_candidates) the prompt and all its candidates' tokens are one forward
(Runner.score_prefill, the rows planned by candidate_plan.py): the prompt's keys stored once (the
prefix cache serving it where on), each candidate attending to that one copy plus its own earlier
tokens (staged attention, model/candidate_prefill.py), never to another. On a runner that does not
pack them the prompt is prefilled once (Runner.beam_prefill) and each round feeds every candidate
that has one its next token as a beam whose parent is fixed (Runner.beam_decode, BeamDecode's
staged attention). The final hidden state of every row a score needs goes through the LM head:
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
from .beam import LOGITS_BLOCK_COLUMNS, SharedPromptBatch
from .candidate_plan import CandidatePlan, table_logprobs

# Rows whose log-probabilities over the whole vocabulary are taken at once (ScoreBatch._logprobs:
# their logits held a block of LOGITS_BLOCK_COLUMNS at a time, 1,024 x 16,384 bfloat16 is 32 MB).
VOCAB_ROWS = 1024


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


def _runs(reads: list[_Read]) -> list[tuple[_Group, list[_Read]]]:
    """The reads as runs of one group's consecutive reads."""
    runs: list[tuple[_Group, list[_Read]]] = []
    for read in reads:
        if runs and runs[-1][0] is read.group:
            runs[-1][1].append(read)
        else:
            runs.append((read.group, [read]))
    return runs


class ScoreBatch(SharedPromptBatch):
    """Score requests that step together on one execution thread, each request answered once all
    its candidates are scored."""

    __slots__ = ()

    def prefill(self) -> list:
        if self.runner.packs_candidates:
            return self._prefill_packed()
        hidden, recorded = self._prefill_prompts([r.own_rows for r in self.requests],
                                                 max(r.feeds for r in self.requests) + 1, _Group)
        reads = [_Read(i, g, list(range(len(g.fed))), 0) for i, g in enumerate(self.groups)]
        self._vocab_scores(hidden, self._score(hidden, reads))
        recorded()
        return self._finish_done()

    def _prefill_packed(self) -> list:
        """Every request's prompt and its candidates' rows in one forward (the runner's
        score_prefill, the rows planned by CandidatePlan): its hidden rows are each prompt's last,
        then each request's candidate rows. The whole-vocabulary reads of all requests are taken
        at once (the LM head's weight read once for them all)."""
        plans = [CandidatePlan(r) for r in self.requests]
        hidden, recorded = self._prefill_prompts([], 0, _Group, [(p.tokens, p.parents) for p in plans])
        first = len(plans)
        whole: list[_Read] = []
        for i, (g, plan) in enumerate(zip(self.groups, plans)):
            if plan.walk is not None:
                plan.walk.score(self.runner, hidden, plan.paths, i, first, g.scores)
            whole += [_Read(i if row < 0 else first + row, g, js, depth) for depth, row, js in plan.reads]
            first += len(plan.tokens)
            g.rounds = g.request.feeds
        self._vocab_scores(hidden, whole)
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
        self._vocab_scores(hidden, self._score(hidden, reads))
        if self._metrics is not None:
            self._metrics.batch_decoded(time.monotonic() - started, len(tokens))
        return self._finish_done()

    # --- scores of the rows a forward computed ---

    def _score(self, hidden: torch.Tensor, reads: list[_Read]) -> list[_Read]:
        """Take what each read of one depth asks of its hidden row: a token's log-probability (added
        to its candidate's score) or the labels' log-probabilities after a candidate's last token.
        Item candidates are scored here; the reads over the whole vocabulary are returned, for
        _vocab_scores."""
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
        for group in by_trie.values():
            self._table_scores(hidden, group)
        return whole

    def _vocab_scores(self, hidden: torch.Tensor, reads: list[_Read]) -> None:
        """Over the whole vocabulary: each read's tokens' (or labels') logits less its row's
        log-sum-exp, VOCAB_ROWS reads at a time."""
        for start in range(0, len(reads), VOCAB_ROWS):
            part = reads[start:start + VOCAB_ROWS]
            at, targets = [], []
            for k, read in enumerate(part):
                req = read.group.request
                wanted = req.labels if req.labels is not None else [req.candidates[j][read.depth]
                                                                    for j in read.candidates]
                at += [k] * len(wanted)
                targets += wanted
            rows = torch.tensor([r.row for r in part], device=hidden.device)
            values = self._logprobs(hidden[rows], at, targets)
            first = 0
            for group, entries in _runs(part):
                req = group.request
                if req.labels is not None:
                    for read in entries:
                        found = values[first:first + len(req.labels)].tolist()
                        first += len(req.labels)
                        for j in read.candidates:
                            req.results[j] = found
                    continue
                js = [j for read in entries for j in read.candidates]
                group.scores.index_add_(0, torch.tensor(js, device=values.device), values[first:first + len(js)])
                first += len(js)

    def _logprobs(self, hidden: torch.Tensor, at: list[int], targets: list[int]) -> torch.Tensor:
        """Each (row at[e], token targets[e])'s log-probability over the whole vocabulary (float32).

        The vocabulary in blocks of LOGITS_BLOCK_COLUMNS (as a beam round without a table walks
        it): each block's logits give every row's log-sum-exp over the block and the targets that
        fall in it, then are dropped; so the LM head's weight is read once for all the rows, and
        no rows x vocabulary tensor is ever held."""
        device = hidden.device
        at_t = torch.tensor(at, device=device)
        target_t = torch.tensor(targets, device=device)
        block_of = target_t // LOGITS_BLOCK_COLUMNS
        chosen = torch.empty(len(targets), dtype=torch.float32, device=device)
        sums = []
        fused = self.runner.topk_logsumexp()
        vocab_size = self.runner.vocab_size
        for block, start in enumerate(range(0, vocab_size, LOGITS_BLOCK_COLUMNS)):
            end = min(vocab_size, start + LOGITS_BLOCK_COLUMNS)
            logits = self.runner.logits(hidden, as_float=False, columns=(start, end))
            # (bfloat16 logits on our kernel: their log-sum-exp without a float32 copy of them)
            sums.append(fused(logits, 1)[2] if fused is not None else torch.logsumexp(logits.float(), dim=-1))
            inside = (block_of == block).nonzero()[:, 0]
            if inside.numel():
                chosen[inside] = logits[at_t[inside], target_t[inside] - start].float()
        lse = sums[0] if len(sums) == 1 else torch.logsumexp(torch.stack(sums, dim=1), dim=1)
        return chosen - lse[at_t]

    def _table_scores(self, hidden: torch.Tensor, reads: list[_Read]) -> None:
        """Item candidates of one table at one depth: each token's log-probability over the tokens
        the trie allows after the candidate's prefix, as the constrained beam search computes it
        (candidate_plan.table_logprobs)."""
        trie = reads[0].group.request.trie
        depth = reads[0].depth
        vocab = trie.vocab[depth]
        # Each row's node: a decode row serves one candidate; the prompt's row, at the root, all of its own.
        nodes = np.array([r.group.nodes[r.candidates[0]] for r in reads], dtype=np.int64)
        expansion = trie.expand(depth, nodes)
        rows = torch.tensor([r.row for r in reads], device=hidden.device)
        at, candidates, runs = _entries(reads)
        targets = [t for group, first, end in runs
                   for t in (group.request.candidates[j][depth] for j in candidates[first:end])]
        columns = torch.searchsorted(vocab, torch.tensor(targets, device=vocab.device))
        values = table_logprobs(self.runner, hidden[rows], vocab, expansion.mask, torch.tensor(at), columns)
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
