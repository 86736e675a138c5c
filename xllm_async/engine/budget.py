"""How many waiting requests fit into the next prefill."""

from __future__ import annotations

from collections import deque


class BatchBudget:
    """max_seqs_per_batch sequences and max_tokens_per_batch padded tokens.

    Prompts are left-padded to the longest one, so the padded size (sequences
    x longest prompt) is what a batch really holds. A beam request counts as
    beam_width sequences: its cache is expanded to that many rows.
    """

    __slots__ = ("max_seqs", "max_tokens")

    def __init__(self, max_seqs: int, max_tokens: int) -> None:
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens

    def take(self, waiting: deque, seqs_in_use: int = 0, limit: int = 0) -> list:
        """Pop the requests of the next batch off the front of waiting (FIFO).

        limit (when not 0) caps the number of requests taken. A batch holds
        one kind of request (plain sequences or beam searches):
        it stops at the first request of another kind. Aborted requests are
        dropped on the way. The first live request is always taken on an
        empty batch, so a prompt larger than the budgets still runs (alone)
        instead of waiting forever. Only the thread that calls take() pops,
        so peek-then-pop is safe while the event loop appends.
        """
        batch: list = []
        longest = 0
        seqs = seqs_in_use
        while waiting and not (limit and len(batch) >= limit):
            req = waiting[0]
            if req.aborted:
                waiting.popleft()
                continue
            if batch and type(req) is not type(batch[0]):
                break
            longest_if_taken = max(longest, len(req.prompt_ids))
            seqs_if_taken = seqs + req.num_seqs
            over = seqs_if_taken > self.max_seqs or longest_if_taken * seqs_if_taken > self.max_tokens
            if over and (batch or seqs_in_use):
                break
            batch.append(waiting.popleft())
            longest, seqs = longest_if_taken, seqs_if_taken
        return batch
