"""One sequence being generated, and the deltas it hands back to its caller."""

from __future__ import annotations

import time

from .params import SamplingParams, TokenLogprobs


class Delta:
    """What one step added to one sequence. finish_reason set = the sequence is done."""

    __slots__ = ("index", "text", "token_id", "logprobs", "finish_reason", "error", "beams")

    def __init__(self, index: int, text: str, token_id: int | None, logprobs: TokenLogprobs | None,
                 finish_reason: str | None, error: str | None = None, beams: list | None = None) -> None:
        self.index = index
        self.text = text
        self.token_id = token_id
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.error = error
        self.beams = beams  # a beam search's final sequences, best first (execution/beam.py)


class QueuedRequest:
    """What schedulers, budgets and the engine know of any request: its prompt,
    where its deltas go, and its place in the queue.

    Created on the event loop; stepped only by the one execution thread that
    holds its batch; `aborted` and `done` are the fields the loop writes afterwards.
    """

    __slots__ = ("index", "prompt_ids", "sink", "finish_reason", "aborted", "done", "arrival", "started",
                 "cached_tokens", "prefix")

    num_seqs = 1  # rows it holds in a batch
    own_rows = own_tokens = 0  # the cache its beams hold apart from its row (BeamRequest)
    scores_prompt = False  # its prefill computes every prompt position: no cached prefix serves it

    def __init__(self, index: int, prompt_ids: list[int], sink) -> None:
        self.index = index  # the choice index inside its response
        self.prompt_ids = prompt_ids
        self.sink = sink  # receives Deltas on the event loop
        self.finish_reason: str | None = None
        self.aborted = False  # set on the loop: the caller is gone
        self.done = False  # set on the loop: its last delta was delivered, or it was aborted
        self.arrival = time.monotonic()
        self.started = 0.0  # when its batch began prefill (set on the slot thread)
        self.cached_tokens = 0  # prompt tokens its prefill found in the prefix cache (set on the slot thread)
        self.prefix = None  # its prefix-cache hit, pinned from admission to the end of its prefill (BatchBudget)

    def fail(self, message: str) -> Delta:
        self.finish_reason = "error"
        return Delta(self.index, "", None, None, "error", message)


class EngineRequest(QueuedRequest):
    """A prompt, its sampling parameters and its generation state."""

    __slots__ = ("params", "generator", "controls", "output_ids", "text", "prompt_scores", "_sent", "_detok", "_hold",
                 "_eos", "_max_len", "_stop_floor",
                 "grammar", "matcher")  # structured outputs (execution/grammar.py)

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, sink) -> None:
        super().__init__(index, prompt_ids, sink)
        self.params = params
        self.generator = None
        self.controls = None  # with params.controls: their per-row state for the sampler (execution/token_controls.py)
        self.output_ids: list[int] = []
        self.text = ""
        self.prompt_scores = None  # with params.prompt_logprobs: PromptScores, set by the prefill
        self._sent = 0  # characters of text already handed out
        self._detok = None  # an IncrementalDetokenizer (execution/detokenizer.py)
        # Text that could still become the start of a stop string is held back.
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._eos: frozenset[int] = frozenset()
        self._max_len = 0
        # The text made before min_tokens tokens: a stop string must end past it (as vLLM honours
        # no stop string before min_tokens; the sampler masks stop tokens until then).
        self._stop_floor = 0
        # Set by the API: its compiled grammar (opaque here); the matcher that walks it is made at
        # admission (execution/prepare.py) and masks every step's logits.
        self.grammar = None
        self.matcher = None

    @property
    def max_steps(self) -> int:
        """Forward steps it may take in its batch (one token each)."""
        return self.params.max_tokens

    @property
    def prefill_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def scores_prompt(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def cache_tokens(self) -> int:
        """Tokens its cache row may reach (0: a single token needs no cache). The API
        keeps prompt + max_tokens within the model's length."""
        return len(self.prompt_ids) + self.params.max_tokens if self.params.max_tokens > 1 else 0

    def bind(self, detokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """Attach what stepping needs from the model (once, before the first step: execution/prepare.py)."""
        self._detok = detokenizer
        self._eos = frozenset() if self.params.ignore_eos else eos_token_ids
        self._max_len = max_model_len

    def append(self, token: int, logprobs: TokenLogprobs | None, grammar_ended: bool = False) -> Delta:
        """Record one sampled token and return what the caller gets for it; grammar_ended: the
        request's grammar is complete with this token, which ends it as a stop token would.

        One delta per step, even with no text (held back, or a special token),
        so that token ids, logprobs and counts stay exact.
        """
        params = self.params
        self.output_ids.append(token)
        if grammar_ended or token in self._eos or token in params.stop_token_ids:
            self.finish_reason = "stop"
            self.text += self._detok.flush()
        else:
            self.text += self._detok.push(token)
            early = len(self.output_ids) < params.min_tokens
            if early:
                self._stop_floor = len(self.text)
            if params.stop and not early and self._cut_at_stop_string():
                self.finish_reason = "stop"
            elif (len(self.output_ids) >= params.max_tokens
                  or len(self.prompt_ids) + len(self.output_ids) >= self._max_len):
                self.finish_reason = "length"
                self.text += self._detok.flush()
        end = len(self.text) if self.finish_reason is not None else len(self.text) - self._hold
        text = ""
        if end > self._sent:
            text = self.text[self._sent:end]
            self._sent = end
        return Delta(self.index, text, token, logprobs, self.finish_reason)

    def _cut_at_stop_string(self) -> bool:
        # A new stop string can only start in the text not yet handed out, and must end past _stop_floor.
        for stop in self.params.stop:
            at = self.text.find(stop, max(self._sent, self._stop_floor - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at + len(stop) if self.params.include_stop else at]
                return True
        return False


class BeamRequest(QueuedRequest):
    """A prompt searched with beam_width beams for `rounds` tokens."""

    __slots__ = ("beam_width", "rounds", "trie", "leaves")

    def __init__(self, index: int, prompt_ids: list[int], beam_width: int, rounds: int, sink,
                 trie=None, leaves=None) -> None:
        super().__init__(index, prompt_ids, sink)
        self.beam_width = beam_width
        self.rounds = rounds
        # The item table's trie this request searches (the one loaded when it arrived: a reload
        # never changes a running search), and its own filter of the table's tuples, if any.
        self.trie = trie
        self.leaves = leaves

    @property
    def num_seqs(self) -> int:
        return self.beam_width

    @property
    def max_steps(self) -> int:
        return self.rounds

    @property
    def prefill_tokens(self) -> int:
        """Its prompt once, plus the tokens its beams add (their own keys, not copies of the prompt)."""
        return len(self.prompt_ids) + self.beam_width * (self.rounds - 1)

    @property
    def cache_tokens(self) -> int:
        """Its prompt's cache row (none for a single round: nothing is fed after the prefill)."""
        return len(self.prompt_ids) if self.rounds > 1 else 0

    @property
    def own_rows(self) -> int:
        return self.beam_width if self.rounds > 1 else 0

    @property
    def own_tokens(self) -> int:
        """The tokens each beam keeps in its own cache: one a round after the first."""
        return self.rounds - 1
