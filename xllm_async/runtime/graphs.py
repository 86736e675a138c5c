"""A forward cut at attention, its pieces replayed from graphs captured once per bucket of rows.

On an accelerator a small model's forward is bound by the host: every operator is a kernel
launch paid in Python (perf/RESULTS.md, "GPU (H200)"). A graph replays a piece's kernels in one
call. Attention stays eager between the pieces, as in vLLM's piecewise graphs, so one set of
graphs serves every forward the engine runs: packed prefills of any lengths with or without a
cache, decode steps over caches of any shape, beam rounds. The pieces of a model of L layers:

    piece 0      the embedding, the rotary tables, layer 0 up to its q, k, v
    piece i      layer i-1 after attention, layer i up to its q, k, v
    piece L      layer L-1 after attention, the final norm

(a layer's two halves: llama.DecoderLayer.to_attention and after_attention, which the eager
forward runs too)

Each piece reads and writes static buffers (the rows, q, k, v, the attention output, the
rotary tables); a forward of n rows runs the pieces of the smallest bucket of at least n rows,
and the rows beyond n are padding whose outputs nobody reads (every operator in a piece treats
rows apart). The buckets' buffers are views of one buffer of the largest, and every piece of a
slot shares one memory pool: a slot runs one forward at a time, on its one stream.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

Capture = Callable[[Callable[[], None]], Callable[[], None]]  # a piece -> its replay


def buckets(max_rows: int) -> list[int]:
    """Row counts graphs are captured for, up to max_rows: powers of two up to 16 (decode
    steps), then 2 sizes a doubling up to 256 and 4 beyond (a prefill's padding at most 1/4 of
    its rows: there the kernels' own time is what counts)."""
    sizes, n = [], 1
    while n < 16:
        sizes.append(n)
        n *= 2
    while n < max_rows:
        per = 2 if n < 256 else 4
        sizes.extend(n + i * n // per for i in range(per))
        n *= 2
    sizes.append(n)
    return [s for s in sizes if s < max_rows] + [max_rows]


class PiecewiseGraphs:
    """One execution slot's graphs of one model (made and used on the slot's own thread)."""

    __slots__ = ("model", "sizes", "pieces", "tokens", "positions", "rows", "q", "k", "v", "attn", "cos", "sin",
                 "out", "capture_seconds")

    def __init__(self, model, device: torch.device, max_rows: int) -> None:
        self.model = model
        self.sizes = buckets(max_rows)
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.capture_seconds = 0.0
        shape, dtype = model.shape, model.embed.weight.dtype
        top = self.sizes[-1]
        self.tokens = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.rows = torch.zeros(top, shape.hidden, dtype=dtype, device=device)  # the residual stream
        self.q = torch.zeros(top, shape.heads, shape.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(top, shape.kv_heads, shape.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros(top, shape.heads * shape.head_dim, dtype=dtype, device=device)
        cos, sin = model.rotary.lookup(self.positions, dtype, model.fused)
        self.cos, self.sin = torch.zeros_like(cos), torch.zeros_like(sin)
        self.out = torch.zeros(top, shape.hidden, dtype=dtype, device=device)

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket of at least `rows` rows (None: beyond the largest)."""
        at = bisect.bisect_left(self.sizes, rows)
        return self.sizes[at] if at < len(self.sizes) else None

    def capture(self, capture: Capture) -> None:
        """Run every piece of every bucket once (kernels pick their algorithms and workspaces
        for these shapes), then capture it. Largest first: the pool is sized at the first."""
        started = time.monotonic()
        for size in reversed(self.sizes):
            pieces = [self._piece(i, size) for i in range(len(self.model.layers) + 1)]
            for piece in pieces:
                piece()
            self.pieces[size] = [capture(piece) for piece in pieces]
        self.capture_seconds = time.monotonic() - started

    def forward(self, tokens: torch.Tensor, ctx) -> torch.Tensor:
        """The model's forward of these token rows (ctx: a forward context, model/forward_context.py):
        the final hidden states of every row, [rows, hidden], a view of this object's buffer
        (valid until its next forward). ctx.last is the caller's to apply."""
        n = tokens.shape[0]
        pieces = self.pieces[self.bucket(n)]
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions[:n].copy_(ctx.positions, non_blocking=True)
        q, k, v, attn = self.q[:n], self.k[:n], self.v[:n], self.attn[:n]
        pieces[0]()
        for i, layer in enumerate(self.model.layers):
            attn.copy_(ctx.attend(i, q, k, v, layer.attn.scale))
            pieces[i + 1]()
        return self.out[:n]

    def _piece(self, index: int, size: int) -> Callable[[], None]:
        """Piece `index` over the first `size` rows of the buffers (the module's docstring)."""
        model, layers = self.model, self.model.layers
        rows, attn, cos, sin = self.rows[:size], self.attn[:size], self.cos[:size], self.sin[:size]
        q, k, v = self.q[:size], self.k[:size], self.v[:size]

        def to_attention(layer: int, x: torch.Tensor) -> None:
            rows.copy_(x)
            qn, kn, vn = layers[layer].to_attention(x, cos, sin)
            q.copy_(qn)
            k.copy_(kn)
            v.copy_(vn)

        def first() -> None:
            x = model.embed(self.tokens[:size])
            c, s = model.rotary.lookup(self.positions[:size], x.dtype, model.fused)
            cos.copy_(c)
            sin.copy_(s)
            to_attention(0, x)

        def after(layer: int) -> torch.Tensor:
            return layers[layer].after_attention(rows, attn)

        def middle() -> None:
            to_attention(index, after(index - 1))

        def last() -> None:
            self.out[:size].copy_(model.norm(after(index - 1)))

        if index == 0:
            return first
        return last if index == len(layers) else middle
