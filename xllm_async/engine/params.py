"""How one sequence is generated (SamplingParams, validated by the API) and what a step reports
of a chosen token's probability (TokenLogprobs): plain values that cross from the loop to a slot
and back, so they import nothing."""

from __future__ import annotations

# Seeds a request may send: every signed and every unsigned 64-bit integer (vLLM's range is the
# signed one; torch seeds with either). A choice's seed is the request's plus its index, taken
# modulo SEED_SPACE, so that no seed overflows the generator.
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1
SEED_SPACE = 2**64


class SamplingParams:
    """How one sequence is generated; validated by the API before it gets here."""

    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "logprobs", "include_stop", "prompt_logprobs", "controls")

    def __init__(self, max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: tuple[str, ...] = (), stop_token_ids: frozenset[int] = frozenset(),
                 ignore_eos: bool = False, logprobs: int | None = None, min_p: float = 0.0,
                 include_stop: bool = False, prompt_logprobs: int | None = None,
                 controls: TokenControls | None = None) -> None:
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k  # 0 = off
        self.min_p = min_p  # 0 = off; else drop tokens less likely than min_p times the likeliest
        self.seed = seed
        self.stop = stop
        self.stop_token_ids = stop_token_ids
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs  # None = off, k = the chosen token plus the k most likely
        self.include_stop = include_stop  # a matched stop string stays in the text (vLLM's include_stop_str_in_output)
        self.prompt_logprobs = prompt_logprobs  # None = off, k = score every prompt token, with the k most likely
        self.controls = controls  # None = none of them: the sampler's plain path

    @property
    def min_tokens(self) -> int:
        return self.controls.min_tokens if self.controls is not None else 0

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's _SAMPLING_EPS) as greedy: logits divided by a temperature under float32's
        # smallest normal number overflow to inf and NaN, and the sampler would answer token 0.
        return self.temperature < 1e-5 or self.top_k == 1


class TokenControls:
    """What a request asks of the next token's scores beyond temperature and the filters (vLLM's
    semantics, applied in this order by execution/token_controls.py): only `allowed` ids may be
    chosen; `bad_words` (token id sequences) are never completed; stop tokens wait for
    `min_tokens`; `logit_bias` is added; then the repetition penalty (prompt and output tokens), the
    frequency and presence penalties (output tokens). Set only when one of them changes anything."""

    __slots__ = ("logit_bias", "allowed", "bad_words", "min_tokens", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")

    def __init__(self, logit_bias: dict[int, float] | None = None, allowed: tuple[int, ...] | None = None,
                 bad_words: tuple[tuple[int, ...], ...] = (), min_tokens: int = 0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0) -> None:
        self.logit_bias = logit_bias or {}
        self.allowed = allowed  # None = every token
        self.bad_words = bad_words
        self.min_tokens = min_tokens
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty

    @property
    def active(self) -> bool:
        return bool(self.logit_bias or self.allowed is not None or self.bad_words or self.min_tokens
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives at one position."""

    __slots__ = ("logprob", "top")

    def __init__(self, logprob: float, top: list[tuple[int, float]]) -> None:
        self.logprob = logprob
        self.top = top
