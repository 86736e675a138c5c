"""XLLM_KV_CACHE_BYTES shared by the slots' arenas and the prefix store (issue 48, item 4).

Every slot's arena is as large as it would be with no prefix cache, so a batch that fits without
the cache fits with it. On a CPU an arena's pages are touched only as far as its batches' views
reach (kv_cache.KvArena.reached), and the store's only as far as it has taken blocks: the store
may hold whatever the arenas have not reached, and gives blocks back (evicting them, their pages
returned to the system) whenever an arena reaches further. Pages are held whole (2 MiB ones where
transparent huge pages are on): an arena's last, and the store's at the end of each layer's keys
and values, are counted whole. So the process never holds more key/value memory than the budget
(beyond, for the length of one prefill, the blocks that prefill pins), the store holds
nothing a running request needs, and a slot never waits for the store.

An arena's reach only grows: a slot that once ran a large beam batch keeps those pages for the
next one (touching them again would cost more than the copy the store saves).

On an accelerator memory is allocated whole, not touched as used: there the store keeps a fixed
share (ModelRunner.set_kv_cache), and no KvBudget is made.
"""

from __future__ import annotations

import threading
import weakref

from .block_pool import page_bytes, pool_slack
from .kv_cache import KvArena
from .prefix_cache import PrefixStore


class KvBudget:
    """The budget's bytes, the arenas' reach, and the store that has what is left (see the
    module's docstring). Thread-safe: each slot's thread reaches on its own."""

    def __init__(self, total_bytes: int, store: PrefixStore) -> None:
        self.total = total_bytes
        self.store = store
        # Pages are held whole: an arena's last page, and the store's at the end of each layer's run.
        self.page = page_bytes()
        self.store_slack = pool_slack(store.layout, self.page)
        self._reached: weakref.WeakKeyDictionary[KvArena, int] = weakref.WeakKeyDictionary()  # bytes an arena reached
        self._lock = threading.Lock()
        store.fit(self.store_room() // store.block_bytes)

    def reach(self, arena: KvArena, tokens: int) -> None:
        """KvArena.on_reach: the arena's views now cover its first `tokens` tokens; the store fits
        in what is left, before the slot writes them."""
        with self._lock:  # (the store's fit under it: two reaches never shrink it out of order)
            self._reached[arena] = tokens * arena.layout.token_bytes
            self.store.fit(self.store_room() // self.store.block_bytes)

    def store_room(self) -> int:
        """Bytes the store may hold now."""
        arenas = sum(self._reached.values()) + self.page * len(self._reached)
        return max(0, self.total - arenas - self.store_slack)
