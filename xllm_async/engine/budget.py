"""How many waiting requests fit into the next prefill."""

from __future__ import annotations

from collections import deque

from .request import EngineRequest


class BatchBudget:
    """max_seqs_per_batch sequences and max_tokens_per_batch padded prompt tokens.

    Prompts are left-padded to the longest one, so the padded size (rows x
    longest prompt) is what a prefill really costs.
    """

    __slots__ = ("max_seqs", "max_tokens")

    def __init__(self, max_seqs: int, max_tokens: int) -> None:
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens

    def take(self, waiting: deque, seqs_in_use: int = 0) -> list[EngineRequest]:
        """Pop the requests of the next batch off the front of waiting (FIFO).

        Aborted requests are dropped on the way. The first live request is
        always taken on an empty batch, so a prompt larger than the token
        budget still runs (alone) instead of waiting forever.
        Only the thread that calls take() pops, so peek-then-pop is safe while
        the event loop appends.
        """
        batch: list[EngineRequest] = []
        longest = 0
        room = self.max_seqs - seqs_in_use
        while waiting and len(batch) < room:
            req = waiting[0]
            if req.aborted:
                waiting.popleft()
                continue
            longest_if_taken = max(longest, len(req.prompt_ids))
            if batch and longest_if_taken * (len(batch) + 1) > self.max_tokens:
                break
            batch.append(waiting.popleft())
            longest = longest_if_taken
        return batch
