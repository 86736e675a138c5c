"""A batch of sequences that step together on one execution thread."""

from __future__ import annotations

import time

from .request import Delta, EngineRequest
from .sampling import make_generator, sample

Items = list[tuple[EngineRequest, Delta]]


class GenerationBatch:
    """Requests plus their shared key/value cache.

    prefill() runs once, decode() once per round; finished rows leave the
    batch (and the cache) right after the step that finished them, so they
    stop costing work. Every step returns [(request, delta), ...] for the loop.
    """

    __slots__ = ("runner", "requests", "kv", "_next_tokens", "_metrics")

    def __init__(self, runner, requests: list[EngineRequest], metrics=None) -> None:
        self.runner = runner
        self.requests = requests
        self.kv = None
        self._next_tokens: list[int] = []
        self._metrics = metrics
        for req in requests:
            req.bind(runner.tokenizer, runner.eos_token_ids, runner.max_model_len)
            req.generator = make_generator(req.params, runner.device, req.index)

    def __len__(self) -> int:
        return len(self.requests)

    def prefill(self) -> Items:
        started = time.monotonic()
        for req in self.requests:
            req.started = started
        # One-token requests need neither a cache nor more than the last logits.
        keep_cache = any(r.params.max_tokens > 1 for r in self.requests)
        prompts = [r.prompt_ids for r in self.requests]
        logits, self.kv = self.runner.prefill(prompts, keep_cache)
        items = self._advance(logits)
        if self._metrics is not None:
            self._metrics.batch_prefilled(time.monotonic() - started, prompts, len(items))
        return items

    def decode(self) -> Items:
        if any(r.aborted for r in self.requests):
            self._keep([row for row, r in enumerate(self.requests) if not r.aborted])
            if not self.requests:
                return []
        started = time.monotonic()
        items = self._advance(self.runner.decode(self.kv, self._next_tokens))
        if self._metrics is not None:
            self._metrics.batch_decoded(time.monotonic() - started, len(items))
        return items

    def merge(self, other: GenerationBatch) -> None:
        self.requests += other.requests
        self._next_tokens += other._next_tokens
        self.kv.merge(other.kv)

    def fail(self, exc: Exception) -> Items:
        """End every unfinished sequence of the batch with an error (a forward raised)."""
        items = fail_all(self.requests, exc)
        self.requests = []
        return items

    def _advance(self, logits) -> Items:
        requests = self.requests
        tokens, logprobs = sample(logits, [r.params for r in requests], [r.generator for r in requests])
        items = []
        alive = []
        for row, req in enumerate(requests):
            items.append((req, req.append(tokens[row], logprobs[row])))
            if req.finish_reason is None:
                alive.append(row)
        self._next_tokens = tokens
        if len(alive) < len(requests):
            self._keep(alive)
        return items

    def _keep(self, rows: list[int]) -> None:
        self.requests = [self.requests[i] for i in rows]
        self._next_tokens = [self._next_tokens[i] for i in rows]
        if rows and self.kv is not None:
            self.kv.select(rows)


def fail_all(requests: list[EngineRequest], exc: Exception) -> Items:
    message = f"Generation failed: {type(exc).__name__}: {exc}"
    return [(r, r.fail(message)) for r in requests]
