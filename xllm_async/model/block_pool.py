"""The prefix store's memory (model/prefix_cache.py): blocks [layers, 2, blocks, BLOCK_TOKENS,
kv_heads, head_dim], on a CPU the pages of those it no longer may hold given back, and a prefill's
writes into them."""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

from .kv_cache import KvLayout

# Tokens a block: a multiple of 16, so that a cached prefix ends on a whole vector of keys in
# our attention kernel (csrc/varlen_attention.cpp); small, so that a history that grew by a few
# tokens finds all but its last few tokens.
BLOCK_TOKENS = 32

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23  # (Linux 5.14; Python's mmap module does not name it before 3.13)


def page_bytes() -> int:
    """The page a touched byte of our anonymous memory may bring in whole: 2 MiB where transparent
    huge pages are not off, else the system's page."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            huge = "[never]" not in f.read()
    except OSError:  # not Linux
        huge = False
    return HUGE_PAGE if huge else mmap.PAGESIZE


def pool_slack(layout: KvLayout, page: int) -> int:
    """Bytes a pool may hold beyond its blocks: each layer's keys and each layer's values are a run
    of blocks of their own, and the page at each run's end is held whole however little is used."""
    return layout.layers * 2 * page


class BlockPool:
    """On a CPU, in an anonymous block advised for transparent huge pages: until the pool has
    filled once, every miss writes its blocks into pages never touched, and the kernel's faulting
    and zeroing of them cost more than the write itself (4 KiB pages: 2.5x a touched page's write
    for one-token misses of 320 tokens, perf/prefix_miss.py); 2 MiB pages, a quarter less. Not
    touched ahead: like the slots' arenas, it takes memory as it is used, and give_back() returns
    it. On an accelerator, torch's memory, allocated whole."""

    __slots__ = ("layout", "size", "blocks", "_memory", "_start")

    def __init__(self, layout: KvLayout, size: int, device: torch.device) -> None:
        self.layout = layout
        self.size = size
        shape = (layout.layers, 2, size, BLOCK_TOKENS, layout.kv_heads, layout.head_dim)
        self._memory: mmap.mmap | None = None
        self._start = 0
        if device.type != "cpu":
            self.blocks = torch.empty(shape, dtype=layout.dtype, device=device)
            return
        nbytes = math.prod(shape) * layout.dtype.itemsize
        self._memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._memory.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # not Linux, or no transparent huge pages: 4 KiB pages
            pass
        raw = torch.frombuffer(self._memory, dtype=torch.uint8)
        self._start = -raw.data_ptr() % HUGE_PAGE
        self.blocks = raw[self._start:self._start + nbytes].view(layout.dtype).view(shape)

    def populate(self, blocks: int) -> None:
        """Back blocks [0, blocks) with memory now (XLLM_KV_PREFAULT=on), so that no prefill pays for a
        page's first touch: the kernel's populate (Linux 5.14 on), else a byte a page rewritten with its
        own value. Nothing on an accelerator (allocated whole)."""
        if self._memory is None or blocks <= 0:
            return
        raw = torch.frombuffer(self._memory, dtype=torch.uint8)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for first, end in self._byte_runs(0, blocks):
            low = first // mmap.PAGESIZE * mmap.PAGESIZE
            if madvise(raw.data_ptr() + low, end - low, MADV_POPULATE_WRITE) != 0:  # (each page rewritten as it is)
                raw[first:end:mmap.PAGESIZE].add_(0)
                raw[end - 1:end].add_(0)

    def give_back(self, low: int, high: int) -> None:
        """The pages that lie wholly within blocks [low, high) back to the system (they read as
        zeros if touched again); nothing on an accelerator."""
        if self._memory is None:
            return
        page = mmap.PAGESIZE
        for first, end in self._byte_runs(low, high):
            first, end = -(-first // page) * page, end // page * page
            if end > first:
                self._memory.madvise(mmap.MADV_DONTNEED, first, end - first)

    def _byte_runs(self, low: int, high: int) -> list[tuple[int, int]]:
        """Where blocks [low, high) lie in the mapping: a byte range for each layer's keys and each
        layer's values (each a run of the pool's blocks in order)."""
        lay = self.layout
        part_bytes = BLOCK_TOKENS * lay.kv_heads * lay.head_dim * lay.dtype.itemsize  # a block of one layer's keys
        bases = [self._start + part * self.size * part_bytes for part in range(lay.layers * 2)]
        return [(base + low * part_bytes, base + high * part_bytes) for base in bases]


class BlockWrites:
    """A prefill's new full blocks, taken in the store (PrefixStore.reserve): each layer's keys and
    values go straight from the forward's packed rows into them, a copy a run of blocks that are
    consecutive both in the rows and in the store (one for a batch of whole-block prompts)."""

    __slots__ = ("pool", "blocks", "hits", "runs")

    def __init__(self, pool: torch.Tensor | None, blocks: list[tuple], hits: list) -> None:
        self.pool = pool
        self.blocks = blocks  # (first packed row, parent key, chain key, token ids, store block) of each
        self.hits = hits  # the prompts' PrefixHits (commit() orders their chains)
        self.runs = runs_of([(row, block) for row, *_, block in blocks], BLOCK_TOKENS)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's keys and values of the packed rows (k, v [rows, kv_heads, dim]) into the blocks."""
        if not self.runs:
            return
        keys, values = self.pool[layer, 0].flatten(0, 1), self.pool[layer, 1].flatten(0, 1)  # [tokens, kv_heads, dim]
        for row, block, count in self.runs:
            rows, start = count * BLOCK_TOKENS, block * BLOCK_TOKENS
            keys[start:start + rows] = k[row:row + rows]
            values[start:start + rows] = v[row:row + rows]


def runs_of(pairs: list[tuple[int, int]], step: int = 1) -> list[tuple[int, int, int]]:
    """(where a block of the prompt is, block of the store) pairs -> runs consecutive in both (the
    first `step` apart): (the first's place, first of the store, count)."""
    runs: list[tuple[int, int, int]] = []
    for i, block in pairs:
        if runs and runs[-1][0] + runs[-1][2] * step == i and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, block, 1))
    return runs
