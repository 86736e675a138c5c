"""Sampling a decode row from its top-k logits alone (the LM head fused with a top-k pick,
csrc/head_topk.cpp, issue 49), to exactly the token sampling.py's sampler picks from the whole row.

Exact, here, is bit for bit: for the same logits and the same generator state this picks the token
sample() picks, and leaves the generator in the state sample() leaves it, so a seeded request's
tokens are the same through either path, step after step. How each of _sample_rows' steps is
reproduced over the few candidates:
- temperature and the top-k threshold: the same float32 division of the same values, the k-th
  largest taken from the candidates; every value that ties with it once divided is kept (sample()'s
  `scores < threshold` keeps them all), so the candidates must reach past the k-th: SPARE more, and
  a row whose candidates all tie with the threshold (or that has a NaN) is sampled from its logits
  (the caller's logits_of), as sample() would;
- top-p: the kept values in torch.sort's stable descending order (sample() sorts stably for that),
  and their softmax and running sum over a copy padded with -inf to a multiple of 64: torch sums a
  row lane by lane (lane = position mod the vector width, which divides 64) and the -inf beyond add
  exact zeros, so the sums are the whole row's bit for bit;
- the softmax over the vocabulary and min-p: over the 64-column blocks of the vocabulary that hold a
  kept token, in vocabulary order; the blocks left out hold only zeros for the same reason;
- the exponential race: each row's generator goes through its whole row's draws, as sample()'s
  does, but the logarithms are taken at the kept columns only (csrc/exponential_draws.cpp
  reproduces torch's draw: its Mersenne twister, then -log1p(-u); checked against torch at first
  use, else the whole row is drawn by torch: about 1 ms a row of SmolLM2's 49,152 on this CPU);
  the first largest probability / draw wins, in vocabulary order; a zero draw (a 0/0 or p/0 in
  sample()'s race) wins as numpy's argmax lets it: the first NaN, else the first inf.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..engine.params import SamplingParams
from .sampling import _sample_rows

# The largest top_k served from candidates: clients' usual values lie below it (20-50: transformers'
# default 50, llama.cpp's 40); the kernel keeps up to 2 x (k + SPARE) entries a row and thread; and
# the vocabulary softmax runs over the kept tokens' 64-column blocks, at most k of them (64: 4,096 of
# SmolLM2's 49,152 columns), a share that grows with k toward the whole row.
MAX_TOP_K = 64
SPARE = 64  # candidates past the k-th, for the values that tie with it once divided by the temperature
BLOCK = 64  # a multiple of any vector width torch sums float32 rows with


def served(p: SamplingParams, vocab: int) -> bool:
    """Whether a row with these parameters (and no logprobs, grammar or controls: the caller checks
    those) samples from candidates: greedy, or top_k in 1..MAX_TOP_K below the vocabulary."""
    return p.logprobs is None and (p.greedy or 0 < p.top_k <= min(MAX_TOP_K, vocab - 1))


def width_for(params: list[SamplingParams], vocab: int) -> int:
    """How many candidates a step of these rows needs from the LM head."""
    widest = max((p.top_k for p in params if not p.greedy), default=0)
    return min(vocab, widest + SPARE) if widest else 1


def sample_top(values: torch.Tensor, indices: torch.Tensor, nans: torch.Tensor, params: list[SamplingParams],
               generators: list, vocab: int, logits_of: Callable[[list[int]], torch.Tensor]) -> list[int]:
    """Each row's token from its candidates (linear_topk's values, columns and first NaN column), as
    sample() picks it from the row's logits; logits_of(rows) gives some rows' logits [len, vocab]
    (float32) for the rows the candidates cannot serve."""
    tokens: list[int] = [0] * len(params)
    whole: list[int] = []
    nan_at = nans.tolist()
    for row, p in enumerate(params):
        if p.greedy:  # argmax_rows': the first NaN, else the first largest
            tokens[row] = nan_at[row] if nan_at[row] >= 0 else int(indices[row, 0])
            continue
        token = None if nan_at[row] >= 0 else _from_candidates(values[row], indices[row], p, generators[row], vocab)
        if token is None:
            whole.append(row)
        else:
            tokens[row] = token
    if whole:
        logits = logits_of(whole)
        picked = _sample_rows(logits, [params[r] for r in whole], [generators[r] for r in whole])
        for row, token in zip(whole, picked):
            tokens[row] = token
    return tokens


def _from_candidates(values: torch.Tensor, columns: torch.Tensor, p: SamplingParams, generator, vocab: int):
    """One row's token, or None where its candidates may miss a kept value."""
    scores = values / torch.tensor([p.temperature])  # (as sample(): float32 over float32)
    threshold = scores[p.top_k - 1]
    kept = int((scores >= threshold).sum())
    if kept == len(scores) and len(scores) < vocab:
        return None  # every candidate ties with the threshold: more may lie beyond them
    scores, columns = scores[:kept], columns[:kept]
    by_column = columns.argsort()
    scores, columns = scores[by_column], columns[by_column]
    if p.top_p < 1.0:
        ranked, order = scores.sort(descending=True, stable=True)
        padded = torch.full((-(-kept // BLOCK) * BLOCK,), float("-inf"))
        padded[:kept] = ranked
        probs = padded.softmax(-1)
        drop = (probs.cumsum(-1) - probs)[:kept] >= torch.tensor([p.top_p])
        scores = scores.scatter(0, order, ranked.masked_fill(drop, float("-inf")))
    blocks = torch.unique(columns // BLOCK)  # (sorted)
    at = torch.searchsorted(blocks, columns // BLOCK) * BLOCK + columns % BLOCK
    spread = torch.full((len(blocks) * BLOCK,), float("-inf"))
    spread[at] = scores
    probs = spread.softmax(-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < torch.tensor([p.min_p]) * probs.amax(-1, keepdim=True), 0.0)
    kept_probs = probs[at]
    draws, zeros = _draws(generator, vocab, columns)  # (the whole row's draws: the same state after)
    if len(zeros):  # sample()'s race has 0/0 (NaN) or p/0 (inf) there: numpy's argmax takes the first NaN, else inf
        positive = dict(zip(columns.tolist(), kept_probs.tolist()))
        nan = [z for z in zeros.tolist() if positive.get(z, 0.0) == 0.0]
        return nan[0] if nan else int(zeros[0])
    # Elsewhere sample()'s race is 0 / a positive finite draw: 0, below the kept tokens' largest (one
    # has probability > 0), so the first largest among them, in vocabulary order, is the row's.
    return int(columns[int(np.argmax((kept_probs / draws).numpy()))])


_exact_draws: bool | None = None  # whether torch.ops.xllm.exponential_at draws as torch does (checked once)


def _draws(generator, vocab: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.empty(vocab).exponential_(generator=generator) draws at these columns, and the columns
    where it draws 0, the generator left as that call leaves it: by our kernel (csrc/exponential_draws.cpp:
    the logarithms of these columns only) where it matches torch here, else by that very call."""
    global _exact_draws
    if _exact_draws is None:
        _exact_draws = _check_draws()
    if _exact_draws:
        return torch.ops.xllm.exponential_at(generator, vocab, columns)
    race = torch.empty(vocab).exponential_(generator=generator)
    return race[columns], (race == 0).nonzero().flatten()


def _check_draws() -> bool:
    """exponential_at against torch's own draws, every column, calls in a row (the state after one
    carried into the next, past the twister's 624-output turns), a few seeds and lengths."""
    if not hasattr(torch.ops.xllm, "exponential_at"):
        return False
    for seed in (0, 7, 2**63 + 5):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        if seed == 7:  # (one float32 uniform first: an odd number of the twister's outputs consumed)
            torch.rand(1, generator=ours), torch.rand(1, generator=theirs)
        for n in (1, 623, 5000, 313):
            drawn, zeros = torch.ops.xllm.exponential_at(ours, n, torch.arange(n))
            want = torch.empty(n).exponential_(generator=theirs)
            if not torch.equal(drawn, want) or len(zeros) != int((want == 0).sum()):
                return False
        if not torch.equal(ours.get_state(), theirs.get_state()):
            return False
    return True
