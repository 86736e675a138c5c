"""The sampler that turns a batch of logits into tokens, and each request's random generator."""

from __future__ import annotations

import numpy as np
import torch

from ..engine.params import SEED_SPACE, SamplingParams, TokenLogprobs
from .token_controls import RowControls, apply_controls


def make_generator(params: SamplingParams, device: torch.device, offset: int = 0) -> torch.Generator | None:
    """A per-request generator so that a seeded request samples the same tokens in any batch.
    offset (the choice index) keeps the n choices of one seeded request apart; a negative seed
    wraps as torch wraps it (-1 and 2^64 - 1 are one seed)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed((params.seed + offset) % SEED_SPACE)
    return gen


def argmax_rows(scores: torch.Tensor) -> list[int]:
    """The index of each row's largest value (the first one on ties; NaN counts as largest).

    On CPU through numpy, whose argmax is vectorised: torch's CPU argmax is a
    scalar loop, about ten times slower over a large vocabulary, with the same
    answers; next to a small model's prefill that difference shows.
    """
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):  # numpy has no bfloat16
        return np.argmax(scores.detach().numpy(), axis=-1).tolist()
    return scores.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           controls: list[RowControls | None] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row of logits [rows, vocab].

    controls: each row's token controls (None for a row without), or None when no row of the batch
    has any (the batch's one flag: then nothing here costs more than before they existed). They
    change logits in place (execution/token_controls.py); the log-probabilities reported are the
    model's own, taken before them (vLLM's raw_logprobs)."""
    wants_logprobs = False
    sampled_rows = []
    for row, p in enumerate(params):
        wants_logprobs |= p.logprobs is not None
        if not p.greedy:
            sampled_rows.append(row)
    logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
    scores = logits if controls is None else apply_controls(logits, controls)
    tokens = argmax_rows(scores)
    if not sampled_rows and not wants_logprobs:  # the common case: one argmax for the whole batch
        return tokens, [None] * len(params)
    if sampled_rows:
        picked = _sample_rows(scores[sampled_rows], [params[r] for r in sampled_rows],
                              [generators[r] for r in sampled_rows])
        for row, token in zip(sampled_rows, picked):
            tokens[row] = token
    if logprobs is None:
        return tokens, [None] * len(params)
    out: list[TokenLogprobs | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        top: list[tuple[int, float]] = []
        if p.logprobs > 0:
            values, ids = logprobs[row].topk(p.logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        out.append(TokenLogprobs(float(logprobs[row, tokens[row]]), top))
    return tokens, out


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """Temperature, top-k and top-p for all sampled rows at once; only the
    random numbers are drawn per row, from each request's own generator."""
    scores = logits / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    top_k = [p.top_k if 0 < p.top_k < scores.shape[-1] else 0 for p in params]
    if any(top_k):
        widest = max(top_k)
        kth = scores.topk(widest, dim=-1).values  # [rows, widest], descending
        index = torch.tensor([max(k, 1) - 1 for k in top_k], device=scores.device)[:, None]
        threshold = kth.gather(1, index)
        threshold[torch.tensor(top_k, device=scores.device) == 0] = float("-inf")
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=scores.device)
    if bool((top_p < 1.0).any()):
        # Stable: equal scores in token order, so that which of them a cut drops is defined (and
        # top_sampling.py reproduces it from a row's candidates alone).
        sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
        sorted_probs = sorted_scores.softmax(-1)
        # Drop a token when the tokens before it already cover top_p; the first always stays.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
        scores = scores.scatter(1, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params], device=scores.device)
    if bool((min_p > 0.0).any()):  # after temperature, as in vLLM; the likeliest token always stays
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p exactly.
    race = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        race[row].exponential_(generator=gen)
    return argmax_rows(probs / race)
