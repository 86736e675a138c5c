"""Linear weights kept quantized, in GGUF's 32-wide blocks (issue 39): Q8_0, Q4_0 and Q4_1, read
from a GGUF file as they ship or made at load from a plain weight (XLLM_QUANTIZATION=int8 is Q8_0:
one float16 scale per 32 weights of a row). A row's block b holds its inputs [32 b, 32 b + 32):

- q8_0: w = d * q, q int8
- q4_0: w = d * (q - 8), q a 4-bit unsigned
- q4_1: w = d * q + m, q a 4-bit unsigned

This module is the format and its reference arithmetic (dequantize, then a float linear); the
fast kernels over the packed blocks live beside it and must give the same answers within float
rounding."""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
# bytes a block of 32 weights takes in a GGUF file: float16 d [, float16 m], then the quants
BLOCK_BYTES = {"q8_0": 2 + 32, "q4_0": 2 + 16, "q4_1": 2 + 2 + 16}
FORMATS = tuple(BLOCK_BYTES)


class QuantWeight:
    """A [out_features, in_features] weight in blocks of 32 inputs.

    scales: float16 [out, in/32]; mins: float16 [out, in/32] (q4_1 only, else None);
    quants: q8_0 int8 [out, in/32, 32]; q4_0/q4_1 uint8 [out, in/32, 16], GGUF's nibble order
    (byte j holds input j in its low half and input j + 16 in its high half)."""

    __slots__ = ("kind", "out_features", "in_features", "scales", "mins", "quants")

    def __init__(self, kind: str, scales: torch.Tensor, mins: torch.Tensor | None, quants: torch.Tensor) -> None:
        if kind not in BLOCK_BYTES:
            raise ValueError(f"unknown quantized format {kind!r}; known: {', '.join(FORMATS)}")
        self.kind = kind
        self.scales, self.mins, self.quants = scales, mins, quants
        self.out_features, blocks = scales.shape
        self.in_features = blocks * BLOCK

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, in_features: int) -> QuantWeight:
        """From a GGUF tensor's bytes (uint8, out_features x in_features / 32 blocks)."""
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
        blocks = in_features // BLOCK
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, blocks, BLOCK_BYTES[kind])
        scales = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16)[..., 0])
        mins = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16)[..., 0]) if kind == "q4_1" else None
        start = 4 if kind == "q4_1" else 2
        quants = raw[:, :, start:].copy()
        quants = torch.from_numpy(quants.view(np.int8) if kind == "q8_0" else quants)
        return cls(kind, scales, mins, quants)

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str = "q8_0") -> QuantWeight:
        """A plain [out, in] weight rounded into blocks (as llama.cpp's quantizer does)."""
        out_features, in_features = weight.shape
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
        w = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
        if kind == "q8_0":
            d = w.abs().amax(-1) / 127
            q = torch.where(d[..., None] > 0, w / d[..., None].clamp_min(1e-30), 0).round().clamp(-127, 127)
            return cls(kind, d.half(), None, q.to(torch.int8))
        if kind == "q4_0":
            # d from the value of largest magnitude, signed, as llama.cpp: it maps to -8
            top = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]
            d = top / -8
            q = (w / d[..., None].where(d[..., None] != 0, torch.ones(()))).add(8.5).floor().clamp(0, 15)
            return cls(kind, d.half(), None, _pack_nibbles(q))
        if kind == "q4_1":
            low, high = w.amin(-1), w.amax(-1)
            d = (high - low) / 15
            q = ((w - low[..., None]) / d[..., None].where(d[..., None] != 0, torch.ones(()))).add(0.5).floor()
            return cls(kind, d.half(), low.half(), _pack_nibbles(q.clamp(0, 15)))
        raise ValueError(f"unknown quantized format {kind!r}; known: {', '.join(FORMATS)}")

    def rows(self, order: torch.Tensor | slice) -> QuantWeight:
        """The output rows in `order` (GGUF stores Llama's q/k rows permuted; fused layers stack parts)."""
        mins = self.mins[order] if self.mins is not None else None
        return QuantWeight(self.kind, self.scales[order], mins, self.quants[order])

    @staticmethod
    def stack(parts: list[QuantWeight]) -> QuantWeight:
        """Parts of one format stacked by output rows (q, k, v -> qkv; gate, up -> gate_up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of different formats: {sorted(kinds)}")
        first = parts[0]
        mins = torch.cat([p.mins for p in parts]) if first.mins is not None else None
        return QuantWeight(first.kind, torch.cat([p.scales for p in parts]), mins,
                           torch.cat([p.quants for p in parts]))

    @property
    def nbytes(self) -> int:
        """Bytes the blocks take (as in the file)."""
        return self.out_features * (self.in_features // BLOCK) * BLOCK_BYTES[self.kind]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The plain [out, in] weight."""
        if self.kind == "q8_0":
            q = self.quants.float()
        else:
            q = torch.cat([(self.quants & 0xF), (self.quants >> 4)], dim=-1).float()
            if self.kind == "q4_0":
                q = q - 8
        w = q * self.scales.float()[..., None]
        if self.mins is not None:
            w = w + self.mins.float()[..., None]
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias), in x's dtype: what layers.Linear calls for a quantized weight."""
        return self.reference_linear(x, bias)

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias) in float32, returned in x's dtype: what the kernels must match."""
        out = torch.nn.functional.linear(x.float(), self.dequantize(), None if bias is None else bias.float())
        return out.to(x.dtype)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..15 -> [..., 16] bytes, GGUF's order (low halves: inputs 0-15)."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)
