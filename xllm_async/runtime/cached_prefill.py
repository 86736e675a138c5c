"""The prefill's forward with a prefix cache (model/prefix_cache.py), as ModelRunner runs it: each
prompt's hit claimed, its cached prefix copied into its slab row where it has one, only the rest
computed, the new full blocks written into the store by the forward itself, and a batch whose own
prompts share a prefix the store lacks prefilled in turns, so that it is computed once. Without a
prefix cache, only the forward.

A mixin of ModelRunner (runner.py's contract stays there): it reads the runner's prefix_store,
kv_tokens, attention and device, and calls its _arena() and _forward().
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import contextmanager

import torch

from ..model.candidate_prefill import CandidatePrefill
from ..model.forward_context import PackedPrefill
from ..model.kv_cache import SlabCache
from ..model.prefix_cache import PrefixHit, span_marks
from ..model.shared_prefix import shared_split


class CachedPrefill:
    """ModelRunner's prefill rows, with or without a prefix cache (see the module's docstring)."""

    @property
    def caches_prefixes(self) -> bool:
        return self.prefix_store is not None

    def match_prefix(self, prompt: list[int]) -> PrefixHit:
        """Admission (BatchBudget.take): the prompt's longest cached prefix, pinned until release_prefix."""
        return self.prefix_store.match(prompt)

    def release_prefix(self, hit: PrefixHit) -> None:
        self.prefix_store.release(hit)

    @contextmanager
    def _claimed(self, prompts: list[list[int]], whole: list[bool] | None, held: list | None):
        """With a prefix cache, each prompt's hit (held[i] from admission, else matched now), pinned
        for the block's length and released after it, whatever happens inside; none without one."""
        store = self.prefix_store
        hits = store.claim(prompts, None, 0, whole, held) if store is not None else []
        try:
            yield hits
        finally:
            if hits:
                store.release_all(hits)

    def _slab_for_prefixes(self, lengths: list[int], hits: list[PrefixHit]) -> bool:
        """Whether prompts that need no cache of their own (one token each, a single beam round) get
        one anyway: where a prompt found a cached prefix, for it to be copied into, where this slot's
        arena holds them (admission counts it: BatchBudget.take). Their new blocks need none: the
        forward writes them into the store (prefix_cache.BlockWrites)."""
        return any(hit.blocks for hit in hits) and len(lengths) * max(lengths) <= self.kv_tokens

    def _admitted(self, hits: list[PrefixHit], slab_anyway: bool) -> set[int] | None:
        """The chain keys a batch's prefill may keep in the store (PrefixStore.admitted: those seen
        before, or shared by two of its prompts, or all where its prompts' keys go into a slab
        anyway; None: all), asked once a batch, before any turn."""
        return self.prefix_store.admitted(hits, slab_anyway) if hits else None

    def _turns(self, prompts: list[list[int]], cache: SlabCache | None, first: int, whole: list[bool] | None,
               between_layers: Callable[[], None] | None, hits: list[PrefixHit], kept: set[int] | None,
               ) -> tuple[torch.Tensor, PackedPrefill, list[int] | None]:
        """_prefill_rows, in turns where prompts of the batch share a prefix the store lacks
        (shared_prefix.shared_split): the first turn computes and stores it, the rest find it, looked
        up again (in a slab of their own where the batch has none), so the batch computes it once.
        kept: the whole batch's _admitted(), before any turn (a prefix its prompts share is kept)."""
        split = shared_split(prompts, hits) if hits and not (whole and any(whole)) else len(prompts)
        if split == len(prompts):
            return self._prefill_rows(prompts, cache, first, whole, between_layers, hits, kept=kept)
        hidden, _, cached = self._prefill_rows(prompts[:split], cache, first, None, between_layers, hits[:split],
                                               kept=kept)
        rest, lengths, first = prompts[split:], [len(p) for p in prompts[split:]], first + split
        with self._claimed(rest, None, None) as again:
            if cache is None and self._slab_for_prefixes(lengths, again):
                cache, first = SlabCache(self._arena(), len(rest), max(lengths)), 0
                cache.add_rows(lengths, max(lengths))
            more, ctx, more_cached = self._turns(rest, cache, first, None, between_layers, again, kept)
        return torch.cat([hidden, more]), ctx, cached + more_cached

    def _prefill_rows(self, prompts: list[list[int]], cache: SlabCache | None, first: int, whole: list[bool] | None,
                      between_layers: Callable[[], None] | None, hits: list[PrefixHit],
                      candidates: list[tuple[list[int], list[int]]] | None = None, kept: set[int] | None = None,
                      ) -> tuple[torch.Tensor, PackedPrefill, list[int] | None]:
        """The prompts' forward, their keys into rows first.. of cache (None: none kept), and each
        prompt's tokens served from the prefix cache (None without one). With a prefix cache (hits:
        _claimed's), each prompt's cached prefix goes into its row first (where it has one) and only
        the rest is computed; the forward writes their new full blocks into the store too, those
        `kept` (_admitted's; None: every one). candidates: fed after the prompts in the same forward
        (ModelRunner.score_prefill; never stored)."""
        store = self.prefix_store
        skips = [0] * len(prompts)
        if cache is not None and any(hit.blocks for hit in hits):
            for i, hit in enumerate(hits):
                store.load(hit, cache.slabs, first + i)
            skips = [hit.tokens for hit in hits]
        stored = store.reserve(prompts, hits, skips, kept) if store is not None else None
        try:
            ctx = PackedPrefill(self.attention, [len(p) - skip for p, skip in zip(prompts, skips)], self.device,
                                cache, first, whole, skips, stored)
            rest = [p[skip:] for p, skip in zip(prompts, skips)] if any(skips) else prompts
            tokens = list(itertools.chain.from_iterable(rest))
            if candidates is not None:
                ctx = CandidatePrefill(ctx, [len(p) for p in prompts], candidates, self.device)
                tokens += [t for fed, _ in candidates for t in fed]
            hidden = self._forward(tokens, ctx, between_layers)
        except BaseException:
            if stored is not None:  # (a prefill that failed keeps nothing)
                store.abandon(stored)
            raise
        if stored is not None:
            store.commit(stored)
        if cache is not None and hits:  # (rows whose prompts begin alike: decode reads one copy)
            cache.mark(first, prompts, [span_marks(hit.keys) for hit in hits])
        return hidden, ctx, (skips if store is not None else None)
