"""Key/value storage: one arena per execution slot, allocated once; a batch's
cache is a rectangular view of it (rows x capacity tokens), written in place.

Why a rectangle of per-sequence slabs and not pages: on a CPU, decode attention
over a slab is a view (no gather), so a step reads each cached key once. A row
keeps its slab for its whole life; rows that finish are replaced by the last
live row (one row copied), so the live rows are always the first `rows`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch


class KvLayout:
    """The shape facts of one model's cache: what a token costs."""

    __slots__ = ("layers", "kv_heads", "head_dim", "dtype")

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype

    @property
    def token_elements(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim

    @property
    def token_bytes(self) -> int:
        return self.token_elements * torch.empty((), dtype=self.dtype).element_size()


class KvArena:
    """The cache memory of one execution slot: `tokens` token slots, allocated on
    first use by that slot's thread and reused by every batch it runs.

    On a CPU the buffer's pages are touched only as batches use them: `reached` is how far any
    view went, and on_reach(arena, tokens) hears of each new reach before the view is written
    (KvBudget: the prefix store gives those bytes back)."""

    __slots__ = ("layout", "tokens", "device", "allocate", "on_reach", "reached", "_buffer", "__weakref__")

    def __init__(self, layout: KvLayout, tokens: int, device: torch.device,
                 allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None,
                 on_reach: Callable[[KvArena, int], None] | None = None) -> None:
        self.layout = layout
        self.tokens = tokens
        self.device = device
        # allocate(elements, dtype): the 1-d buffer (on CPU, huge pages: runtime/host_memory.host_tensor);
        # None: torch.empty on the device
        self.allocate = allocate
        self.on_reach = on_reach
        self.reached = 0  # tokens from the arena's start that some view covered
        self._buffer: torch.Tensor | None = None

    def view(self, row_capacity: int, capacity: int, start: int = 0) -> torch.Tensor:
        """[layers, 2, row_capacity, kv_heads, capacity, head_dim] over the arena from token `start`
        (a beam batch's own tokens lie after its prompts': BeamState)."""
        end = start + row_capacity * capacity
        if end > self.tokens:
            raise MemoryError(f"a cache of {row_capacity} x {capacity} tokens from token {start} exceeds "
                              f"the slot's {self.tokens}")
        if end > self.reached:
            self.reached = end
            if self.on_reach is not None:
                self.on_reach(self, end)
        if self._buffer is None:
            lay = self.layout
            elements = self.tokens * lay.token_elements
            self._buffer = (self.allocate(elements, lay.dtype) if self.allocate is not None
                            else torch.empty(elements, dtype=lay.dtype, device=self.device))
        lay = self.layout
        first = start * lay.token_elements
        size = row_capacity * capacity * lay.token_elements
        return self._buffer[first:first + size].view(lay.layers, 2, row_capacity, lay.kv_heads, capacity,
                                                     lay.head_dim)


# A decode step reads a row's keys in spans of this many (csrc/decode_keys.h kChunk); rows that
# share a prompt's prefix share it in whole spans (SlabCache.sharing).
SHARED_SPAN = 512


class SlabCache:
    """The cache of one batch: `rows` live sequences, each with `lengths[row]`
    tokens stored in its slab of `capacity` tokens.

    Rows whose prompts begin alike (a system prompt, found in the prefix cache) hold equal copies
    of that prefix's keys; `sharing` tells a decode step's attention to read one copy of it for all
    of them, a prefix read from memory once a layer rather than once a row (mark)."""

    __slots__ = ("arena", "slabs", "rows", "lengths", "_max_length", "marks", "prompts", "sharing")

    def __init__(self, arena: KvArena, row_capacity: int, capacity: int) -> None:
        self.arena = arena
        self.slabs = arena.view(row_capacity, capacity)
        self.rows = 0
        self.lengths = torch.zeros(row_capacity, dtype=torch.long, device=arena.device)
        self._max_length = 0
        # Each row's marks: the chain key (prefix_cache.chain_keys) of its prompt's first
        # SHARED_SPAN * (i + 1) tokens at i; none where unknown (no prefix cache). And its prompt,
        # which a shared prefix's tokens are compared against (two prompts' keys may collide).
        self.marks: list[list[int]] = []
        self.prompts: list[list[int]] = []
        # int64 [2, rows] on the CPU: each row's source row, then the keys [0, n) it reads from the
        # source's copy (csrc/decode_attend.h); None where no row shares.
        self.sharing: torch.Tensor | None = None

    @property
    def row_capacity(self) -> int:
        return self.slabs.shape[2]

    @property
    def capacity(self) -> int:
        return self.slabs.shape[4]

    @property
    def max_length(self) -> int:
        return self._max_length

    def keys(self, layer: int) -> torch.Tensor:
        return self.slabs[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.slabs[layer, 1]

    def add_rows(self, lengths: list[int], need_capacity: int) -> int:
        """Claim rows for new sequences of these lengths (their keys are written by
        the prefill) that will grow to need_capacity tokens at most; returns the
        first new row. Grows the rectangle when needed."""
        first = self.rows
        need_rows = first + len(lengths)
        if need_rows > self.row_capacity or need_capacity > self.capacity:
            capacity = max(need_capacity, self.capacity)
            # Room for as many rows again (continuous batches keep growing), as far as the arena allows.
            rows = max(need_rows, min(2 * self.row_capacity, self.arena.tokens // capacity))
            self._reshape(rows, capacity)
        self.lengths[first:need_rows] = torch.tensor(lengths, dtype=torch.long)
        self.rows = need_rows
        self._max_length = max(self._max_length, max(lengths))
        self.marks[first:] = [[] for _ in lengths]
        self.prompts[first:] = [[] for _ in lengths]
        self._share()
        return first

    def mark(self, first: int, prompts: list[list[int]], marks: list[list[int]]) -> None:
        """Rows first.. now hold these prompts' keys, whose prefixes have these marks (each prompt's
        prefix_cache.span_marks). Equal marks and tokens: their keys are equal copies where
        one row's came from the prefix cache's blocks that the other computed or also found, and
        where neither did, two computations of the same tokens, either one what a prefix cache
        hit would have given."""
        self.marks[first:first + len(marks)] = marks
        self.prompts[first:first + len(prompts)] = prompts
        self._share()

    def _share(self) -> None:
        """sharing, from the rows' marks: each row reads its longest marked prefix that an earlier
        row also has (the same tokens, not only the same key) from the first row that has it."""
        owners: dict[int, int] = {}
        sources, shared = list(range(self.rows)), [0] * self.rows
        for row, marks in enumerate(self.marks):
            for depth in range(len(marks) - 1, -1, -1):
                owner, tokens = owners.get(marks[depth]), (depth + 1) * SHARED_SPAN
                if owner is not None and self.prompts[owner][:tokens] == self.prompts[row][:tokens]:
                    sources[row], shared[row] = owner, tokens
                    break
            for mark in marks:
                owners.setdefault(mark, row)
        self.sharing = torch.tensor([sources, shared], dtype=torch.long) if any(shared) else None

    def step(self) -> None:
        """Every live row gained one token (a decode step wrote it)."""
        self.lengths[:self.rows] += 1
        self._max_length += 1

    def ensure_room(self) -> None:
        """Room for one more token in every row; admission sizes batches so that this
        only grows the rectangle when the arena has the room."""
        if self._max_length >= self.capacity:
            self._reshape(self.row_capacity, self.capacity * 2)
            if self._max_length >= self.capacity:
                raise MemoryError(f"the slot's key/value cache ({self.arena.tokens} tokens) is full")

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order, as rows 0..len-1. Where no row moves onto a place
        that another moving row leaves (execution/batch.py fill_order's orders), only the moving
        rows are copied, their stored tokens alone, not the batch's whole rectangle through a
        gathered copy."""
        moved = [(to, row) for to, row in enumerate(rows) if to != row]
        if moved:
            index = torch.tensor(rows, device=self.slabs.device)
            if {to for to, _ in moved}.isdisjoint(row for _, row in moved):
                for to, row in moved:
                    stored = int(self.lengths[row])
                    self.slabs[:, :, to, :, :stored] = self.slabs[:, :, row, :, :stored]
            else:
                self.slabs[:, :, :len(rows)] = self.slabs[:, :, index]
            self.lengths[:len(rows)] = self.lengths[index]
        self.rows = len(rows)
        self._max_length = int(self.lengths[:self.rows].max()) if self.rows else 0
        self.marks = [self.marks[row] for row in rows]
        self.prompts = [self.prompts[row] for row in rows]
        self._share()

    def _reshape(self, row_capacity: int, capacity: int) -> None:
        # The arena is one buffer: copy what lives out, re-view it, copy back (only when a
        # batch outgrows its rectangle, never per step).
        capacity = min(capacity, self.arena.tokens // row_capacity)
        if capacity < self._max_length:
            raise MemoryError(f"the slot's key/value cache ({self.arena.tokens} tokens) is full")
        old = self.slabs[:, :, :self.rows, :, :self._max_length].clone()
        lengths = self.lengths[:self.rows].clone()
        self.slabs = self.arena.view(row_capacity, capacity)
        self.slabs[:, :, :self.rows, :, :self._max_length] = old
        self.lengths = torch.zeros(row_capacity, dtype=torch.long, device=self.arena.device)
        self.lengths[:self.rows] = lengths


class BeamState:
    """The caches of a batch of beam requests: each prompt's keys once (a SlabCache
    row per request), and `own` [layers, 2, beams, kv_heads, rounds - 1, dim] for
    the tokens the beams generated, both in the slot's arena (own None with a single
    round, and prompts too unless a prefix cache needs their slabs). Reordering beams
    moves only `own`.

    widths/starts: the rows each request had in the last round fed (one, its
    prompt, after the prefill).
    """

    __slots__ = ("prompts", "lengths", "widths", "starts", "own", "step")

    def __init__(self, prompts: SlabCache | None, lengths: list[int], own: torch.Tensor | None) -> None:
        self.prompts = prompts
        self.lengths = lengths
        self.widths = [1] * len(lengths)
        self.starts = list(range(len(lengths) + 1))
        self.own = own
        self.step = 0  # own tokens every beam has stored

    def follow(self, parents: list[int], widths: list[int]) -> None:
        """The new beams continue these rows of the last round: their own keys move with them."""
        if self.step and parents != list(range(len(parents))):
            index = torch.tensor(parents, device=self.own.device)
            self.own[:, :, :len(parents), :, :self.step] = self.own[:, :, index, :, :self.step]
        self.widths = widths
        self.starts = list(itertools.accumulate(widths, initial=0))

    def keep(self, requests: list[int]) -> None:
        """Keep only these requests (indices, in order): their prompt rows and their beams."""
        rows = [b for r in requests for b in range(self.starts[r], self.starts[r + 1])]
        if self.prompts is not None:
            self.prompts.select(requests)
        if self.step and rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.own.device)
            self.own[:, :, :len(rows), :, :self.step] = self.own[:, :, index, :, :self.step]
        self.lengths = [self.lengths[r] for r in requests]
        self.widths = [self.widths[r] for r in requests]
        self.starts = list(itertools.accumulate(self.widths, initial=0))
