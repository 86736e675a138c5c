"""The only module that knows NPU and CUDA exist: picks the device and binds
each execution thread to it (and to a stream of its own).

Ascend NPUs are reached through torch_npu, whose documented API mirrors
torch.cuda: torch.npu.is_available / set_device / Stream / stream(...).
"""

from __future__ import annotations

import contextlib
import importlib
import logging

import torch

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

    __slots__ = ("device", "cpu_threads", "stream", "_stack")

    def __init__(self, device: torch.device, cpu_threads: int) -> None:
        self.device = device
        self.cpu_threads = cpu_threads  # intra-op threads of this slot, on CPU
        self.stream = None
        self._stack = contextlib.ExitStack()

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
