"""The small layers a Llama-family decoder is made of, written for serving:
inputs are packed token rows [tokens, hidden], never [batch, seq, hidden]."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose weight can be laid out once for this CPU's faster bfloat16 linear
    (pack_linears): then `weight` is None and `packed` holds it (PackedWeight)."""

    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class PackedWeight:
    """A [out, in] weight laid out for the CPU linears:
    - "ours": our linear (csrc/linear.cpp). In bfloat16: on AMX over torch's brgemm micro-kernel, on
      CPUs with AVX512-BF16 but no AMX over our own vdpbf16ps loop; nothing compiled per row count,
      no set-up per call: on AMX 1.5-2.4x oneDNN's linear for a decode step's 1-32 rows, on
      AVX512-BF16 (AMD Zen 5) 1.1-3x for 1-16 rows. From some rows on oneDNN's blocking wins, so a
      layer keeps oneDNN's packed weight too (`onednn`: a second copy) for more than
      `ours_max_rows` rows (OUR_MAX_ROWS, per instruction set). The LM head keeps no second copy:
      its rows are a batch's last tokens or a beam round's beams, and its column blocks (beam
      search) exist only in our layout (on Zen 5 oneDNN's would be 2-6% faster from 256 rows).
      In float32: our AVX512 FMA loop for every row count, no second copy (AMD Zen 5: a decode
      step's 121 SmolLM2 linears 12.5 ms against aten's 35.7, at the bandwidth of a plain sum over
      the weights; level with oneDNN's from 64 rows, and aten's float32 matmul, MKL's, is 2x
      slower at every row count on that CPU);
    - "onednn": oneDNN's linear alone (torch.ops.mkldnn), on CPUs with neither: 1.4-2x faster
      than aten's for a decode step's few rows (3072x576, 1 row 236 -> 163 us), as fast for a
      prefill's.
    oneDNN compiles a kernel per row count, so rows reach it padded to a few sizes (padded_rows)."""

    __slots__ = ("ours", "onednn", "out_features", "ours_max_rows")

    def __init__(self, weight: torch.Tensor, kind: str, both: bool = True) -> None:
        from . import cpu_kernels

        self.out_features = weight.shape[0]
        self.ours = torch.ops.xllm.pack_linear(weight.detach().contiguous()) if kind == "ours" else None
        # (float32 keeps no oneDNN copy, so its limit never applies)
        self.ours_max_rows = OUR_MAX_ROWS.get(cpu_kernels.our_linear(), 0) if kind == "ours" else 0
        self.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT)
                       if kind == "onednn" or both else None)

    @property
    def kind(self) -> str:
        return "ours" if self.ours is not None else "onednn"

    def columns(self, start: int, end: int) -> PackedWeight | None:
        """The output columns [start, end) as a weight of their own, sharing this one's memory
        (only our layout, from a 64-column block's start); None where that cannot be."""
        if self.ours is None or start % OUR_COLUMNS or not 0 <= start < end <= self.out_features:
            return None
        part = PackedWeight.__new__(PackedWeight)
        part.out_features, part.onednn, part.ours_max_rows = end - start, None, self.ours_max_rows
        part.ours = self.ours[start // OUR_COLUMNS:-(-end // OUR_COLUMNS)]
        return part


OUR_COLUMNS = 64  # the column block of csrc/linear.cpp's packed weights
# The most rows our linear takes where a layer also has oneDNN's weight, per instruction set
# (cpu_kernels.our_linear()). AMX, measured on an Intel Xeon (two threads): ours ahead at 32 rows
# for every SmolLM2 and 4-layer shape (1.5-2.1x), behind for 576 -> 3,072 at 100 rows (0.9x).
# AVX512-BF16, measured on AMD Zen 5 (2 vCPU; SmolLM2 and 4-layer shapes, 1 and 2 threads, weights
# cold and warm): ours ahead through 128 rows on every shape (1-16 rows 1.1-3x, 64 rows 1.0-1.33x,
# 128 rows 1.0-1.2x), even at 256 (0.97-1.11x), oneDNN 2-8% ahead from 512 rows (0.92-1.03x up to
# 5,120): both run vdpbf16ps near the cores' peak there, oneDNN with a larger register block. So
# 256: as fast, and the fewer row counts reach oneDNN, the fewer kernels it compiles as they come.
OUR_MAX_ROWS = {"amx": 64, "avx512_bf16": 256}

# The batch size oneDNN's packed layout is tuned for: a large one serves every size (a layout tuned
# for 1 row made 5,000-row prefills 1.6x slower here; one tuned for 5,000 made decode no slower).
_PACK_HINT = 4096


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() != 2:
        return packed_linear(x.reshape(-1, x.shape[-1]), packed, bias).view(*x.shape[:-1], packed.out_features)
    rows = x.shape[0]
    if packed.ours is not None and (rows <= packed.ours_max_rows or packed.onednn is None):
        return torch.ops.xllm.linear(x, packed.ours, bias, packed.out_features)
    out = torch.ops.mkldnn._linear_pointwise(rows_padded(x), packed.onednn, bias, "none", [], "")
    return out if out.shape[0] == rows else out[:rows]


def linear_packing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Which packed linear serves this device and dtype: in bfloat16 "ours" where our kernel (AMX
    or AVX512-BF16) loaded and ran, else "onednn" where torch has oneDNN's; in float32 "ours" where
    our float32 loop did; None: plain F.linear (accelerators, and CPUs without AVX512)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    from . import cpu_kernels

    if dtype == torch.float32:
        return "ours" if cpu_kernels.our_float32_linear() else None
    if cpu_kernels.our_linear() is not None:
        return "ours"
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "onednn"
    return None


def pack_linears(model: nn.Module, kind: str) -> int:
    """Lay out every Linear's weight (and the LM head, as a copy: item tables and the tied
    embedding read the plain one) for `kind` once; returns how many Linears were packed. Only
    bfloat16 layers keep oneDNN's layout beside ours (PackedWeight), so only they pad their rows."""
    count = 0
    onednn = False
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear) and module.weight is not None:
                module.packed = PackedWeight(module.weight, kind, both=module.weight.dtype == torch.bfloat16)
                onednn = onednn or module.packed.onednn is not None
                module.weight = None
                count += 1
        if hasattr(model, "packed_lm_head"):
            model.packed_lm_head = PackedWeight(model.lm_head, kind, both=False)
        if hasattr(model, "pad_rows"):
            model.pad_rows = onednn
    return count


# Start-up compiles oneDNN's kernels from this many rows up (warm_onednn): larger batches are rarer,
# so their row counts were met one by one through a soak, each compiling a kernel that stays.
WARM_FROM = 512


def warm_onednn(model: nn.Module, max_rows: int, thread_counts: set[int]) -> int:
    """Compile oneDNN's kernels for the larger batches once, at start-up: every padded row count
    from WARM_FROM up to max_rows (a batch's most tokens), for each layer shape and each thread
    count a slot runs with. Met one by one as traffic grows, they were most of a 10,000-request
    soak's growth (96 kernels of ~0.6 MB, the last in its final tenth). Returns how many were
    compiled; the calling thread's thread count is restored."""
    layers = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None and module.packed.onednn is not None:
            layers.setdefault((module.in_features, module.out_features, module.bias is not None), module)
    sizes = sorted({padded_rows(rows) for rows in range(WARM_FROM + 1, max_rows + 1)})
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for count in sorted(thread_counts):
                torch.set_num_threads(count)
                for module in layers.values():
                    for size in sizes:  # (beyond ours_max_rows: packed_linear takes oneDNN's)
                        packed_linear(torch.zeros(size, module.in_features, dtype=torch.bfloat16), module.packed,
                                      module.bias)
    finally:
        torch.set_num_threads(threads)
    return len(layers) * len(sizes) * len(thread_counts)


# oneDNN compiles a kernel for every number of rows it meets, and keeps it in a cache of
# ONEDNN_PRIMITIVE_CACHE_CAPACITY kernels (1,024) shared by the process. Measured here (bfloat16,
# 768 x 256, 1,000 rows, one thread): 4.6 ms the first time, 0.56 ms from the cache. Packed prompts
# and beam rounds come with any number of rows, so nearly every batch paid that for each linear
# shape, and filled the cache with kernels used once (most of a 10,000-request soak's growth). So
# rows beyond EXACT_ROWS are padded up to one of 4 sizes a doubling (at most 1/4 more rows, 1/8
# on average): 36 sizes up to 8,192 rows, each compiled once. Up to EXACT_ROWS (the decode steps
# of a few clients) rows are exact. A kernel holds ~0.6 MB here whatever its size (4 linears of
# 64 x 64, 2.4 MB a row count), so every size costs memory, and sizes first met late in a soak
# are its growth. Our linear has none of this, but the rows beyond OUR_MAX_ROWS still reach
# oneDNN, and padding a prefill's rows once (CausalLM.forward) saves padding them at every layer;
# the larger sizes are compiled at start-up (warm_onednn).
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def rows_padded(x: torch.Tensor) -> torch.Tensor:
    """x [rows, ...] with zero rows added up to padded_rows(rows) (x itself where none are)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    return x if padded == rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, padded - rows))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does, so that
    bfloat16 models round the same way as the reference."""

    fused = None  # set by llama.use_fused_kernels: the kernels' namespace (one pass of our CPU or GPU kernel)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, built once; a forward
    looks its positions up (one gather shared by every layer)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, 1, head_dim] for these positions, broadcast over heads; for the
        fused kernel (cpu_kernels.py) float32 [tokens, head_dim], rounded inside as here."""
        if fused:
            return self.cos[positions], self.sin[positions]
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim], rotated by halves (the Llama/Qwen convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.x's frequency scaling: long wavelengths slowed by factor, short ones kept."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


# On CPU a prefill's MLP runs over chunks of rows whose gate/up output fits in MLP_CHUNK_BYTES,
# so that it is still in the core's cache when SiLU x up reads it and the down projection reads
# that: 16 prompts of 320 tokens made a gate/up output of 16 MB (bfloat16, the 4-layer model) to
# 31 MB (SmolLM2), written to memory and read back twice, and SiLU x up alone ran 2.3x slower per
# value at 5,120 rows than at 1,024 (AMD EPYC, 2 cores). In 2 MB chunks a 16 x 320-token forward
# (perf/RESULTS.md, eighteenth session): bfloat16 4-layer 1.09-1.14x faster, SmolLM2 1.10-1.18x,
# float32 4-layer 1.25-1.32x; 1 MB and 4 MB gained less. Served, 320 in / 1 out at c32: bfloat16
# 1.05x, float32 1.33x; 30-608 in: 1.11x and 1.12x. Rows are independent: in float32 the result is
# the same bit for bit; in bfloat16 a last chunk of at most OUR_MAX_ROWS rows runs on our linear
# where the whole batch ran on oneDNN's, as a small batch does, so its sums go in another order.
# Chunks are whole multiples of 256 rows, at most 2,048, so the ones that reach oneDNN have row
# counts it already has kernels for (padded_rows).
MLP_CHUNK_BYTES = 2 << 20
_CHUNK_ROW_STEP = 256  # chunks are whole multiples of it, and never fewer rows


class GatedMlp(nn.Module):
    """SwiGLU with gate and up projections fused into one matrix."""

    fused = None  # set by llama.use_fused_kernels

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate, bias=bias)
        self.down = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            rows = x.shape[0]
            if x.device.type != "cpu":  # (the chunks are for a CPU core's cache)
                return self._fused(x)
            # (a decode step's few rows never chunk: no arithmetic for them, per layer per token)
            chunk = self.chunk_rows(x.element_size()) if rows > _CHUNK_ROW_STEP else rows
            if rows <= chunk:
                return self._fused(x)
            out = x.new_empty(rows, self.down.out_features)
            for start in range(0, rows, chunk):
                out[start:start + chunk] = self._fused(x[start:start + chunk])
            return out
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def chunk_rows(self, element_size: int) -> int:
        """Rows a chunk of a prefill's MLP takes (MLP_CHUNK_BYTES)."""
        rows = MLP_CHUNK_BYTES // (self.gate_up.out_features * element_size) // _CHUNK_ROW_STEP * _CHUNK_ROW_STEP
        return min(max(rows, _CHUNK_ROW_STEP), 2048)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.fused.silu_mul(self.gate_up(x)))
