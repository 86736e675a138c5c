"""The device module: what can be checked without an NPU or a GPU."""

from __future__ import annotations

import os
import sys
import threading
import types

import pytest
import torch

from xllm_async.runtime import device as device_mod
from xllm_async.runtime.device import DeviceError, StreamBinding, resolve_device


def test_torch_npu_autoload_is_off_before_torch_imports():
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"


@pytest.mark.parametrize("given, expected", [(None, "30000"), ("500", "500")])
def test_openmp_spin_count_is_set_before_torch_loads_unless_the_user_set_it(given, expected):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    code = "import os, sys, xllm_async; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [expected, "False"]  # set, and torch (so libgomp) not loaded yet


def test_auto_on_this_machine_is_cpu_without_torch_npu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["npu:0", "cuda:7"])
def test_missing_accelerator_is_a_clear_error(spec):
    if torch.cuda.is_available() and spec.startswith("cuda"):
        pytest.skip("a CUDA machine")
    with pytest.raises(DeviceError, match=spec):
        resolve_device(spec)


class FakeNpu:
    """Records the torch_npu calls a slot thread makes (the documented torch.npu API)."""

    def __init__(self):
        self.calls = []

    def is_available(self):
        return True

    def device_count(self):
        return 2

    def set_device(self, dev):
        self.calls.append(("set_device", str(dev), threading.current_thread().name))

    def Stream(self, dev):  # noqa: N802 (mirrors torch.npu.Stream)
        self.calls.append(("Stream", str(dev)))
        return object()

    def stream(self, s):
        import contextlib

        self.calls.append(("stream",))
        return contextlib.nullcontext()


def test_npu_path_binds_device_and_a_stream_per_thread(monkeypatch):
    fake = FakeNpu()
    try:  # what importing torch_npu does first: the "npu" device type exists from then on
        torch.utils.rename_privateuse1_backend("npu")
    except RuntimeError:
        pass  # renamed already in this process
    monkeypatch.setattr(device_mod, "_npu_module", lambda: fake)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    assert resolve_device("auto") == torch.device("npu", 0)
    assert resolve_device("npu:1") == torch.device("npu", 1)
    with pytest.raises(DeviceError):
        resolve_device("npu:5")

    bindings = [StreamBinding(torch.device("npu", 1), 2) for _ in range(2)]

    def run(b):
        b.enter()
        b.exit()

    threads = [threading.Thread(target=run, args=(b,), name=f"slot-{i}") for i, b in enumerate(bindings)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    set_calls = [c for c in fake.calls if c[0] == "set_device"]
    assert sorted(c[2] for c in set_calls) == ["slot-0", "slot-1"]  # each thread binds itself
    assert sum(c[0] == "Stream" for c in fake.calls) == 2  # a stream of its own each
    assert sum(c[0] == "stream" for c in fake.calls) == 2  # and made it current


def test_cpu_binding_splits_cores_and_enters_inference_mode():
    seen = {}

    def run():
        b = StreamBinding(torch.device("cpu"), 1)
        b.enter()
        seen["threads"] = torch.get_num_threads()
        seen["inference"] = torch.is_inference_mode_enabled()
        b.exit()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["threads"] == 1
    assert seen["inference"] is True
    assert isinstance(device_mod, types.ModuleType)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_slot_threads_run_nicer_than_the_process():
    from xllm_async.runtime.executor import start_slots

    base = os.getpriority(os.PRIO_PROCESS, 0)
    slots = start_slots(torch.device("cpu"), 2, cpu_threads=1, nice=3)
    try:
        for slot in slots:
            assert os.getpriority(os.PRIO_PROCESS, slot.native_id) == min(base + 3, 19)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the loop's thread is untouched
    finally:
        for slot in slots:
            slot.stop()


def test_only_slot_0_may_take_every_core_while_alone(monkeypatch):
    """Two slots that had each grown an OpenMP pool over every core ran a lone request no faster
    than on one core (executor.start_slots): only slot 0 widens, and the scheduler gives it the
    next batch whenever it is idle."""
    from xllm_async.engine.policies import pick_slot
    from xllm_async.runtime.executor import start_slots

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    slots = start_slots(torch.device("cpu"), 2)
    try:
        assert [(s.binding.cpu_threads, s.binding.all_threads) for s in slots] == [(2, 4), (2, 2)]
        idle = [slots[1], slots[0]]  # the most recently freed last
        assert idle.pop(pick_slot(idle)) is slots[0] and idle.pop(pick_slot(idle)) is slots[1]
        idle = [slots[0], slots[1]]
        assert idle.pop(pick_slot(idle)) is slots[0]
    finally:
        for slot in slots:
            slot.stop()
    pinned = start_slots(torch.device("cpu"), 2, cpu_threads=1)  # a set thread count: never wider
    try:
        assert [s.binding.all_threads for s in pinned] == [1, 1]
    finally:
        for slot in pinned:
            slot.stop()


def test_a_forward_on_slot_0_takes_every_core_at_the_next_layer_once_alone(tiny_model_dir, monkeypatch):
    """A prefill that began beside another slot's batch runs on its share of the cores; once the
    other batch ends, the forward widens at its next layer (the core rule, handed to the forward as
    between_layers: the slot's SlotHandoff.cores, reading what the loop published), not at its next
    forward."""
    from xllm_async.engine.budget import BatchBudget
    from xllm_async.engine.handoff import SlotHandoff, WaitingQueue
    from xllm_async.model import llama
    from xllm_async.runtime.executor import start_slots
    from xllm_async.runtime.model_runner import ModelRunner

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    runner.set_kv_cache(16 << 20, 2)
    seen = []
    handoffs = []
    layer_forward = llama.DecoderLayer.forward

    def recording(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        out = layer_forward(self, *args, **kwargs)
        handoffs[0].may_widen = True  # the other slot's batch ends during the first layer: the loop says so
        return out

    monkeypatch.setattr(llama.DecoderLayer, "forward", recording)
    slots = start_slots(torch.device("cpu"), 2)
    try:
        handoffs.extend(SlotHandoff(slot, WaitingQueue(), BatchBudget(8, 64), post=None) for slot in slots)
        assert slots[0].binding.can_widen and not slots[1].binding.can_widen
        done = threading.Event()

        def job(slot):
            slot.binding.share_cores(False)  # began beside the other slot's batch
            runner.prefill([[1, 2, 3, 4]], between_layers=handoffs[0].cores)
            seen.append(torch.get_num_threads())  # after the forward: still wide
            done.set()

        slots[0].submit(lambda: job(slots[0]))
        assert done.wait(120)
        layers = runner.model.shape.layers
        assert seen == [2] + [4] * layers
    finally:
        for slot in slots:
            slot.stop()


def test_share_cores_follows_what_the_scheduler_says_and_starts_on_its_share():
    seen = []

    def run():
        binding = StreamBinding(torch.device("cpu"), 1, 3)
        binding.enter()  # no scheduler has said anything: its share
        seen.append(torch.get_num_threads())
        binding.share_cores(True)
        seen.append(torch.get_num_threads())
        binding.share_cores(False)
        seen.append(torch.get_num_threads())
        binding.exit()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [1, 3, 1]
