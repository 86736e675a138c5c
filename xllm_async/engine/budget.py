"""How many waiting requests fit into the next prefill."""

from __future__ import annotations

from collections import deque


class BatchBudget:
    """max_seqs_per_batch sequences, max_tokens_per_batch prompt tokens, and the
    slot's key/value cache.

    Prompt tokens: on our own engine prompts are packed, so a batch costs the sum
    of its requests' tokens (a beam request: its prompt once plus its beams' own
    tokens); on the transformers engine prompts are left-padded, so it costs
    rows x the longest prompt. A beam request counts as beam_width sequences.
    The cache (kv_tokens per slot, 0 = unbounded) holds a rectangle: cache rows x
    the most tokens any row will reach (request.cache_tokens), and beside it the
    beams' own caches: every beam x the most rounds after the first
    (request.own_rows x request.own_tokens), as our runner lays them out. The
    transformers engine copies a beam's prompt into every beam: there a beam
    request is beam_width rows of its prompt and rounds.

    With a prefix cache (prefixes: the runner, where it caches prefixes), a request's
    prompt tokens are only those its prefill computes: take() pins its cached prefix
    (Runner.match_prefix) and carries the hit on the request until its prefill
    releases it. Its cache row still counts the whole prompt, which the prefill
    copies in: even a request that keeps no cache (one token, one beam round),
    where it found a prefix (one that found none takes no slab: its new blocks go
    from the forward into the store).
    """

    __slots__ = ("max_seqs", "max_tokens", "packed", "kv_tokens", "shared_beam_prompts", "prefixes")

    def __init__(self, max_seqs: int, max_tokens: int, packed: bool = False, kv_tokens: int = 0,
                 shared_beam_prompts: bool | None = None, prefixes=None) -> None:
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.packed = packed
        self.kv_tokens = kv_tokens
        # Runner.shares_beam_prompts (by default, as our packed engine does).
        self.shared_beam_prompts = packed if shared_beam_prompts is None else shared_beam_prompts
        self.prefixes = prefixes

    def take(self, waiting: deque, seqs_in_use: int = 0, limit: int = 0,
             cache_in_use: tuple[int, int] = (0, 0)) -> list:
        """Pop the requests of the next batch off the front of waiting (FIFO).

        limit (when not 0) caps the number of requests taken; cache_in_use is the
        (rows, tokens a row) of a running batch that the new one joins. A batch
        holds one kind of request (plain sequences or beam searches):
        it stops at the first request of another kind. Aborted requests are
        dropped on the way. The first live request is always taken on an
        empty batch, so a prompt larger than the budgets still runs (alone)
        instead of waiting forever. Only the thread that calls take() pops,
        so peek-then-pop is safe while the event loop appends.
        """
        batch: list = []
        longest = tokens = 0
        seqs = seqs_in_use
        rows, row_tokens = cache_in_use
        own_rows = own_tokens = 0
        while waiting and not (limit and len(batch) >= limit):
            req = waiting[0]
            if req.aborted:
                waiting.popleft()
                continue
            if batch and type(req) is not type(batch[0]):
                break
            longest_if_taken = max(longest, len(req.prompt_ids))
            seqs_if_taken = seqs + req.num_seqs
            tokens_if_taken = tokens + req.prefill_tokens
            req_rows, req_tokens, req_own_rows, req_own_tokens = self._cache_shape(req)
            if self.prefixes is not None:
                spared = self._pin_prefix(req)
                tokens_if_taken -= spared
                if spared:  # its prefill copies the prefix into a slab, even where it keeps no cache
                    req_tokens = req_tokens or len(req.prompt_ids)
            row_tokens_if_taken = max(row_tokens, req_tokens)
            own_rows_if_taken, own_tokens_if_taken = own_rows + req_own_rows, max(own_tokens, req_own_tokens)
            over = (self._over(seqs_if_taken, tokens_if_taken, longest_if_taken)
                    or self._over_cache((rows + req_rows) * row_tokens_if_taken
                                        + own_rows_if_taken * own_tokens_if_taken))
            if over and (batch or seqs_in_use):
                if req.prefix is not None:  # it waits on: its blocks may be evicted meanwhile
                    self.prefixes.release_prefix(req.prefix)
                    req.prefix = None
                break
            batch.append(waiting.popleft())
            longest, seqs, tokens = longest_if_taken, seqs_if_taken, tokens_if_taken
            rows, row_tokens = rows + req_rows, row_tokens_if_taken
            own_rows, own_tokens = own_rows_if_taken, own_tokens_if_taken
        return batch

    def _pin_prefix(self, req) -> int:
        """Pin the request's cached prefix for its prefill: the prompt tokens it spares."""
        if req.scores_prompt:
            return 0
        req.prefix = self.prefixes.match_prefix(req.prompt_ids)
        return req.prefix.tokens

    def cache_alone(self, request) -> int:
        """The cache tokens a request needs in a batch of its own."""
        rows, tokens, own_rows, own_tokens = self._cache_shape(request)
        return rows * tokens + own_rows * own_tokens

    def _cache_shape(self, request) -> tuple[int, int, int, int]:
        """(rectangle rows, tokens a row, own rows, own tokens) a request adds to a slot's cache."""
        if self.shared_beam_prompts or not request.own_rows:
            return 1, request.cache_tokens, request.own_rows, request.own_tokens
        return request.own_rows, request.cache_tokens + request.own_tokens, 0, 0

    def never_fits(self, request) -> bool:
        """Whether a request's cache exceeds a slot's even alone: it must be refused, not queued
        (take() would start it alone, and the runner could not hold it)."""
        return self._over_cache(self.cache_alone(request))

    def filled_by(self, waiting: deque) -> bool:
        """Whether the waiting requests fill a batch already: more arrivals could not join it."""
        seqs = tokens = longest = 0
        for req in waiting:
            seqs += req.num_seqs
            tokens += req.prefill_tokens
            longest = max(longest, len(req.prompt_ids))
            if self._over(seqs, tokens, longest):
                return True
        return False

    def _over_cache(self, tokens: int) -> bool:
        return bool(self.kv_tokens) and tokens > self.kv_tokens

    def _over(self, seqs: int, tokens: int, longest: int) -> bool:
        """Whether a batch of this many sequences and prompt tokens is over the budgets."""
        return seqs > self.max_seqs or (tokens if self.packed else longest * seqs) > self.max_tokens
