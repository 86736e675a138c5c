"""The only module that knows NPU and CUDA exist: picks the device and binds
each execution thread to it (and to a stream of its own).

Ascend NPUs are reached through torch_npu, whose documented API mirrors
torch.cuda: torch.npu.is_available / set_device / Stream / stream(...).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable

import torch

from ..model.cpu_features import bfloat16_units

log = logging.getLogger("xllm_async.device")


class DeviceError(Exception):
    """The asked-for device cannot be used here."""


def _npu_module():
    """torch.npu after importing torch_npu, or None when it is missing or unusable."""
    try:
        importlib.import_module("torch_npu")
    except Exception:  # not installed, or installed without CANN
        return None
    npu = getattr(torch, "npu", None)
    try:
        return npu if npu is not None and npu.is_available() else None
    except Exception:
        return None


def resolve_device(spec: str) -> torch.device:
    """Turn XLLM_DEVICES ('auto', 'cpu', 'cuda:0', 'npu:0') into a usable torch.device."""
    kind, _, index = spec.partition(":")
    index = int(index or 0)
    if kind == "auto":
        if _npu_module() is not None:
            return torch.device("npu", 0)
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"XLLM_DEVICES={spec!r}: CUDA is not available on this machine")
        if index >= torch.cuda.device_count():
            raise DeviceError(f"XLLM_DEVICES={spec!r}: only {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    npu = _npu_module()
    if npu is None:
        raise DeviceError(f"XLLM_DEVICES={spec!r}: no usable NPU (torch_npu with Ascend CANN is needed)")
    if index >= npu.device_count():
        raise DeviceError(f"XLLM_DEVICES={spec!r}: only {npu.device_count()} NPU device(s)")
    return torch.device("npu", index)


def _accelerator(device: torch.device):
    """The torch.cuda / torch.npu module that drives this device, or None on CPU."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return torch.npu
    return None


class StreamBinding:
    """What one execution thread holds for its whole life: its device, its own
    stream on accelerators, or its intra-op threads on CPU.

    enter() must run on the thread itself: the current stream, the current
    device and the intra-op thread count are all per-thread state.
    """

    __slots__ = ("device", "cpu_threads", "all_threads", "stream", "_threads", "_stack")

    def __init__(self, device: torch.device, cpu_threads: int, all_threads: int = 0) -> None:
        self.device = device
        self.cpu_threads = cpu_threads  # intra-op threads of this slot, on CPU
        self.all_threads = max(all_threads, cpu_threads)  # what it may use while every other slot is idle
        self.stream = None
        self._threads = cpu_threads
        self._stack = contextlib.ExitStack()

    @property
    def can_widen(self) -> bool:
        """Whether this slot takes more cores while the others are idle (share_cores): a CPU slot
        whose all_threads exceed its share."""
        return self.stream is None and self.device.type == "cpu" and self.all_threads > self.cpu_threads

    def share_cores(self, alone: bool) -> None:
        """On CPU, before a forward: every core while the other slots are idle, else its share,
        so that a lone request on fixed_steps N=2 does not decode on a fraction of the cores."""
        threads = self.all_threads if alone else self.cpu_threads
        if threads != self._threads and self.stream is None and self.device.type == "cpu":
            torch.set_num_threads(threads)
            self._threads = threads

    def enter(self) -> None:
        accel = _accelerator(self.device)
        if accel is None:
            torch.set_num_threads(self.cpu_threads)
        else:
            accel.set_device(self.device)
            self.stream = accel.Stream(self.device)
            self._stack.enter_context(accel.stream(self.stream))
        # Inference mode is thread-local too: each slot thread turns it on itself.
        self._stack.enter_context(torch.inference_mode())

    def exit(self) -> None:
        self._stack.close()

    def describe(self) -> str:
        if self.stream is None:
            return f"{self.device} with {torch.get_num_threads()} torch thread(s)"
        return f"{self.device} stream {self.stream}"


def graph_capture(device: torch.device):
    """What captures a forward's pieces as graphs on the calling thread's current stream (a slot's
    own: StreamBinding.enter), every graph of the thread in one memory pool: CUDA graphs, or
    torch_npu's NPU graphs (the same API: NPUGraph, capture_begin/capture_end, replay,
    graph_pool_handle). A piece in, its replay out. None on CPU, where a launch costs nothing
    beside the work.

    capture_begin/capture_end rather than torch.cuda.graph(): that context runs a full garbage
    collection and empties the allocator's cache at every capture, and a slot captures hundreds
    of pieces. thread_local: only this
    thread's unsafe calls (an allocation, a synchronisation) break its capture."""
    accel = _accelerator(device)
    if accel is None:
        return None
    graph_class = accel.CUDAGraph if device.type == "cuda" else accel.NPUGraph
    pool = accel.graph_pool_handle()

    def capture(piece: Callable[[], None]) -> Callable[[], None]:
        graph = graph_class()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            piece()
        finally:
            graph.capture_end()
        return graph.replay

    return capture


def fast_cpu_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively (AMX or AVX512-BF16: prefills several times
    faster than float32), else float32 (bfloat16 emulated is slower than float32). The same
    reading of the CPU as our kernels' (model/cpu_features.py)."""
    units = bfloat16_units()
    dtype = torch.bfloat16 if units else torch.float32
    log.info("CPU dtype: %s (%s)", str(dtype).removeprefix("torch."),
             "has " + ", ".join(units) if units else "no AMX or AVX512-BF16")
    return dtype


def default_kv_cache_bytes(device: torch.device) -> int:
    """The key/value cache when XLLM_KV_CACHE_BYTES is unset: 20% of host memory on CPU
    (the arena is touched only as far as batches use it), half the free memory on accelerators
    (measured after the weights are loaded)."""
    accel = _accelerator(device)
    if accel is None:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.2)
    free, _ = accel.mem_get_info(device)
    return int(free * 0.5)
