"""The prefix cache: prompts' keys and values kept after their prefill, so that a later prompt
that starts with the same tokens prefills only the rest (vLLM's automatic prefix caching).

A prompt is cut into blocks of BLOCK_TOKENS tokens. Block i is found by its chain key,
hash((block i-1's chain key, block i's token ids)): a block is found only where every token
before it is the same, so the longest cached prefix is the run of blocks found from the first.
Hash chains rather than a radix tree because a lookup is then one dictionary probe a block, and
a block's place in memory does not depend on which prompt stored it. A hit also compares the
block's token ids and its parent's chain key: a wrong hit would need two different prefixes whose
64-bit chain keys collide.

One store serves every execution slot (their threads look up and store concurrently): a pool of
blocks [layers, 2, blocks, BLOCK_TOKENS, kv_heads, head_dim] out of XLLM_KV_CACHE_BYTES,
evicted least recently used. On a CPU it may use whatever of the budget the slots' arenas have
not reached, and shrinks when they reach further (fit(): model/kv_budget.py). A batch's cache
stays a rectangle of per-sequence slabs (kv_cache.py): a hit's blocks are copied into the new
sequence's slab before its prefill. A prompt's new full blocks are kept on their second sight, or
at once where its keys go into a slab anyway (admitted(): seen_blocks.py; a one-token prompt that
never repeats writes nothing), taken before its prefill (reserve) and written by every layer
straight from the packed rows it computed (BlockWrites, called by PackedPrefill.attend), so a
prompt that keeps no cache of its own (one token out) needs no slab, and nothing is copied twice;
they are found once the prefill is done (commit). Laid out so, consecutive blocks are one run of
tokens in every layer, as the packed rows are (a plain copy, where head-major blocks made it a
transposing one, a third slower), and a prompt's blocks (taken together, in order) go to and from
its rows or slab in one copy a layer. A block is pinned, never evicted, from a request's admission
to the end of its prefill (BatchBudget.take), and while it is written.
A prompt always computes at least its last token (its logits are what the prefill is for), so at
most its first (length - 1) // BLOCK_TOKENS blocks come from the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .block_pool import BLOCK_TOKENS, BlockPool, BlockWrites, runs_of
from .kv_cache import SHARED_SPAN, KvLayout
from .seen_blocks import SeenBlocks


class PrefixHit:
    """One prompt's lookup: the chain key of each of its full blocks, and the store's blocks that
    hold its longest cached prefix (pinned until PrefixStore.release)."""

    __slots__ = ("keys", "blocks")

    def __init__(self, keys: list[int], blocks: list[int]) -> None:
        self.keys = keys
        self.blocks = blocks

    @property
    def tokens(self) -> int:
        """Tokens of the prompt its cached blocks hold."""
        return len(self.blocks) * BLOCK_TOKENS


def span_marks(keys: list[int]) -> list[int]:
    """A prompt's marks for SlabCache.mark, from its chain_keys: that of each whole SHARED_SPAN."""
    step = SHARED_SPAN // BLOCK_TOKENS
    return keys[step - 1::step]


def chain_keys(prompt: list[int]) -> list[int]:
    """The chain key of each full block of the prompt."""
    keys, parent = [], 0
    for start in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = hash((parent, tuple(prompt[start:start + BLOCK_TOKENS])))
        keys.append(parent)
    return keys


class PrefixStore:
    """Blocks of prompts' keys and values shared by every slot (see the module's docstring).
    Thread-safe: the index, pins and recency live under one lock; copies run outside it, on
    blocks pinned for them."""

    def __init__(self, layout: KvLayout, blocks: int, device: torch.device, admit: str = "second") -> None:
        self.layout = layout
        self.size = blocks  # the pool's blocks
        self.capacity = blocks  # those it may hold now (fit)
        self.device = device
        self.seen = SeenBlocks(blocks) if admit == "second" else None  # (admit "all": every block is kept)
        self._pool: BlockPool | None = None  # allocated by the first store
        self._lock = threading.Lock()
        self._index: dict[int, int] = {}  # chain key -> block
        self._recency: OrderedDict[int, None] = OrderedDict()  # indexed blocks, least recently used first
        self._pins = [0] * blocks
        self._identity: list[tuple | None] = [None] * blocks  # (chain key, parent key, token ids) of each block
        self._free: list[int] = []  # blocks below capacity that hold nothing
        self._fresh = 0  # blocks from here on were never taken (or were given back: fit)
        self._touched = 0  # blocks below this may hold pages (_trim gives back those from capacity up)

    @property
    def block_bytes(self) -> int:
        return BLOCK_TOKENS * self.layout.token_bytes

    @property
    def used(self) -> int:
        """Blocks that hold a prompt's keys."""
        return len(self._index)

    def match(self, prompt: list[int], look: bool = True) -> PrefixHit:
        """The prompt's chain keys and its longest cached prefix of at most (length - 1) // BLOCK_TOKENS
        blocks (none unless `look`), pinned. Release the hit once its blocks are copied."""
        keys = chain_keys(prompt)
        blocks: list[int] = []
        if not look:
            return PrefixHit(keys, blocks)
        with self._lock:
            parent = 0
            for i, key in enumerate(keys[:(len(prompt) - 1) // BLOCK_TOKENS]):
                block = self._index.get(key)
                if block is None or self._identity[block] != (key, parent,
                                                               tuple(prompt[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])):
                    break
                blocks.append(block)
                parent = key
            for block in reversed(blocks):  # (the first block the most recent: keep())
                self._recency.move_to_end(block)
                self._pins[block] += 1
        return PrefixHit(keys, blocks)

    def load(self, hit: PrefixHit, slabs: torch.Tensor, row: int) -> None:
        """Copy the hit's blocks into the first tokens of cache row `row` (slabs: SlabCache.slabs)."""
        for i, block, count in runs_of(list(enumerate(hit.blocks))):
            slabs[:, :, row, :, i * BLOCK_TOKENS:(i + count) * BLOCK_TOKENS] = self._blocks(block, count)

    def _blocks(self, block: int, count: int) -> torch.Tensor:
        """Blocks [block, block + count) of the pool as [layers, 2, kv_heads, tokens, head_dim] (a view)."""
        return self._pool.blocks[:, :, block:block + count].flatten(2, 3).transpose(2, 3)

    def keep(self, prompt: list[int], hit: PrefixHit, slabs: torch.Tensor, row: int) -> None:
        """After the prompt's prefill wrote its keys into cache row `row`: copy its full blocks that
        the store lacks into it, as far as blocks can be freed (pinned ones never are)."""
        writes = self.reserve([prompt], [hit], [0])
        try:
            for start, block, count in writes.runs:  # (one prompt, none skipped: its rows are its tokens)
                self._blocks(block, count).copy_(slabs[:, :, row, :, start:start + count * BLOCK_TOKENS])
        except BaseException:
            self.abandon(writes)
            raise
        self.commit(writes)

    def admitted(self, hits: list[PrefixHit], slab_anyway: bool = False) -> set[int] | None:
        """A batch's chain keys its prefill may keep (reserve's `kept`; None: all), the batch seen.
        slab_anyway: its prompts' keys go into a slot's cache whatever the store does (a beam search
        of several rounds, a generation of more tokens than one): then every block is kept on first
        sight. Second sight is for prompts whose only write is the store's, where a prompt that never
        repeats would pay a whole write for nothing; beside a slab's, the store's copy costs ~1% of
        the prefill, and a user's growing history is then found from its second request on."""
        if self.seen is None:
            return None
        kept = self.seen.admit([hit.keys for hit in hits])
        return None if slab_anyway else kept

    def populate(self) -> None:
        """Back the blocks it may hold now with memory at once (XLLM_KV_PREFAULT=on, at start-up)."""
        with self._lock:
            if self._pool_taken() is not None:
                self._pool.populate(self.capacity)
                self._touched = max(self._touched, self.capacity)

    def _pool_taken(self) -> BlockPool | None:
        """Its pool, allocated on first need (under the lock); None while it may hold nothing."""
        if self._pool is None and self.capacity:
            self._pool = BlockPool(self.layout, self.size, self.device)
        return self._pool

    def reserve(self, prompts: list[list[int]], hits: list[PrefixHit], skips: list[int],
                kept: set[int] | None = None) -> BlockWrites:
        """Before a prefill of these prompts packed end to end, prompt i from its token skips[i]
        on (hits[i].tokens, or 0 where its hit is not used): take a block for each of their full
        blocks that the store lacks (up to the first not `kept`, where given: admitted()), as far
        as blocks can be freed, for the forward to write (BlockWrites.write) and commit() to index;
        abandon() them if it fails."""
        with self._lock:
            self._pool_taken()
            wanted, start, taking = [], 0, self.capacity > 0
            for prompt, hit, skip in zip(prompts, hits, skips):
                for i in range(len(hit.blocks), len(hit.keys) if taking else 0):
                    if hit.keys[i] in self._index:
                        continue
                    if kept is not None and hit.keys[i] not in kept:  # (nor could its children be found)
                        break
                    block = self._take()
                    if block is None:
                        taking = False
                        break
                    self._pins[block] += 1  # (not indexed yet: no lookup finds it while it is written)
                    wanted.append((start + i * BLOCK_TOKENS - skip, hit.keys[i - 1] if i else 0, hit.keys[i],
                                   prompt[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS], block))
                start += len(prompt) - skip
        # The blocks in order of the rows they hold: as few runs to write as can be.
        blocks = sorted(entry[-1] for entry in wanted)
        wanted = [entry[:-1] + (block,) for entry, block in zip(wanted, blocks)]
        return BlockWrites(self._pool.blocks if self._pool is not None else None, wanted, hits)

    def fit(self, blocks: int) -> None:
        """Hold at most this many blocks from now on (KvBudget: what the slots' arenas leave). The
        blocks from there up are forgotten and their pages given back; one pinned (a prefill copies
        or writes it) keeps its pages until it is unpinned."""
        blocks = min(blocks, self.size)
        with self._lock:
            grows = blocks >= self.capacity
            self.capacity = blocks
            if grows:
                return
            for block in [b for b in self._recency if b >= blocks]:
                del self._recency[block]
                del self._index[self._identity[block][0]]
                self._identity[block] = None
            self._free = [b for b in self._free if b < blocks]
            self._fresh = min(self._fresh, blocks)
            self._trim()

    def _trim(self) -> None:
        """(Under the lock.) The pages of the blocks from capacity up back to the system, but for
        those up to the highest one still pinned."""
        if self._touched <= self.capacity:
            return
        low = self.capacity
        for block in range(self._touched - 1, self.capacity - 1, -1):
            if self._pins[block]:
                low = block + 1
                break
        if low < self._touched and self._pool is not None:
            self._pool.give_back(low, self._touched)
        self._touched = low

    def commit(self, writes: BlockWrites) -> None:
        """The forward wrote the reserved blocks: index them (a block another slot, or another prompt
        of the batch, stored meanwhile is freed), and each prompt's chain the most recent: its first
        block the most recent, its last the least, so that eviction takes a chain from its end (a
        block whose parent went is found by no lookup, and waits to be evicted)."""
        written = {}
        with self._lock:
            for _, parent, key, tokens, block in writes.blocks:
                self._pins[block] -= 1
                if block >= self.capacity:  # (the store shrank while the forward wrote it)
                    continue
                if key in self._index or key in written:
                    self._free.append(block)
                else:
                    written[key] = (block, (key, parent, tuple(tokens)))
            for hit in writes.hits:
                for key in reversed(hit.keys):
                    new = written.pop(key, None)
                    if new is not None:
                        block, self._identity[new[0]] = new
                        self._index[key] = block
                        self._recency[block] = None
                    elif (block := self._index.get(key)) is not None:
                        self._recency.move_to_end(block)
            self._trim()

    def abandon(self, writes: BlockWrites) -> None:
        """The prefill failed: its reserved blocks go back unindexed."""
        with self._lock:
            for *_, block in writes.blocks:
                self._pins[block] -= 1
                if block < self.capacity:
                    self._free.append(block)
            self._trim()

    def release(self, hit: PrefixHit) -> None:
        """The hit's blocks were copied: they may be evicted again."""
        self._pin(hit.blocks, -1)

    def _pin(self, blocks: list[int], by: int) -> None:
        if blocks:
            with self._lock:
                for block in blocks:
                    self._pins[block] += by
                self._trim()

    @property
    def pinned(self) -> int:
        """Blocks pinned now (0 whenever no prompt is admitted or being copied)."""
        return sum(1 for pins in self._pins if pins)

    def _take(self) -> int | None:
        """A block to write (under the lock): a free one, else a fresh one, else the least recently
        used unpinned one."""
        if self._free:
            return self._free.pop()
        while self._fresh < self.capacity:
            block = self._fresh
            self._fresh += 1
            # (A block above an earlier capacity that a prefill still pins, the store grown back past
            # it: skipped, for good, rather than written under that prefill.)
            if not self._pins[block]:
                self._touched = max(self._touched, block + 1)
                return block
        for block in self._recency:
            if not self._pins[block]:
                del self._recency[block]
                del self._index[self._identity[block][0]]
                self._identity[block] = None
                return block
        return None

    def claim(self, prompts: list[list[int]], slabs: torch.Tensor | None = None, first: int = 0,
              whole: list[bool] | None = None, held: list[PrefixHit | None] | None = None) -> list[PrefixHit]:
        """A batch's lookups, its prompts in cache rows first.. of slabs: each prompt's longest cached
        prefix (none for a prompt whose every position is scored: whole[i]), copied into its row
        where slabs are given (else load() them). held[i]: prompt i's hit as admission matched it
        (pinned again here; the caller releases its own pin), or None: matched here. Release them
        (release_all) once the prefill is done."""
        hits = []
        try:
            for i, prompt in enumerate(prompts):
                hit = held[i] if held is not None else None
                if hit is None:
                    hit = self.match(prompt, look=not (whole and whole[i]))
                else:
                    self._pin(hit.blocks, 1)
                hits.append(hit)
                if slabs is not None:
                    self.load(hit, slabs, first + i)
        except BaseException:
            self.release_all(hits)
            raise
        return hits

    def release_all(self, hits: list[PrefixHit]) -> None:
        for hit in hits:
            self.release(hit)
