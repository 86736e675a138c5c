"""Beam search for generative recommendation: a short item id (a few tokens)
found by a wide beam, every request running exactly its number of rounds.

A beam request prefills its prompt once; its cache row is then copied to
beam_width rows. Each round: logits -> log-probabilities -> the best
beam_width (beam, token) continuations by cumulative log-probability ->
caches reordered to follow their parent beams. EOS is an ordinary token here:
item ids have a fixed length, so every request runs its rounds to the end.
"""

from __future__ import annotations

import time

import torch

from .request import Delta, QueuedRequest


class BeamResult:
    """One final sequence of a beam search."""

    __slots__ = ("token_ids", "text", "cumulative_logprob")

    def __init__(self, token_ids: list[int], text: str, cumulative_logprob: float) -> None:
        self.token_ids = token_ids
        self.text = text
        self.cumulative_logprob = cumulative_logprob


class BeamRequest(QueuedRequest):
    """A prompt searched with beam_width beams for `rounds` tokens."""

    __slots__ = ("beam_width", "rounds")

    def __init__(self, index: int, prompt_ids: list[int], beam_width: int, rounds: int, sink) -> None:
        super().__init__(index, prompt_ids, sink)
        self.beam_width = beam_width
        self.rounds = rounds

    @property
    def num_seqs(self) -> int:
        return self.beam_width

    @property
    def max_steps(self) -> int:
        return self.rounds


class _Group:
    """The live beams of one request: rows [start, start + width) of the batch."""

    __slots__ = ("request", "tokens", "scores", "round")

    def __init__(self, request: BeamRequest, tokens: list[list[int]], scores: torch.Tensor) -> None:
        self.request = request
        self.tokens = tokens  # one token list per beam
        self.scores = scores  # [width] cumulative log-probabilities
        self.round = 1


class BeamSearchBatch:
    """Beam requests that step together on one execution thread; same interface
    as GenerationBatch (prefill, decode, fail, len), deltas only at the end."""

    __slots__ = ("runner", "requests", "groups", "kv", "_metrics")

    def __init__(self, runner, requests: list[BeamRequest], metrics=None) -> None:
        self.runner = runner
        self.requests = requests
        self.groups: list[_Group] = []
        self.kv = None
        self._metrics = metrics

    def __len__(self) -> int:
        return len(self.groups)

    def prefill(self) -> list:
        started = time.monotonic()
        for req in self.requests:
            req.started = started
        keep_cache = any(r.rounds > 1 for r in self.requests)
        prompts = [r.prompt_ids for r in self.requests]
        logits, self.kv = self.runner.prefill(prompts, keep_cache)
        logprobs = torch.log_softmax(logits, dim=-1)
        rows = []
        for row, req in enumerate(self.requests):
            # Round one: every beam starts from the same prompt, so the best
            # beam_width tokens of that one row are the beams.
            scores, tokens = logprobs[row].topk(req.beam_width)
            self.groups.append(_Group(req, [[t] for t in tokens.tolist()], scores))
            rows += [row] * req.beam_width
        if keep_cache:
            self.kv.select(rows)  # copy each prompt's cache to its beams: prefilled once, never per beam
        if self._metrics is not None:
            self._metrics.batch_prefilled(time.monotonic() - started, prompts, len(rows))
        return self._finish_done()

    def decode(self) -> list:
        if any(g.request.aborted for g in self.groups):
            self._keep([g for g in self.groups if not g.request.aborted])
            if not self.groups:
                return []
        started = time.monotonic()
        last = [beam[-1] for g in self.groups for beam in g.tokens]
        logprobs = torch.log_softmax(self.runner.decode(self.kv, last), dim=-1)
        # The best beam_width continuations of a group are among each beam's own
        # best beam_width tokens: rank those, not the whole vocabulary.
        widest = max(g.request.beam_width for g in self.groups)
        top_scores, top_tokens = logprobs.topk(widest, dim=-1)
        parents: list[int] = []
        start = 0
        for g in self.groups:
            width = g.request.beam_width
            candidates = g.scores[:, None] + top_scores[start:start + width, :width]
            g.scores, flat = candidates.flatten().topk(width)
            beam = (flat // width).tolist()
            tokens = top_tokens[start:start + width, :width].flatten()[flat].tolist()
            g.tokens = [g.tokens[b] + [t] for b, t in zip(beam, tokens)]
            g.round += 1
            parents += [start + b for b in beam]
            start += width
        self.kv.select(parents)  # each new beam continues its parent's cache
        if self._metrics is not None:
            self._metrics.batch_decoded(time.monotonic() - started, len(last))
        return self._finish_done()

    def fail(self, exc: Exception) -> list:
        message = f"Generation failed: {type(exc).__name__}: {exc}"
        items = [(g.request, g.request.fail(message)) for g in self.groups] if self.groups else \
            [(r, r.fail(message)) for r in self.requests]
        self.groups = []
        return items

    def _finish_done(self) -> list:
        items = []
        for g in self.groups:
            if g.round >= g.request.rounds:
                items.append((g.request, self._result(g)))
        if items:
            self._keep([g for g in self.groups if g.round < g.request.rounds])
        return items

    def _result(self, g: _Group) -> Delta:
        decode = self.runner.tokenizer.decode
        beams = [BeamResult(tokens, decode(tokens, skip_special_tokens=True), float(score))
                 for tokens, score in zip(g.tokens, g.scores.tolist())]
        beams.sort(key=lambda b: b.cumulative_logprob, reverse=True)
        g.request.finish_reason = "length"
        return Delta(g.request.index, "", None, None, "length", beams=beams)

    def _keep(self, groups: list[_Group]) -> None:
        """Keep these groups (a subset, in order) and their cache rows."""
        rows, start = [], 0
        keep = {id(g) for g in groups}
        for g in self.groups:
            width = g.request.beam_width
            if id(g) in keep:
                rows += range(start, start + width)
            start += width
        self.groups = groups
        if rows and self.kv is not None:
            self.kv.select(rows)
