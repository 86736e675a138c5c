"""Linear weights kept quantized, in GGUF's 32-wide blocks (issue 39): Q8_0, Q4_0 and Q4_1, read
from a GGUF file as they ship or made at load from a plain weight (XLLM_QUANTIZATION=int8 is Q8_0:
one float16 scale per 32 weights of a row). A row's block b holds its inputs [32 b, 32 b + 32):

- q8_0: w = d * q, q int8
- q4_0: w = d * (q - 8), q a 4-bit unsigned
- q4_1: w = d * q + m, q a 4-bit unsigned

This module is the format and its reference arithmetic (dequantize, then a float linear). The
fast kernel (csrc/quant_linear.cpp) reads the blocks repacked once (QuantWeight.packed) and rounds
the activations to int8 blocks as llama.cpp does, so it matches the reference within that
rounding; on a CPU with AMX, a prompt's bfloat16 rows (24 and more) go through bfloat16 tiles over
the blocks widened to bfloat16 instead (what our bfloat16 linear gives on dequantize(bfloat16)).
QuantWeight.linear takes it where it built and passed that check (kernel_verified)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from . import cpu_kernels

log = logging.getLogger("xllm_async.quantized")

BLOCK = 32
# bytes a block of 32 weights takes in a GGUF file: float16 d [, float16 m], then the quants
BLOCK_BYTES = {"q8_0": 2 + 32, "q4_0": 2 + 16, "q4_1": 2 + 2 + 16}
FORMATS = tuple(BLOCK_BYTES)


class QuantWeight:
    """A [out_features, in_features] weight in blocks of 32 inputs.

    scales: float16 [out, in/32]; mins: float16 [out, in/32] (q4_1 only, else None);
    quants: q8_0 int8 [out, in/32, 32]; q4_0/q4_1 uint8 [out, in/32, 16], GGUF's nibble order
    (byte j holds input j in its low half and input j + 16 in its high half)."""

    __slots__ = ("kind", "out_features", "in_features", "scales", "mins", "quants", "_packed")

    def __init__(self, kind: str, scales: torch.Tensor, mins: torch.Tensor | None, quants: torch.Tensor) -> None:
        if kind not in BLOCK_BYTES:
            raise ValueError(f"unknown quantized format {kind!r}; known: {', '.join(FORMATS)}")
        self.kind = kind
        self.scales, self.mins, self.quants = scales, mins, quants
        self.out_features, blocks = scales.shape
        self.in_features = blocks * BLOCK
        self._packed: torch.Tensor | None = None

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
        if self.quants is None:
            raise ValueError("this weight kept only its packed blocks (settle): take columns() of it")
        mins = self.mins[order] if self.mins is not None else None
        return QuantWeight(self.kind, self.scales[order], mins, self.quants[order])

    def columns(self, start: int, end: int) -> QuantWeight:
        """Output columns [start, end) as a weight of their own (a beam search's block of the
        vocabulary): from a packed group's start, a view of the packed blocks, nothing copied or
        packed again; elsewhere rows() (packed at its first linear)."""
        if start % GROUP_COLUMNS or not 0 <= start < end <= self.out_features:
            return self.rows(slice(start, end))
        part = QuantWeight.__new__(QuantWeight)
        part.kind, part.in_features, part.out_features = self.kind, self.in_features, end - start
        part.scales = part.mins = part.quants = None
        if self.quants is not None:
            part.scales, part.quants = self.scales[start:end], self.quants[start:end]
            part.mins = self.mins[start:end] if self.mins is not None else None
        part._packed = self.packed[start // GROUP_COLUMNS:-(-end // GROUP_COLUMNS)]
        return part

    def settle(self) -> None:
        """Pack now and, where our kernel serves, drop the file's layout: a weight then holds its
        blocks once (the file's bytes, padded to whole groups). Where the reference serves, nothing
        is dropped (it de-quantizes from the file's layout)."""
        if self.quants is not None and kernel_verified():
            self.packed  # noqa: B018  (packs it)
            self.scales = self.mins = self.quants = None

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
        """x [..., in] @ W.T (+ bias), in x's dtype: what layers.Linear calls for a quantized weight.
        Our kernel for bfloat16 or float32 rows on a CPU where it verified, else the reference.
        (A decode step makes this call 121 times: the kernel's path is kept to a few checks.)"""
        ok = _kernel_ok if _kernel_ok is not None else kernel_verified()
        if not ok or x.dtype not in _KERNEL_DTYPES or x.device.type != "cpu":
            return self.reference_linear(x, bias)
        packed = self._packed if self._packed is not None else self.packed
        if x.dim() == 2:  # (the kernel checks the width against the packed blocks)
            return torch.ops.xllm.quant_linear(x, packed, self.kind, bias, self.out_features)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"rows of {x.shape[-1]} inputs into a weight of {self.in_features}")
        out = torch.ops.xllm.quant_linear(x.reshape(-1, self.in_features), packed, self.kind, bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def packed(self) -> torch.Tensor:
        """The blocks as our kernel reads them (csrc/quant_linear.cpp: tiles of 16 output columns in
        groups of four), uint8 [groups, in/32, a group's block]; made on first use, the same bytes."""
        if self._packed is None:  # (two threads at once make it twice, the same)
            self._packed = _pack(self)
        return self._packed

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias) in float32, returned in x's dtype: what the kernels must match."""
        out = torch.nn.functional.linear(x.float(), self.dequantize(), None if bias is None else bias.float())
        return out.to(x.dtype)


_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
TILE = 16  # output columns a packed tile interleaves (one int32 lane each)
TILES_IN = 4  # tiles a group interleaves block by block (the kernel's widest step); zero columns pad
GROUP_COLUMNS = TILE * TILES_IN


def _pack(w: QuantWeight) -> torch.Tensor:
    """A group's block: its 64 columns' float16 d (then their m), then each tile's quants four inputs
    a lane: Q8_0 shifted to unsigned (q + 128), vector g holding inputs 4g..4g+3 of the tile's 16
    columns; Q4 as GGUF's bytes, vector v holding bytes 4v..4v+3 (inputs 4v.. low, 16+4v.. high)."""
    columns = -(-w.out_features // (TILE * TILES_IN)) * TILE * TILES_IN
    groups, blocks = columns // (TILE * TILES_IN), w.in_features // BLOCK

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [out, blocks, lanes, size] -> [groups, blocks, bytes]
        t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 0, 0, columns - w.out_features))
        t = t.view(groups, TILES_IN, TILE, blocks, *t.shape[2:]).permute(0, 3, 1, 4, 2, 5)
        return t.contiguous().view(groups, blocks, -1).view(torch.uint8)

    quants = w.quants.view(torch.uint8)
    if w.kind == "q8_0":
        quants = quants ^ 0x80
    scales = [w.scales] + ([w.mins] if w.mins is not None else [])
    parts = [grouped(s.view(w.out_features, blocks, 1, 1)) for s in scales]
    parts.append(grouped(quants.view(w.out_features, blocks, -1, 4)))
    return torch.cat(parts, dim=-1)


_kernel_lock = threading.Lock()
_kernel_ok: bool | None = None


def kernel_verified() -> bool:
    """Whether torch.ops.xllm.quant_linear loaded here and matched reference_linear (once a process,
    every format, bfloat16 and float32 rows, a decode step's rows and a prompt's (each of the
    kernel's paths), with a bias and a ragged last tile)."""
    global _kernel_ok
    with _kernel_lock:
        if _kernel_ok is None:
            _kernel_ok = _check_kernel()
            if _kernel_ok:
                prompts = "; prompts on AMX bfloat16 tiles" if cpu_kernels.our_linear() == "amx" else ""
                log.info("quantized linear: our AVX512-VNNI kernel (csrc/quant_linear.cpp)%s", prompts)
        return _kernel_ok


def _check_kernel() -> bool:
    if not cpu_kernels.available() or not hasattr(torch.ops.xllm, "quant_linear"):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 96, generator=generator)  # 70: a ragged last tile
    bias = torch.randn(70, generator=generator)
    # Whole numbers with a 127 in every block: the kernel's int8 rounding of them is exact, so it
    # must match the reference to float rounding.
    x = torch.randint(-127, 128, (37, 96), generator=generator).float()
    x[:, ::BLOCK] = 127
    for kind in FORMATS:
        w = QuantWeight.quantize(weight, kind)
        for dtype, rows in ((torch.float32, 3), (torch.bfloat16, 5), (torch.float32, 37), (torch.bfloat16, 37)):
            try:
                out = torch.ops.xllm.quant_linear(x[:rows].to(dtype), w.packed, kind, bias, w.out_features).float()
            except RuntimeError as exc:
                log.warning("our quantized linear unusable here: %s", exc)
                return False
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # (bfloat16's rounding of the output)
            expected = w.reference_linear(x[:rows], bias)
            if not torch.allclose(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()):
                log.warning("our quantized linear computed wrong here (%s, %s): the reference serves", kind, dtype)
                return False
    return True


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..15 -> [..., 16] bytes, GGUF's order (low halves: inputs 0-15)."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)
