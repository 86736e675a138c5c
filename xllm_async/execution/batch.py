"""A batch of sequences that step together on one execution thread."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from ..engine.request import Delta, EngineRequest
from .grammar import accept_tokens, mask_logits
from .prepare import admitted_prefixes
from .runner import Runner
from .sampling import sample
from .top_sampling import sample_top, served, width_for

Items = list[tuple[EngineRequest, Delta]]


class Batch(ABC):
    """What the step loop (steps.py) drives on a slot's thread: a prefill, then a step at a time
    until it is empty, each returning [(request, delta), ...] for the loop. GenerationBatch and
    BeamSearchBatch implement it (tests/test_handoff.py checks them)."""

    __slots__ = ()
    joinable = False  # whether add() takes requests into it while it runs (the join rule's batches)

    @abstractmethod
    def __len__(self) -> int:
        """Rows still running: 0 ends the batch."""

    @abstractmethod
    def prefill(self) -> list:
        """Its requests' prompts, once: their first deltas."""

    @abstractmethod
    def decode(self) -> list:
        """One step of every row."""

    def add(self, requests: list) -> list:
        """Prefill requests into it as new rows (only where joinable)."""
        raise TypeError(f"{type(self).__name__} takes no requests while it runs")

    def cache_in_use(self) -> tuple[int, int]:
        """(rows, tokens a row) of its cache, for the budget of requests joining it (only where joinable)."""
        raise TypeError(f"{type(self).__name__} takes no requests while it runs")


class GenerationBatch(Batch):
    """Requests plus their shared key/value cache.

    prefill() runs once, decode() once per round; finished rows leave the
    batch (and the cache) right after the step that finished them, so they
    stop costing work. Every step returns [(request, delta), ...] for the loop.
    Its requests come prepared (execution/prepare.py): nothing a request brings
    is turned into state here, where a failure would fail the whole batch.
    """

    __slots__ = ("runner", "requests", "kv", "between_layers", "_next_tokens", "_metrics", "_controlled")
    joinable = True

    def __init__(self, runner: Runner, requests: list[EngineRequest], metrics=None,
                 between_layers: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.requests = requests
        self.kv = None
        self.between_layers = between_layers  # handed to every forward (StepLoop.run's cores)
        self._next_tokens: list[int] = []
        self._metrics = metrics
        self._controlled = False  # whether any row has token controls (the sampler's one flag)

    def __len__(self) -> int:
        return len(self.requests)

    def prefill(self) -> Items:
        return self._prefill(self.requests)

    def add(self, requests: list[EngineRequest]) -> Items:
        """Prefill new requests into this running batch (the continuous scheduler):
        their keys join its cache as new rows, and they step with it from now on."""
        return self._prefill(requests, into=self)

    def _prefill(self, requests: list[EngineRequest], into: GenerationBatch | None = None) -> Items:
        started = time.monotonic()
        for req in requests:
            req.started = started
        prompts = [r.prompt_ids for r in requests]
        first = len(self.requests) if into is not None else 0
        capacity, kv = cache_capacity(requests, self.runner.max_model_len), self.kv if into is not None else None
        scored = [r.params.prompt_logprobs for r in requests]
        try:
            with admitted_prefixes(self.runner, requests) as hits:
                if any(k is not None for k in scored):  # (scoring: every position's logits of these prompts)
                    out = self.runner.prefill_scored(prompts, capacity, kv, scored, between_layers=self.between_layers,
                                                     hits=hits)
                    for req, score in zip(requests, out.scores):
                        req.prompt_scores = score
                else:
                    out = self.runner.prefill(prompts, capacity, kv, between_layers=self.between_layers, hits=hits)
                self.kv = out.cache
        except Exception:
            if into is not None and self.kv is not None:  # the running rows go on; drop half-written ones
                self.kv.select(list(range(first)))
            raise
        if out.cached is not None:  # (each prompt's tokens found in the prefix cache)
            for req, tokens in zip(requests, out.cached):
                req.cached_tokens = tokens
        if into is not None:
            self.requests = self.requests + requests
        self._controlled = any(r.controls is not None for r in self.requests)
        items = self._advance(out.logits, first)
        if self._metrics is not None:
            self._metrics.batch_prefilled(time.monotonic() - started, prompts, len(items), out.cached)
        return items

    def decode(self) -> Items:
        if any(r.aborted for r in self.requests):
            self._keep([row for row, r in enumerate(self.requests) if not r.aborted])
            if not self.requests:
                return []
        started = time.monotonic()
        if self._greedy_only():  # (the tokens alone: a runner may pick them without making the logits)
            tokens = self.runner.decode_greedy(self.kv, self._next_tokens, between_layers=self.between_layers)
            items = self._hand_out(tokens, [None] * len(tokens))
        elif self._top_only():  # (each row's top k alone: a runner may give them without the logits)
            tokens = self._sample_top()
            items = self._hand_out(tokens, [None] * len(tokens))
        else:
            items = self._advance(self.runner.decode(self.kv, self._next_tokens, between_layers=self.between_layers))
        if self._metrics is not None:
            self._metrics.batch_decoded(time.monotonic() - started, len(items))
        return items

    def cache_in_use(self) -> tuple[int, int]:
        """(rows, tokens a row may reach) of its cache, for the budget of requests that join it."""
        return len(self.requests), max((r.cache_tokens for r in self.requests), default=0)

    def _advance(self, logits, first: int = 0) -> Items:
        """Sample the next token of rows first.. (their logits in order) and hand them out."""
        requests = self.requests[first:]
        matchers = [r.matcher for r in requests]
        constrained = mask_logits(logits, matchers)  # (structured outputs: their rows' grammars, in place)
        controls = [r.controls for r in requests] if self._controlled else None
        tokens, logprobs = sample(logits, [r.params for r in requests], [r.generator for r in requests], controls)
        ended = accept_tokens(matchers, constrained, tokens) if constrained else ()
        return self._hand_out(tokens, logprobs, ended, first)

    def _greedy_only(self) -> bool:
        """Whether a step needs only each row's argmax, and the runner picks it without the logits: every
        row greedy, none with log-probabilities, a grammar or token controls (which read or change the
        logits first)."""
        return self.runner.picks_greedy and not self._controlled and all(
            r.params.greedy and r.params.logprobs is None and r.matcher is None for r in self.requests)

    def _top_only(self) -> bool:
        """Whether a step needs only each row's largest logits, and the runner gives them without the
        rest: every row greedy or sampling from a small top k (top_sampling.served), none with
        log-probabilities, a grammar or token controls."""
        vocab = self.runner.vocab_size
        return self.runner.picks_top and not self._controlled and all(
            r.matcher is None and served(r.params, vocab) for r in self.requests)

    def _sample_top(self) -> list[int]:
        """A step's tokens from each row's candidates (top_sampling.sample_top: sample()'s tokens, its
        generators left as sample() leaves them); a row they cannot serve gets its logits from the
        step's hidden states."""
        params = [r.params for r in self.requests]
        top = self.runner.decode_top(self.kv, self._next_tokens, width_for(params, self.runner.vocab_size),
                                     between_layers=self.between_layers)
        return sample_top(top.values, top.columns, top.nans, params, [r.generator for r in self.requests], top.vocab,
                          lambda rows: self.runner.logits(top.hidden[rows]))

    def _hand_out(self, tokens: list[int], logprobs: list, ended=(), first: int = 0) -> Items:
        """Rows first..'s chosen tokens to their requests (ended: the rows whose grammar ended)."""
        requests = self.requests[first:]
        items = []
        for row, req in enumerate(requests):
            items.append((req, req.append(tokens[row], logprobs[row], row in ended)))
        self._next_tokens = self._next_tokens[:first] + tokens
        alive = [row for row, req in enumerate(self.requests) if req.finish_reason is None]
        if len(alive) < len(self.requests):
            self._keep(alive)
        return items

    def _keep(self, rows: list[int]) -> None:
        """Only these rows (ascending) go on, those above the gaps moved into them (fill_order: their
        order is no longer the requests', which no step reads)."""
        rows = fill_order(rows)
        self.requests = [self.requests[i] for i in rows]
        self._next_tokens = [self._next_tokens[i] for i in rows]
        self._controlled = self._controlled and any(r.controls is not None for r in self.requests)
        if rows and self.kv is not None:
            self.kv.select(rows)


def fill_order(alive: list[int]) -> list[int]:
    """The rows `alive` (ascending) in the order that moves the fewest in SlabCache.select: each
    keeps its place where it is below len(alive), and the rows above fill the places of those gone."""
    count = len(alive)
    staying = {row for row in alive if row < count}
    movers = iter(row for row in alive if row >= count)
    return [place if place in staying else next(movers) for place in range(count)]


def cache_capacity(requests: list[EngineRequest], max_model_len: int) -> int:
    """Tokens a row of these requests' cache must hold (0: none needed, every one
    wants a single token and needs only the prompt's last logits)."""
    if all(r.params.max_tokens <= 1 for r in requests):
        return 0
    return max(min(len(r.prompt_ids) + r.params.max_tokens, max_model_len) for r in requests)


def fail_all(requests: list[EngineRequest], exc: Exception) -> Items:
    message = f"Generation failed: {type(exc).__name__}: {exc}"
    return [(r, r.fail(message)) for r in requests]
