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
                 "ignore_eos", "logprobs", "include_stop", "prompt_logprobs")

    def __init__(self, max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: tuple[str, ...] = (), stop_token_ids: frozenset[int] = frozenset(),
                 ignore_eos: bool = False, logprobs: int | None = None, min_p: float = 0.0,
                 include_stop: bool = False, prompt_logprobs: int | None = None) -> None:
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

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's _SAMPLING_EPS) as greedy: logits divided by a temperature under float32's
        # smallest normal number overflow to inf and NaN, and the sampler would answer token 0.
        return self.temperature < 1e-5 or self.top_k == 1


class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives at one position."""

    __slots__ = ("logprob", "top")

    def __init__(self, logprob: float, top: list[tuple[int, float]]) -> None:
        self.logprob = logprob
        self.top = top
