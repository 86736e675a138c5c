"""A ranking request's share of the engine: one history (the prompt) and the candidates scored
against it (execution/score_batch.py runs it; api/score.py makes it)."""

from __future__ import annotations

from .request import QueuedRequest


class ScoreRequest(QueuedRequest):
    """Candidates (token lists, each its own continuation of the prompt) scored against one copy
    of the prompt, as beams whose tokens are given: the prompt is prefilled once, and each round
    feeds every candidate that has one its next token (teacher forcing).

    Two kinds of score, set by `labels`:
    - labels None: each candidate's summed log-probability given the prompt (over the item
      table's allowed tokens at each depth where `trie` is set, as the constrained beam search
      normalises; over the whole vocabulary where not). A candidate's last token is never fed.
    - labels a list of token ids: the log-probabilities of those tokens at the position after
      the candidate's last token (SGLang's /v1/score), every token of it fed.

    `results` (set on the slot thread before its delta is delivered): per candidate, a float or a
    list of floats, in the candidates' order."""

    __slots__ = ("candidates", "labels", "trie", "results")

    def __init__(self, index: int, prompt_ids: list[int], candidates: list[list[int]], sink,
                 labels: list[int] | None = None, trie=None) -> None:
        super().__init__(index, prompt_ids, sink)
        self.candidates = candidates
        self.labels = labels
        self.trie = trie  # the item table's trie the candidates are items of (None: the whole vocabulary)
        self.results: list = []

    def fed(self, candidate: list[int]) -> int:
        """Tokens of a candidate that are fed (the last one only to read the labels after it)."""
        return len(candidate) if self.labels is not None else len(candidate) - 1

    @property
    def feeds(self) -> int:
        """Rounds after the prefill: the most tokens any of its candidates feeds."""
        return max(self.fed(c) for c in self.candidates)

    @property
    def num_seqs(self) -> int:
        return len(self.candidates)

    @property
    def max_steps(self) -> int:
        return self.feeds + 1

    @property
    def prefill_tokens(self) -> int:
        """Its prompt once, plus the tokens its candidates feed (their own keys, as a beam's)."""
        return len(self.prompt_ids) + sum(self.fed(c) for c in self.candidates)

    @property
    def cache_tokens(self) -> int:
        """Its prompt's cache row (none when nothing is fed after the prefill)."""
        return len(self.prompt_ids) if self.feeds else 0

    @property
    def own_rows(self) -> int:
        """A row of own cache for each candidate that feeds a token."""
        return sum(1 for c in self.candidates if self.fed(c) > 0)

    @property
    def own_tokens(self) -> int:
        return self.feeds
