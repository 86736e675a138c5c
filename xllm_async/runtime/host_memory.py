"""The model's weights in host memory: one resident block, on huge pages.

transformers leaves CPU weights where safetensors put them, in a private mapping
of the checkpoint file: 4 KiB pages, which the kernel may drop under memory
pressure and read back from disk in the middle of a forward. A small model's
forward is bound by reading its weights (every step reads the whole LM head),
and with 4 KiB pages part of that time goes to TLB misses. Copied into one
anonymous block advised for transparent huge pages (2 MiB), prefills ran a few
percent faster, and the weights stay in memory.

The same holds for what a decode step reads every time: the packed linears (cpu_linear.PackedWeight,
laid out at load by our packer into the allocator's memory) and the slot's key/value arena. With
transparent huge pages in "madvise" mode (the usual default) the allocator's large blocks get
4 KiB pages, scattered over physical memory differently in every process: the caches (indexed by
physical address) and the TLB then hold the 269 MB a SmolLM2 step streams differently from one
fresh server to the next. XLLM_HUGE_PAGES says which of them go on huge pages too:
- "weights" (the default): the packed linears (pack_linear_weights), a fixed block read whole by
  every step;
- "all": the key/value arenas as well (host_tensor). Not the default: a batch's cache is a
  rectangle of per-row slabs in its arena (model/kv_cache.py), each row touching the start of its
  slab, and with 2 MiB pages the whole rectangle soon becomes resident where 4 KiB pages kept only
  the touched tokens;
- "off": neither (for measuring what the huge pages do: perf/restart_spread.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os

import torch

log = logging.getLogger("xllm_async.model")

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line


def _padded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


@contextlib.contextmanager
def one_intra_op_thread():
    """Torch work on the calling thread (the one that becomes the event loop) with one intra-op
    thread: a parallel operation there starts an OpenMP team for that thread, and afterwards every
    forward of a slot with more than one thread runs markedly slower in the server, prefill and
    decode alike (measured: perf/history/RESULTS-sessions-1-23.md, "the loop thread's OpenMP team")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


HUGE_PAGE_CHOICES = ("weights", "all", "off")


def huge_pages_wanted(what: str) -> bool:
    """Whether `what` ("weights": the packed linears; "arena": the key/value arenas) goes on huge
    pages, as XLLM_HUGE_PAGES says (module docstring; an unknown value counts as the default)."""
    choice = os.environ.get("XLLM_HUGE_PAGES", "weights").strip().lower()
    if choice not in HUGE_PAGE_CHOICES:
        log.warning("XLLM_HUGE_PAGES=%s: expected one of %s; taking weights", choice, ", ".join(HUGE_PAGE_CHOICES))
        choice = "weights"
    return choice == "all" or (choice == "weights" and what == "weights")


def huge_block(size: int, what: str) -> tuple[mmap.mmap, torch.Tensor] | None:
    """An anonymous private block of at least `size` bytes advised for transparent huge pages, and
    a uint8 tensor over it from its first 2 MiB boundary (None: no room). Private: anonymous shared
    memory would be tmpfs, which gets no huge pages. Pages are touched, and so made resident, only
    as they are written."""
    try:
        block = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        log.warning("%s: no %d MiB block (%s)", what, size >> 20, exc)
        return None
    try:
        block.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or no transparent huge pages: still one block
        pass
    # A storage of its own from the boundary (its tensors' offsets count from there); the tensor
    # keeps the block alive.
    offset = -torch.frombuffer(block, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    return block, torch.frombuffer(block, dtype=torch.uint8, count=max(size, 1), offset=offset)[:size]


def into_block(tensors: list[torch.Tensor], what: str) -> tuple[mmap.mmap | None, list[torch.Tensor]]:
    """Copies of the tensors one after another in one huge_block (each from a cache line), in the
    given order: (the block, the copies); (None, the tensors themselves) where there is no room."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    made = huge_block(sum(_padded(s) for s in sizes), what)
    if made is None:
        return None, tensors
    block, raw = made
    copies, offset = [], 0
    with one_intra_op_thread(), torch.no_grad():
        for tensor, size in zip(tensors, sizes):
            copy = raw[offset:offset + size].view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
            copies.append(copy)
            offset += _padded(size)
    return block, copies


def pack_linear_weights(packs: list) -> mmap.mmap | None:
    """Our linear's layout of each packed weight (cpu_linear.PackedWeight.ours), in the order given
    (a step's), moved into one block of huge pages; returns the block (None: none moved, with
    XLLM_HUGE_PAGES=off, no room, or nothing in our layout). oneDNN's copies stay where they are:
    they serve prefills, which reuse each weight over many rows."""
    packs = [p for p in packs if getattr(p, "ours", None) is not None]
    if not packs or not huge_pages_wanted("weights"):
        return None
    block, copies = into_block([p.ours for p in packs], "packed linears stay on the allocator's pages")
    for pack, copy in zip(packs, copies):
        pack.ours = copy
    # The packer's copies, now freed, stay in the heap (SmolLM2: ~230 MiB resident more) until a
    # trim, and the service's first comes only after a batch (TrimSchedule): hand them back now.
    trim = heap_trimmer()
    if trim is not None:
        trim()
    if block is not None:
        log.info("%d packed linears moved into one %d MiB block of huge pages", len(packs),
                 sum(c.numel() * c.element_size() for c in copies) >> 20)
    return block


def host_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-d tensor for a key/value arena: on huge pages with XLLM_HUGE_PAGES=all
    (where there is room), else torch.empty's."""
    size = numel * torch.empty((), dtype=dtype).element_size()
    made = huge_block(size, "key/value arena stays on the allocator's pages") if huge_pages_wanted("arena") else None
    return made[1].view(dtype) if made is not None else torch.empty(numel, dtype=dtype)


def pack_weights(model: torch.nn.Module) -> mmap.mmap | None:
    """Move every parameter of a CPU model into one block; returns the block, which
    must outlive the model (None: no room, the weights stay where they were).

    Tied weights are one Parameter shared by two modules: parameters() yields it
    once, and both modules see the new storage. Buffers (rotary tables) are small
    and stay where they are.
    """
    params = list(model.parameters())
    block, copies = into_block([p.data for p in params], "weights stay file-backed")
    if block is None:
        return None
    for param, copy in zip(params, copies):
        param.data = copy
    log.info("weights packed into one %d MiB block of huge pages", sum(_padded(c.numel() * c.element_size())
                                                                       for c in copies) >> 20)
    return block


def heap_trimmer():
    """glibc's malloc_trim, or None where there is none (musl, macOS).

    Each slot thread and each OpenMP worker allocates from a malloc arena of its own, and a
    forward's tensors come in many sizes (a beam round's logits blocks, packed prompts of any
    length). Freed chunks stay in those arenas, and a long soak with beam searches grew the
    resident memory with nothing alive in it (perf/RESULTS.md, "The soak: memory and correctness
    under vanishing clients"). malloc_trim(0) hands every arena's free pages back; the service
    calls it when TrimSchedule says."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class TrimSchedule:
    """When the service calls heap_trimmer (it looks every TRIM_TICK seconds): every `interval`
    seconds while batches run, and once the server has been idle for a whole look, so that an idle
    server holds what it uses, not whatever the load had freed since a trim that fell at random
    (the soak's memory readings would otherwise move from round to round). Idle for a whole look, not idle at
    one: at low load the server is idle between most requests, and a trim at every look would
    land on some of them. Never when no batch has run since the last trim."""

    __slots__ = ("interval", "_trimmed_at", "_trimmed_batches", "_looked_batches")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._trimmed_at = 0.0  # when the last trim was
        self._trimmed_batches = 0  # batches run by then
        self._looked_batches = 0  # batches run at the last look

    def due(self, now: float, batches: int, busy: bool) -> bool:
        """A look: batches run so far (a counter), whether any request is unfinished now."""
        quiet = not busy and batches == self._looked_batches
        self._looked_batches = batches
        if batches == self._trimmed_batches or not (quiet or now - self._trimmed_at >= self.interval):
            return False
        self._trimmed_at, self._trimmed_batches = now, batches
        return True
