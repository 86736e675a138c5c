"""The CPU linear machinery: weights laid out once for the fastest linear this CPU has
(PackedWeight, pack_linears), token rows padded to a few sizes for oneDNN (padded_rows), oneDNN's
kernels compiled at start-up (warm_onednn), and a prefill's MLP in chunks of rows that stay in a
core's cache (in_chunks). layers.Linear and layers.GatedMlp call it; the runner decides at load
whether it serves (runtime/backends.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels


class PackedWeight:
    """A [out, in] weight laid out for the CPU linears (perf/cpu_linear.py measures them):
    - "ours": our linear (csrc/linear.cpp), nothing compiled per row count, no set-up per call. In
      bfloat16 on AMX over torch's brgemm micro-kernel, on CPUs with AVX512-BF16 but no AMX over our
      own vdpbf16ps loop. On AMX ours is faster than oneDNN's for a decode step's rows, while from
      some rows on oneDNN's blocking wins, so a layer keeps oneDNN's packed weight too (`onednn`: a
      second copy) for more than `ours_max_rows` rows (OUR_MAX_ROWS); on AVX512-BF16 ours takes
      every row count and there is no second copy (keeps_onednn_copy). The LM head keeps none: its rows
      are a batch's last tokens or a beam round's beams, and its column blocks (beam search) exist
      only in our layout. In float32: our AVX512 FMA loop for every row count, no second copy;
    - "onednn": oneDNN's linear alone (torch.ops.mkldnn), on CPUs with neither: faster than aten's
      for a decode step's few rows, as fast for a prefill's.
    oneDNN compiles a kernel per row count, so rows reach it padded to a few sizes (padded_rows)."""

    __slots__ = ("ours", "onednn", "out_features", "ours_max_rows")

    def __init__(self, weight: torch.Tensor, kind: str, both: bool = True) -> None:
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
# The most rows our linear takes where a layer also keeps oneDNN's weight, per instruction set
# (cpu_kernels.our_linear()): on AMX, where ours stops being faster. AVX512-BF16 has no entry: there
# ours is as fast as oneDNN's at every row count (perf/experiments/cpu_linear.py, Zen 4: within 1-5%
# either way at 256-1,536 rows, equal rows), and oneDNN's rows come padded (padded_rows: a 1,088-token prompt
# ran as 1,280), so ours takes them all, unpadded, and the weights are held once (issue 48, RESULTS).
OUR_MAX_ROWS = {"amx": 64}


def keeps_onednn_copy() -> bool:
    """Whether a bfloat16 layer on our linear also keeps oneDNN's packed weight, for the rows past
    OUR_MAX_ROWS."""
    return cpu_kernels.our_linear() in OUR_MAX_ROWS

# The batch size oneDNN's packed layout is tuned for: a large one serves every size (one tuned for
# 1 row made large prefills much slower; one tuned for 5,000 made decode no slower).
_PACK_HINT = 4096


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() != 2:
        return packed_linear(x.reshape(-1, x.shape[-1]), packed, bias).view(*x.shape[:-1], packed.out_features)
    rows = x.shape[0]
    if packed.ours is not None and (rows <= packed.ours_max_rows or packed.onednn is None):
        return torch.ops.xllm.linear(x, packed.ours, bias, packed.out_features)
    out = torch.ops.mkldnn._linear_pointwise(rows_padded(x), packed.onednn, bias, "none", [], "")
    return out if out.shape[0] == rows else out[:rows]


def argmax_serves(packed: PackedWeight | None, dtype: torch.dtype) -> bool:
    """Whether packed_argmax picks over this weight for rows of this dtype, for any number of rows:
    our layout alone (a layer's oneDNN copy would take its larger row counts), in a dtype our fused
    pick verified exact here (cpu_kernels.head_pick)."""
    return packed is not None and packed.ours is not None and packed.onednn is None and cpu_kernels.head_pick(dtype)


def packed_argmax(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """Where argmax_serves: each row's index of its largest output of packed_linear(x, packed) (the
    first on ties, a NaN above all), int64 [rows], by our fused pick (csrc/head_pick.cpp), which
    makes no [rows, out] outputs."""
    return torch.ops.xllm.linear_argmax(x, packed.ours, packed.out_features)


def topk_serves(packed: PackedWeight | None, dtype: torch.dtype) -> bool:
    """As argmax_serves, for packed_topk (cpu_kernels.head_topk)."""
    return argmax_serves(packed, dtype) and cpu_kernels.head_topk(dtype)


def packed_topk(x: torch.Tensor, packed: PackedWeight, width: int):
    """Where topk_serves: each row's `width` largest outputs of packed_linear(x, packed), float32, and
    their columns (value descending, then column ascending; NaNs left out), and each row's first NaN
    column (-1: none), by our fused pick (csrc/head_topk.cpp), which makes no [rows, out] outputs."""
    return torch.ops.xllm.linear_topk(x, packed.ours, packed.out_features, width)


def linear_packing(dtype: torch.dtype) -> str | None:
    """Which packed linear serves a CPU model in this dtype: in bfloat16 "ours" where our kernel
    (AMX or AVX512-BF16) loaded and ran, else "onednn" where torch has oneDNN's; in float32 "ours"
    where our float32 loop did; None: plain F.linear (CPUs without AVX512, other dtypes)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    if dtype == torch.float32:
        return "ours" if cpu_kernels.our_float32_linear() else None
    if cpu_kernels.our_linear() is not None:
        return "ours"
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "onednn"
    return None


def _packable(module: nn.Module) -> bool:
    """Whether a module is one of the model's linears (layers.Linear: an nn.Linear that can hold a
    packed weight)."""
    return isinstance(module, nn.Linear) and hasattr(module, "packed")


def pack_linears(model: nn.Module, kind: str) -> int:
    """Lay out every Linear's weight (and the LM head, as a copy: item tables and the tied
    embedding read the plain one) for `kind` once; returns how many Linears were packed. Quantized
    ones (Linear.quant, CausalLM.quant_lm_head) keep their blocks. Only bfloat16 layers on AMX keep
    oneDNN's layout beside ours (keeps_onednn_copy), so only they pad their rows."""
    count = 0
    onednn = False
    with torch.no_grad():
        for module in model.modules():
            if _packable(module) and module.weight is not None:
                module.packed = PackedWeight(module.weight, kind,
                                            both=module.weight.dtype == torch.bfloat16 and keeps_onednn_copy())
                onednn = onednn or module.packed.onednn is not None
                module.weight = None
                count += 1
        if hasattr(model, "packed_lm_head") and getattr(model, "quant_lm_head", None) is None:
            model.packed_lm_head = PackedWeight(model.lm_head, kind, both=False)
        if hasattr(model, "pad_rows"):
            model.pad_rows = onednn
    return count


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    """Every packed weight of the model in the order a step reads them: the layers' linears, then
    the LM head's (host_memory.pack_linear_weights lays them out one after another)."""
    packs = [m.packed for m in model.modules() if _packable(m) and m.packed is not None]
    head = getattr(model, "packed_lm_head", None)
    return packs + ([head] if head is not None else [])


# Start-up compiles oneDNN's kernels from this many rows up (warm_onednn): larger batches are rarer,
# so their row counts were met one by one through a soak, each compiling a kernel that stays.
WARM_FROM = 512


def warm_onednn(model: nn.Module, max_rows: int, thread_counts: set[int]) -> int:
    """Compile oneDNN's kernels for the larger batches once, at start-up: every padded row count
    from WARM_FROM up to max_rows (a batch's most tokens), for each layer shape and each thread
    count a slot runs with. Met one by one as traffic grows, they were most of a long soak's
    growth in memory. Returns how many were
    compiled; the calling thread's thread count is restored."""
    layers = {}
    for module in model.modules():
        if _packable(module) and module.packed is not None and module.packed.onednn is not None:
            layers.setdefault((module.in_features, module.out_features, module.bias is not None), module)
    if not layers:  # (accelerators, and CPUs on our own linear: nothing of oneDNN's to compile)
        return 0
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


# oneDNN compiles a kernel for every number of rows it meets (several times a cached call's time) and
# keeps it, in a cache shared by the process (ONEDNN_PRIMITIVE_CACHE_CAPACITY). Packed prompts and
# beam rounds come with any number of rows, so nearly every batch paid that for each linear shape
# and left kernels used once (most of a long soak's memory growth). So rows beyond EXACT_ROWS are
# padded up to one of 4 sizes a doubling (at most 1/4 more rows): 36 sizes up to 8,192 rows, each
# compiled once, the larger ones at start-up (warm_onednn). Up to EXACT_ROWS (the decode steps of
# a few clients) rows are exact. Padding a prefill's rows once (CausalLM.forward) saves padding
# them at every layer.
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """The rows a batch of `rows` reaches oneDNN with (EXACT_ROWS)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def rows_padded(x: torch.Tensor) -> torch.Tensor:
    """x [rows, ...] with zero rows added up to padded_rows(rows) (x itself where none are)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    return x if padded == rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, padded - rows))


# On CPU a prefill's MLP runs over chunks of rows whose gate/up output fits in MLP_CHUNK_BYTES,
# so that it is still in the core's cache when SiLU x up reads it and the down projection reads
# that; whole, a large prefill's gate/up output went to memory and was read back twice. Rows are
# independent: in float32 the result is the same bit for bit; in bfloat16 a last chunk of at most
# OUR_MAX_ROWS rows (AMX) runs on our linear where the whole batch ran on oneDNN's, as a small batch
# does, so its sums go in another order. Chunks are whole multiples of 256 rows, at most 2,048, so
# the ones that reach oneDNN have row counts it already has kernels for (padded_rows).
MLP_CHUNK_BYTES = 2 << 20
CHUNK_ROW_STEP = 256  # chunks are whole multiples of it, and never fewer rows
# Quantized weights are widened to bfloat16 at every call on a CPU with AMX (csrc/quant_linear.cpp),
# so their MLP takes larger chunks, which widen them fewer times: SmolLM2 Q4_1, 16 x 320 tokens,
# Xeon, 2 threads 1,019 -> 902 ms a prefill, one thread 1,724 -> 1,661 (bfloat16 was level).
QUANT_MLP_CHUNK_BYTES = 8 << 20


def chunk_rows(width: int, element_size: int, chunk_bytes: int | None = None) -> int:
    """Rows a chunk of a prefill's MLP takes (chunk_bytes, else MLP_CHUNK_BYTES), its gate/up output
    `width` wide."""
    rows = (chunk_bytes or MLP_CHUNK_BYTES) // (width * element_size) // CHUNK_ROW_STEP * CHUNK_ROW_STEP
    return min(max(rows, CHUNK_ROW_STEP), 2048)


def in_chunks(mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, width: int,
              out_features: int, residual: torch.Tensor | None = None,
              chunk_bytes: int | None = None) -> torch.Tensor:
    """mlp(x) [rows, out_features] (+ residual, added as each chunk is written) computed over
    chunks of x's rows (chunk_rows of a gate/up output `width` wide); one call where they fit in one."""
    rows = x.shape[0]
    chunk = chunk_rows(width, x.element_size(), chunk_bytes)
    if rows <= chunk:
        out = mlp(x)
        return out if residual is None else out.add_(residual)
    out = x.new_empty(rows, out_features)
    for start in range(0, rows, chunk):
        part = mlp(x[start:start + chunk])
        if residual is None:
            out[start:start + chunk] = part
        else:
            torch.add(part, residual[start:start + chunk], out=out[start:start + chunk])
    return out
