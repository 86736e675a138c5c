"""The contract between the engine and whatever runs the model (runtime/): what
the engine calls and what a runner declares. runtime.model_runner.ModelRunner
(our own model code) and runtime.hf_runner.TransformersRunner (transformers, for
other architectures) both name it; the engine knows no other runner type, and
tests/test_contracts.py checks both against it.

Caches are opaque to the engine: it gets one from prefill() or beam_prefill()
and hands it back to decode() or beam_decode(); it reads only what this
contract names. A prefill answers with one result object (Prefilled,
BeamPrefilled): what it computed and what it found in the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Prefilled:
    """What prefill() and prefill_scored() return: the prompts' last-position logits [rows, vocab]
    (float32), their cache (None where none was asked for), each prompt's tokens served from the
    prefix cache (None where the runner has no prefix cache), and with prefill_scored() each
    prompt's PromptScores (model/scoring.py; None for a prompt not scored)."""

    __slots__ = ("logits", "cache", "cached", "scores")

    def __init__(self, logits: torch.Tensor, cache, cached: list[int] | None = None,
                 scores: list | None = None) -> None:
        self.logits = logits
        self.cache = cache
        self.cached = cached
        self.scores = scores


class BeamPrefilled:
    """What beam_prefill() returns: one row per prompt that the runner's logits() turns into logits
    (`hidden`: final hidden states, or the logits themselves where the runner says
    hidden_is_logits), the beams' state for beam_decode(), and each prompt's tokens served from the
    prefix cache (None where the runner has none)."""

    __slots__ = ("hidden", "state", "cached")

    def __init__(self, hidden: torch.Tensor, state, cached: list[int] | None = None) -> None:
        self.hidden = hidden
        self.state = state
        self.cached = cached


class TopLogits:
    """What decode_top() returns: each row's `width` largest logits (float32 [rows, width]) and their
    columns (int64, value descending then column ascending: torch's stable order; NaNs left out), each
    row's first NaN column (int64 [rows], -1: none), the final hidden states that logits() turns
    into the whole rows where the sampler needs them, and the vocabulary's width."""

    __slots__ = ("values", "columns", "nans", "hidden", "vocab")

    def __init__(self, values: torch.Tensor, columns: torch.Tensor, nans: torch.Tensor, hidden: torch.Tensor,
                 vocab: int) -> None:
        self.values = values
        self.columns = columns
        self.nans = nans
        self.hidden = hidden
        self.vocab = vocab


def top_of_logits(logits: torch.Tensor, width: int, hidden: torch.Tensor) -> TopLogits:
    """TopLogits taken from whole logits [rows, vocab] (a runner without a fused top-k), in its order."""
    nan = torch.isnan(logits)
    first = torch.where(nan.any(-1), nan.int().argmax(-1), -1)
    values, columns = logits.masked_fill(nan, float("-inf")).sort(dim=-1, descending=True, stable=True)
    return TopLogits(values[:, :width].contiguous(), columns[:, :width].contiguous(), first, hidden, logits.shape[-1])


class Runner(Protocol):
    engine: str  # "native" or "transformers", as start-up logs it
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    load_seconds: float
    packed: bool  # True: a batch's prompts cost their own tokens; False: rows x the longest (left padding)
    # Beams of one request share its prompt's cache (ours) or copy it into every beam (transformers):
    # admission counts a beam search's cache by this (engine/budget.py).
    shares_beam_prompts: bool
    kv_tokens: int  # tokens of cache an execution slot may hold (0: no budget set yet)
    caches_prefixes: bool  # a prefix cache serves its prefills (ours, with XLLM_PREFIX_CACHE=on)
    # What the beam calls' rows are: False, final hidden states that logits() runs the LM head over
    # (ours); True, the logits already (float32, [rows, vocab]), which logits() only selects
    # columns of (transformers computes its own LM head inside its forward).
    hidden_is_logits: bool
    # A ranking request's candidates go through the layers in its prompt's forward (score_prefill,
    # ours); False: a round per candidate token (beam_decode, transformers).
    packs_candidates: bool
    # decode_greedy() picks a step's greedy tokens without making its logits (ours, with our packed LM
    # head on CPU); False: it only takes decode()'s logits' argmax, and the engine takes decode().
    picks_greedy: bool
    # decode_top() gives a step's largest logits without making the rest (ours, with our packed LM head
    # on CPU, csrc/head_topk.cpp); False: the engine samples from decode()'s logits.
    picks_top: bool

    def match_prefix(self, prompt: list[int]) -> object:
        """Where caches_prefixes, at admission: the prompt's longest cached prefix, pinned (never evicted)
        until release_prefix(); its `tokens` are the prompt's tokens the prefill will not compute."""

    def release_prefix(self, hit) -> None:
        """A match_prefix() hit's prefill is over (done, failed or never to run): unpin it."""

    def set_kv_cache(self, total_bytes: int | None, slots: int, prefix_share: float = 0.0,
                     prefix_admit: str = "second") -> None:
        """Size the slots' key/value budget: total_bytes (None: the device's default) shared by the slots,
        less prefix_share of it for a prefix cache shared by them all (where the runner has one), which
        keeps a block on its second sight (prefix_admit "second") or every prompt's ("all")."""

    def warm_up(self, max_rows: int, thread_counts: set[int]) -> None:
        """At start-up on CPU: compile what traffic would otherwise meet first (a no-op where nothing is)."""

    def capture_graphs(self, max_rows: int, capture=None):
        """On a slot's thread at start-up: capture the forward as graphs for that thread, or None
        where the runner has none."""

    def prefill(self, prompts: list[list[int]], capacity: int = 0, into=None,
                between_layers: Callable[[], None] | None = None, hits: list | None = None) -> Prefilled:
        """Run the prompts; their last-position logits and, with capacity or into, their cache.
        between_layers (here and in every call that runs a forward): called after each decoder
        layer where the runner has layers of its own, so the engine's CPU core rule acts mid-forward.
        hits: each prompt's match_prefix() hit (or None: the runner looks it up itself); the caller
        releases them after the call."""

    def prefill_scored(self, prompts: list[list[int]], capacity: int, into, scored: list[int | None],
                       between_layers: Callable[[], None] | None = None, hits: list | None = None) -> Prefilled:
        """prefill(), and each prompt's PromptScores (model/scoring.py) where scored[i] is set."""

    def decode(self, kv, tokens: list[int], between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """One token per row of the cache; the next logits [rows, vocab]."""

    def decode_greedy(self, kv, tokens: list[int], between_layers: Callable[[], None] | None = None) -> list[int]:
        """decode(), and each row's greedy token: the argmax of its logits, the first on ties (sampling.py's
        argmax_rows), for a step that needs nothing else of them; where picks_greedy, without making
        the logits (ours: the LM head's fused pick, csrc/head_pick.cpp)."""

    def decode_top(self, kv, tokens: list[int], width: int, between_layers: Callable[[], None] | None = None,
                   ) -> TopLogits:
        """decode(), and each row's `width` largest logits (execution/top_sampling.py samples from them);
        where picks_top, without making the rest."""

    def beam_prefill(self, prompts: list[list[int]], widths: list[int], rounds: int,
                     between_layers: Callable[[], None] | None = None, hits: list | None = None) -> BeamPrefilled:
        """Each prompt once: a row per prompt for logits(), and the beams' state for beam_decode()."""

    def beam_decode(self, state, tokens: list[int], parents: list[int], widths: list[int],
                    between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """One token per live beam, each continuing the row `parents[i]` of the last round: a row per
        beam for logits() (as BeamPrefilled.hidden)."""

    def score_prefill(self, prompts: list[list[int]], candidates: list[tuple[list[int], list[int]]],
                      between_layers: Callable[[], None] | None = None, hits: list | None = None) -> BeamPrefilled:
        """Where packs_candidates: each prompt once and its candidates' given tokens after it, in one
        forward. candidates[i]: request i's rows as a tree (tokens, parents), parents[r] the row that
        row r continues (-1: the prompt), each row seeing its prompt, its ancestors and itself only;
        rows for logits(): each prompt's last, then every candidate row's."""

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, as_float: bool = True,
               columns: tuple[int, int] | None = None) -> torch.Tensor:
        """The beam calls' rows -> logits over the whole vocabulary, only these token ids, or the
        columns [start, end): the LM head, or where hidden_is_logits a selection of those columns."""

    def topk_logsumexp(self):
        """A fused top-k and log-sum-exp over a block of logits in the model's dtype (our CPU kernel,
        csrc/beam_topk.cpp), or None: beam rounds then take torch.topk and torch.logsumexp."""
