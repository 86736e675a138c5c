"""A batch of sequences that step together on one execution thread."""

from __future__ import annotations

from .request import Delta, EngineRequest
from .sampling import make_generator, sample


class GenerationBatch:
    """Requests plus their shared key/value cache.

    prefill() runs once, decode() once per round; finished rows leave the
    batch (and the cache) right after the step that finished them, so they
    stop costing work. Every step returns [(sink, delta), ...] for the loop.
    """

    __slots__ = ("runner", "requests", "kv", "_next_tokens")

    def __init__(self, runner, requests: list[EngineRequest]) -> None:
        self.runner = runner
        self.requests = requests
        self.kv = None
        self._next_tokens: list[int] = []
        for req in requests:
            req.bind(runner.tokenizer, runner.eos_token_ids, runner.max_model_len)
            req.generator = make_generator(req.params, runner.device, req.index)

    def __len__(self) -> int:
        return len(self.requests)

    def prefill(self) -> list[tuple[object, Delta]]:
        # One-token requests need neither a cache nor more than the last logits.
        keep_cache = any(r.params.max_tokens > 1 for r in self.requests)
        logits, self.kv = self.runner.prefill([r.prompt_ids for r in self.requests], keep_cache)
        return self._advance(logits)

    def decode(self) -> list[tuple[object, Delta]]:
        if any(r.aborted for r in self.requests):
            self._keep([row for row, r in enumerate(self.requests) if not r.aborted])
            if not self.requests:
                return []
        return self._advance(self.runner.decode(self.kv, self._next_tokens))

    def merge(self, other: "GenerationBatch") -> None:
        self.requests += other.requests
        self._next_tokens += other._next_tokens
        self.kv.merge(other.kv)

    def fail(self, message: str) -> list[tuple[object, Delta]]:
        """End every sequence of the batch with an error (a forward raised)."""
        items = [(r.sink, r.fail(message)) for r in self.requests]
        self.requests = []
        return items

    def _advance(self, logits) -> list[tuple[object, Delta]]:
        requests = self.requests
        tokens, logprobs = sample(logits, [r.params for r in requests], [r.generator for r in requests])
        items = []
        alive = []
        for row, req in enumerate(requests):
            items.append((req.sink, req.append(tokens[row], logprobs[row])))
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
