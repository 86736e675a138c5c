"""xllm_async: an OpenAI-compatible LLM server for prefill-heavy traffic."""

import os

__version__ = "0.1.0"

# torch_npu registers itself as a torch "device backend" that torch imports on
# start-up; without Ascend's CANN that import fails and takes `import torch`
# down with it. This package is imported before torch anywhere in the project,
# so this is the one place that turns autoloading off; runtime/device.py then
# imports torch_npu explicitly when an NPU is asked for or auto-detected.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# torch's CPU build runs its intra-op threads on GNU OpenMP, whose idle threads spin about 300,000
# times before they sleep. A slot's threads share the cores with the event loop (and, when
# benchmarked, the client): with the default, some server processes ran markedly slower for their
# whole life; 30,000 spins kept them fast at no cost at low concurrency (measured:
# perf/history/RESULTS-sessions-1-23.md, "OpenMP spinning"). libgomp reads it when torch loads it,
# so it is set here; a user's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

# torch's oneDNN (ideep) keeps up to LRU_CACHE_CAPACITY compiled primitives per thread (default
# 1024), one per operator shape. A server sees a new shape with nearly every batch (packed prompts
# of any length, beam rounds of any width), so every slot thread and OpenMP worker filled its
# cache and a long soak's resident memory kept growing. 128 keeps the shapes that recur (decode
# steps) and bounds the rest (measured: perf/history/RESULTS-sessions-1-23.md, LRU_CACHE_CAPACITY).
# Read when oneDNN first runs, so it is set here; a user's value wins.
os.environ.setdefault("LRU_CACHE_CAPACITY", "128")

# glibc gives each thread that allocates its own malloc arena (up to 8 per core): slot threads,
# OpenMP workers and the event loop each kept a heap of freed chunks that malloc_trim could only
# partly return, and resident memory stepped up whenever a thread first met a larger batch. One
# arena for the process grew less and held less over a long soak (measured: perf/history/RESULTS-sessions-1-23.md,
# "One malloc arena"). Set before torch starts its threads; a user's MALLOC_ARENA_MAX wins (glibc
# reads that itself).
def _one_malloc_arena() -> None:
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, 1)  # M_ARENA_MAX (malloc.h)
    except (OSError, AttributeError):  # not glibc
        pass


_one_malloc_arena()
