"""A batch whose own prompts share a prefix the store lacks (issue 48): its prefill goes in turns,
the prompts before the first that would find that prefix first (they compute and store it), the
rest looked up again (runtime/cached_prefill.py), so that the batch computes it once. The store
keeps those blocks on their first sight too (seen_blocks.py: another prompt of the batch has them).
"""

from __future__ import annotations

from .prefix_cache import BLOCK_TOKENS, PrefixHit

# A batch's prefill is split for a prefix its own prompts share (shared_split) only where a later
# prompt would find at least this many more blocks: each turn is one more forward, whose fixed cost
# (every layer's calls) a few blocks' compute pays for.
MIN_SHARED_BLOCKS = 2


def shared_split(prompts: list[list[int]], hits: list[PrefixHit]) -> int:
    """Where a batch's prefill splits in two turns (len(prompts): none): the first prompt that would
    find MIN_SHARED_BLOCKS more blocks than its hit, had the prompts before it stored theirs. The
    prompts before it go first and store their blocks; it and those after it are looked up again."""
    computed: set[int] = set()  # chain keys the prompts so far store
    for j, (prompt, hit) in enumerate(zip(prompts, hits)):
        found = len(hit.blocks)
        more = 0
        for key in hit.keys[found:(len(prompt) - 1) // BLOCK_TOKENS]:
            if key not in computed:
                break
            more += 1
        if more >= MIN_SHARED_BLOCKS:
            return j
        computed.update(hit.keys[found:])
    return len(prompts)
