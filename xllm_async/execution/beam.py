"""Beam search for generative recommendation: a short item id (a few tokens)
found by a wide beam, every request running exactly its number of rounds.

A beam request prefills its prompt once and keeps that cache once; its beams keep only their own
tokens (the runner's beam calls, model/forward_context.py's BeamDecode). Each round: final hidden states
-> logits -> log-probabilities -> the best beam_width (beam, token) continuations by cumulative
log-probability -> the beams' own caches follow their parents. EOS is an ordinary token here: item ids
have a fixed length, so every request runs its rounds to the end.

With an item table (execution/item_trie.py) every beam may only continue with a token
that keeps it on an item's path: the LM head is computed for the tokens that occur at
that depth only, the others masked, and log-probabilities are normalised over the
allowed tokens (the model's distribution given that the answer is an item; transformers'
generate with prefix_allowed_tokens_fn and renormalize_logits=True computes the same).
In the last round a beam whose prefix has one way to end is not fed at all (_forced).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ..engine.request import BeamRequest, Delta
from .batch import Batch
from .prepare import admitted_prefixes
from .runner import Runner

# Vocabulary columns a beam round without an item table takes at a time (BeamSearchBatch._row_tops).
# A fixed width, never one derived from the batch's rows: a beam's scores must not depend on which
# other requests share its batch.
LOGITS_BLOCK_COLUMNS = 16384


class BeamResult:
    """One final sequence of a beam search."""

    __slots__ = ("token_ids", "text", "cumulative_logprob", "leaf")

    def __init__(self, token_ids: list[int], text: str, cumulative_logprob: float, leaf: int | None = None) -> None:
        self.token_ids = token_ids
        self.text = text
        self.cumulative_logprob = cumulative_logprob
        self.leaf = leaf  # with an item table: the tuple's number in its trie (which items it names)


class _Group:
    """The live beams of one request."""

    __slots__ = ("request", "tokens", "scores", "parents", "nodes", "round")

    def __init__(self, request: BeamRequest, device) -> None:
        self.request = request
        self.tokens: list[list[int]] = [[]]  # one token list per live beam; before round one, the prompt alone
        self.scores = torch.zeros(1, device=device)  # [live beams] cumulative log-probabilities
        self.parents: list[int] = []  # for each live beam, the row it continues among the last rows fed
        self.nodes = np.zeros(1, dtype=np.int64)  # each beam's trie node (the root before round one)
        self.round = 0

    @property
    def trie(self):
        """Its request's item table trie, or None."""
        return self.request.trie


class SharedPromptBatch(Batch):
    """Requests whose prompts are prefilled once each and whose rows then feed a few tokens of their
    own against that one copy (the runner's beam calls): beam searches, and scored candidates
    (score_batch.py). What both do alike: the prompts' prefill, dropping aborted requests, keeping
    a subset of groups with their caches. Takes no joiners."""

    __slots__ = ("runner", "requests", "groups", "state", "between_layers", "_metrics")

    def __init__(self, runner: Runner, requests: list, metrics=None,
                 between_layers: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.requests = requests
        self.groups: list = []
        self.state = None
        self.between_layers = between_layers  # handed to every forward (StepLoop.run's cores)
        self._metrics = metrics

    def __len__(self) -> int:
        return len(self.groups)

    def _prefill_prompts(self, widths: list[int], rounds: int, group: Callable, candidates: list | None = None):
        """Each request's prompt once (found in the prefix cache where it can be); its group made by
        group(request, device). Returns the prompts' hidden states and a callable that records the
        prefill in the metrics (called once the caller has handled the hidden states).
        candidates: given tokens fed in the same forward (runner.score_prefill), none kept after it."""
        started = time.monotonic()
        for req in self.requests:
            req.started = started
        prompts = [r.prompt_ids for r in self.requests]
        with admitted_prefixes(self.runner, self.requests) as hits:
            if candidates is not None:
                out = self.runner.score_prefill(prompts, candidates, between_layers=self.between_layers, hits=hits)
            else:
                out = self.runner.beam_prefill(prompts, widths, rounds, between_layers=self.between_layers,
                                               hits=hits)
        self.state, hidden = out.state, out.hidden
        if out.cached is not None:  # (each prompt's tokens found in the prefix cache)
            for req, tokens in zip(self.requests, out.cached):
                req.cached_tokens = tokens
        self.groups = [group(req, hidden.device) for req in self.requests]

        def recorded() -> None:
            if self._metrics is not None:
                self._metrics.batch_prefilled(time.monotonic() - started, prompts, len(prompts), out.cached)

        return hidden, recorded

    def _drop_aborted(self) -> bool:
        """Before a step: leave out the requests whose clients are gone; whether any group is left."""
        if any(g.request.aborted for g in self.groups):
            self._keep([g for g in self.groups if not g.request.aborted])
        return bool(self.groups)

    def _keep(self, groups: list) -> None:
        """Keep these groups (a subset, in order) and their caches."""
        keep = {id(g) for g in groups}
        indices = [i for i, g in enumerate(self.groups) if id(g) in keep]
        self.groups = groups
        if groups and self.state is not None:
            self.state.keep(indices)


class BeamSearchBatch(SharedPromptBatch):
    """Beam requests that step together on one execution thread (beam searches never join),
    deltas only at the end."""

    __slots__ = ()

    def prefill(self) -> list:
        hidden, recorded = self._prefill_prompts([r.beam_width for r in self.requests],
                                                 max(r.rounds for r in self.requests), _Group)
        self._choose(hidden)
        recorded()
        return self._finish_done()

    def decode(self) -> list:
        if not self._drop_aborted():
            return []
        started = time.monotonic()
        last = [beam[-1] for g in self.groups for beam in g.tokens]
        starts = self.state.starts
        parents = [starts[i] + p for i, g in enumerate(self.groups) for p in g.parents]
        widths = [len(g.tokens) for g in self.groups]
        expansions = self._expand()
        forced = self._forced(expansions)
        if forced is not None:  # only the beams that still choose are fed
            fed = [not f for f in forced]
            last = [t for t, f in zip(last, fed) if f]
            parents = [p for p, f in zip(parents, fed) if f]
            bounds = self._row_starts()
            widths = [sum(fed[a:b]) for a, b in zip(bounds, bounds[1:])]
        hidden = self.runner.beam_decode(self.state, last, parents, widths,
                                         between_layers=self.between_layers) if last else None
        self._choose(hidden, forced, expansions)
        if self._metrics is not None:
            self._metrics.batch_decoded(time.monotonic() - started, len(last))
        return self._finish_done()

    def _expand(self) -> list | None:
        """With an item table: each group's allowed continuations this round (trie.expand)."""
        if self.groups[0].trie is None:
            return None
        return [g.trie.expand(g.round, g.nodes, g.request.leaves) for g in self.groups]

    def _forced(self, expansions: list | None) -> list[bool] | None:
        """In the last round with an item table: for each beam, whether its prefix has one way
        to end (True), or None if no beam is so.

        Such a beam needs no forward: its log-probability renormalised over the allowed tokens is
        0, and no later round reads the keys its last token would store. SGLang's jump-forward
        decoding skips forced tokens the same way. Semantic ids make this the common case: 5,000
        items of 3 codes of 256 leave almost every 2-code prefix one item."""
        if expansions is None or any(g.round + 1 < g.request.rounds for g in self.groups):
            return None
        forced = np.concatenate([e.counts == 1 for e in expansions]).tolist()
        return forced if any(forced) else None

    def _row_starts(self) -> list[int]:
        starts = [0]
        for g in self.groups:
            starts.append(starts[-1] + len(g.tokens))
        return starts

    def _choose(self, hidden: torch.Tensor | None, forced: list[bool] | None = None,
                expansions: list | None = None) -> None:
        """hidden: a row per live beam of every group, in order (only the beams not forced, if
        `forced` is given) -> each group's next beams."""
        rows = [len(g.tokens) for g in self.groups]
        widths = [g.request.beam_width for g in self.groups]
        starts = self._row_starts()
        if self.groups[0].trie is None:
            # Row spans ranked together, each with its own k: all rows at once when every group
            # has the same width, else a span per group. A row's top-k then never depends on which
            # other requests share the batch (torch.topk may break ties differently for another k).
            if len(set(widths)) == 1:
                spans = [(0, starts[-1], widths[0])]
            else:
                spans = [(starts[i], starts[i + 1], widths[i]) for i in range(len(self.groups))]
            found = self._span_tops(hidden, spans)
            tops = []
            for i in range(len(self.groups)):
                span = 0 if len(spans) == 1 else i
                first = starts[i] - spans[span][0]
                tops.append(tuple(t[first:first + rows[i]] for t in found[span]))
        else:
            expansions = expansions if expansions is not None else self._expand()
            tops = self._table_tops(hidden, expansions, forced)
        for i, g in enumerate(self.groups):
            top_scores, top_columns = tops[i]
            width = widths[i]
            # The best `width` continuations of a group are among each beam's own best `width`
            # tokens: rank those (rows x width), never the whole rows x vocabulary.
            each = top_scores.shape[1]
            candidates = (g.scores[:, None] + top_scores).flatten()
            scores, flat = candidates.topk(min(width, candidates.numel()))
            if g.trie is not None:  # a table may offer fewer paths than beams: drop the impossible ones
                finite = scores > float("-inf")
                scores, flat = scores[finite], flat[finite]
            beams = (flat // each).tolist()
            columns = top_columns.flatten()[flat]
            if g.trie is None:
                tokens = columns.tolist()
            else:
                tokens = g.trie.vocab[g.round][columns].tolist()
                g.nodes = expansions[i].child[beams, columns.cpu().numpy()]
            g.tokens = [g.tokens[b] + [t] for b, t in zip(beams, tokens)]
            g.scores, g.parents = scores, beams
            g.round += 1

    def _table_tops(self, hidden: torch.Tensor | None, expansions: list,
                    forced: list[bool] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """With item tables: each group's rows' best beam_width log-probabilities over the tokens
        its table allows (normalised over those), and their columns in the depth's vocabulary.

        The LM head runs over the depth's tokens only, once for the groups that share a table
        (a reload may leave groups of two tables in one batch). A forced row (not fed) gets
        logits of 0: its mask leaves it its one token, at log-probability 0."""
        depth = self.groups[0].round
        bounds = self._row_starts()
        fed_rows = [bounds[i + 1] - bounds[i] - (0 if forced is None else sum(forced[bounds[i]:bounds[i + 1]]))
                    for i in range(len(self.groups))]
        out: list = [None] * len(self.groups)
        first_fed = 0
        i = 0
        while i < len(self.groups):
            trie = self.groups[i].trie
            end = i
            while end < len(self.groups) and self.groups[end].trie is trie:
                end += 1
            fed = sum(fed_rows[i:end])
            mask = torch.cat([e.mask for e in expansions[i:end]]) if end - i > 1 else expansions[i].mask
            logits = None if fed == 0 else self.runner.logits(hidden[first_fed:first_fed + fed], trie.vocab[depth],
                                                               as_float=False)
            first_fed += fed
            if forced is not None:
                full = torch.zeros(mask.shape, dtype=torch.float32 if logits is None else logits.dtype,
                                   device=mask.device)
                if logits is not None:
                    unforced = ~torch.tensor(forced[bounds[i]:bounds[end]], device=mask.device)
                    full[unforced] = logits
                logits = full
            logits.masked_fill_(~mask, float("-inf"))
            lse = torch.logsumexp(logits.float(), dim=-1)
            row = 0
            for g in range(i, end):
                count = len(self.groups[g].tokens)
                k = min(self.groups[g].request.beam_width, logits.shape[1])
                top, columns = logits[row:row + count].topk(k, dim=-1)
                out[g] = (top.float() - lse[row:row + count, None], columns)
                row += count
            i = end
        return out

    def _span_tops(self, hidden: torch.Tensor, spans: list[tuple[int, int, int]]
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each span (first row, end row, k): its rows' k best log-probabilities (float32,
        best first) and their columns.

        A row's ranking by log-probability is its ranking by logit (log_softmax only subtracts
        the row's log-sum-exp), so no log_softmax of the whole rows x vocabulary is made. Without
        a table the vocabulary is walked in blocks of LOGITS_BLOCK_COLUMNS: each block's logits
        give each span's top k and every row's log-sum-exp (in float32), then are dropped, so a
        round holds one block's logits at a time and the LM head's weight is still read once.
        The blocks' bounds do not depend on the batch, so neither do a beam's scores."""
        vocab_size = self.runner.vocab_size
        block = max(LOGITS_BLOCK_COLUMNS, max(k for _, _, k in spans))
        tops: list[list] = [[] for _ in spans]
        sums = []
        fused = self.runner.topk_logsumexp()
        for start in range(0, vocab_size, block):
            end = min(vocab_size, start + block)
            logits = self.runner.logits(hidden, as_float=False, columns=(start, end))
            if fused is not None:  # (the runner's where it takes these logits: execution/runner.py)
                # Top k and log-sum-exp in two passes of our kernel (csrc/beam_topk.cpp), a span's rows at a time.
                lses = []
                for found, (first, last, k) in zip(tops, spans):
                    top, column, lse = fused(logits[first:last], min(k, end - start))
                    found.append((top, column + start))
                    lses.append(lse)
                sums.append(lses[0] if len(lses) == 1 else torch.cat(lses))
                continue
            for found, (first, last, k) in zip(tops, spans):
                top, column = logits[first:last].topk(min(k, end - start), dim=-1)
                found.append((top, column + start))
            sums.append(torch.logsumexp(logits.float(), dim=-1))
        lse = torch.logsumexp(torch.stack(sums, dim=1), dim=1) if len(sums) > 1 else sums[0]
        out = []
        for found, (first, last, k) in zip(tops, spans):
            top = torch.cat([t for t, _ in found], dim=1)
            column = torch.cat([c for _, c in found], dim=1)
            if len(found) > 1:
                top, pick = top.topk(min(k, top.shape[1]), dim=-1)
                column = column.gather(1, pick)
            out.append((top.float() - lse[first:last, None], column))
        return out

    def _finish_done(self) -> list:
        items = [(g.request, self._result(g)) for g in self.groups if g.round >= g.request.rounds]
        if items:
            self._keep([g for g in self.groups if g.round < g.request.rounds])
        return items

    def _result(self, g: _Group) -> Delta:
        decode = self.runner.tokenizer.decode
        leaves = g.nodes.tolist() if g.trie is not None else [None] * len(g.tokens)
        beams = [BeamResult(tokens, decode(tokens, skip_special_tokens=True), float(score), leaf)
                 for tokens, score, leaf in zip(g.tokens, g.scores.tolist(), leaves)]
        beams.sort(key=lambda b: b.cumulative_logprob, reverse=True)
        g.request.finish_reason = "length"
        return Delta(g.request.index, "", None, None, "length", beams=beams)
