"""The prefix cache's admission (issue 48): a block is kept in the store only on its second sight
(TinyLFU's doorkeeper). Where nothing repeats, every prompt's blocks were written into the store
and never read again, and those bytes (2 KiB a token for a small model, into pages the kernel
zeroes first) were the whole in-process cost of the cache on a miss; a block that was never seen
before is not worth them. So a prefill keeps a block only where its chain key (prefix_cache.
chain_keys) was seen by an earlier prefill, or another prompt of the same batch has it (a batch
whose prompts share a prefix computes it once: shared_prefix.shared_split's first turn stores it
for the rest). Every prompt's keys are then remembered as seen.

The memory is bounded: as many keys as the store has blocks (a key seen once longer ago than the
store's worth of blocks would have been evicted from it anyway), the oldest forgotten first; O(1)
a key. A prompt's keys are remembered last block first, so that its first block is the most recent
and a chain is forgotten from its end: a block is then remembered only while its parents are.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class SeenBlocks:
    """The chain keys of the blocks prefills saw recently, at most `capacity` of them (see the
    module's docstring). Thread-safe: the slots' prefills admit concurrently."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()  # least recently seen first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def admit(self, chains: list[list[int]]) -> set[int]:
        """A batch's prompts' chain keys (each prompt's, in order): those its prefill may keep (seen
        by an earlier prefill, or by another of these prompts); all of them are remembered."""
        kept: set[int] = set()
        with self._lock:
            seen = self._keys
            for keys in chains:
                for key in reversed(keys):
                    if key in seen:  # (before, or an earlier prompt of this batch)
                        kept.add(key)
                        seen.move_to_end(key)
                        continue
                    seen[key] = None
                    if len(seen) > self.capacity:
                        seen.popitem(last=False)
        return kept
