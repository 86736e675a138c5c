"""The model's weights in host memory: one resident block, on huge pages.

transformers leaves CPU weights where safetensors put them, in a private mapping
of the checkpoint file: 4 KiB pages, which the kernel may drop under memory
pressure and read back from disk in the middle of a forward. A small model's
forward is bound by reading its weights (every step reads the whole LM head),
and with 4 KiB pages part of that time goes to TLB misses. Copied into one
anonymous block advised for transparent huge pages (2 MiB), prefills ran a few
percent faster, and the weights stay in memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap

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


def pack_weights(model: torch.nn.Module) -> mmap.mmap | None:
    """Move every parameter of a CPU model into one block; returns the block, which
    must outlive the model (None: no room, the weights stay where they were).

    Tied weights are one Parameter shared by two modules: parameters() yields it
    once, and both modules see the new storage. Buffers (rotary tables) are small
    and stay where they are.
    """
    params = list(model.parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    total = sum(_padded(s) for s in sizes)
    try:
        # Private: anonymous shared memory would be tmpfs, which gets no huge pages.
        block = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        log.warning("weights stay file-backed: no %d MiB block (%s)", total >> 20, exc)
        return None
    try:
        block.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or no transparent huge pages: still one resident block
        pass
    raw = torch.frombuffer(block, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    with one_intra_op_thread(), torch.no_grad():
        for param, size in zip(params, sizes):
            view = raw[offset:offset + size].view(param.dtype).view(param.shape)
            view.copy_(param)
            param.data = view
            offset += _padded(size)
    log.info("weights packed into one %d MiB block of huge pages", total >> 20)
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
