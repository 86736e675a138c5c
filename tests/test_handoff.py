"""The door between the event loop and the slot threads (engine/handoff.py), and the declared
contracts around it: every implementation checked against its contract, and the handoff's locking
checked by two threads racing over it (a request is taken once, never lost)."""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace

import pytest
import torch

from xllm_async.engine.budget import BatchBudget
from xllm_async.engine.continuous import ContinuousScheduler
from xllm_async.engine.fixed_steps import FixedStepsScheduler
from xllm_async.engine.handoff import Binding, Slot, SlotHandoff, WaitingQueue
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import EngineRequest
from xllm_async.engine.scheduler import Scheduler
from xllm_async.execution.batch import Batch, GenerationBatch
from xllm_async.execution.beam import BeamSearchBatch
from xllm_async.execution.score_batch import ScoreBatch


def _request(max_tokens: int = 1) -> EngineRequest:
    return EngineRequest(0, [1, 2, 3], SamplingParams(max_tokens=max_tokens), sink=None)


def _conforms(cls: type, contract: type) -> list[str]:
    """What cls lacks of contract's methods, or takes differently (parameter names, in order)."""
    wrong = []
    for name, member in inspect.getmembers(contract):
        declared = inspect.isfunction(member) or isinstance(member, property)
        if name.startswith("_") and name != "__len__" or not declared:
            continue
        mine = getattr(cls, name, None)
        if mine is None:
            wrong.append(f"{cls.__name__} lacks {name}")
        elif inspect.isfunction(member):
            if not callable(mine):
                wrong.append(f"{cls.__name__}.{name} is not a method")
            elif list(inspect.signature(mine).parameters) != list(inspect.signature(member).parameters):
                wrong.append(f"{cls.__name__}.{name}{inspect.signature(mine)} != {inspect.signature(member)}")
    return wrong


@pytest.mark.parametrize("cls", [FixedStepsScheduler, ContinuousScheduler])
def test_both_schedulers_are_schedulers(cls):
    assert issubclass(cls, Scheduler) and not inspect.isabstract(cls)
    assert not _conforms(cls, Scheduler)


@pytest.mark.parametrize("cls", [GenerationBatch, BeamSearchBatch, ScoreBatch])
def test_both_batches_are_batches(cls):
    assert issubclass(cls, Batch) and not inspect.isabstract(cls)
    assert not _conforms(cls, Batch)
    assert not hasattr(cls(None, []), "__dict__")  # __slots__ all the way down
    if not cls.joinable:
        with pytest.raises(TypeError):
            cls(None, []).add([])


def test_the_runtimes_slots_and_bindings_are_what_the_engine_uses():
    from xllm_async.runtime.executor import start_slots

    slots = start_slots(torch.device("cpu"), 2)
    try:
        for slot in slots:
            assert isinstance(slot, Slot) and isinstance(slot.binding, Binding)
            for name in ("index", "binding", "busy_seconds", "batches_run"):
                assert hasattr(slot, name), name
            assert not _conforms(type(slot), Slot) and not _conforms(type(slot.binding), Binding)
        assert [s.binding.can_widen for s in slots] == [True, False] or all(not s.binding.can_widen for s in slots)
    finally:
        for slot in slots:
            slot.stop()


def test_the_follow_on_decision_and_its_take_are_one_step():
    """A wide batch's thread takes what waited (follow-on) only as the loop last published."""
    waiting = WaitingQueue()
    slot = SimpleNamespace(index=0, binding=SimpleNamespace(can_widen=True))
    handoff = SlotHandoff(slot, waiting, BatchBudget(8, 64), post=None)
    waiting.extend([_request(), _request()])
    handoff.idle_others, handoff.return_delay = 1, 0.0  # clients come back at once: the loop fills
    assert handoff.follow_on(0.010) == [] and len(waiting) == 2
    handoff.return_delay = 1.0  # they arrive on their own: the thread takes them itself
    assert len(handoff.follow_on(0.010)) == 2 and not waiting


def test_a_request_handed_to_a_running_batch_is_taken_once_or_put_back():
    """The loop joins requests while the slot's thread takes them at step boundaries; when the batch
    ends, what it did not take goes back to the queue. Two real threads, thousands of requests:
    each ends up taken exactly once or waiting again, never both, never lost."""
    waiting = WaitingQueue()
    slot = SimpleNamespace(index=0, binding=SimpleNamespace(can_widen=True), submit=lambda job: None)
    handoff = SlotHandoff(slot, waiting, BatchBudget(10_000, 1 << 30), post=None)
    handoff.hand(None, [_request(500)], wide=False, split=False, joinable=True)
    batch = type("Seated", (list,), {"cache_in_use": lambda self: (len(self), 0)})()
    handed = [_request(500) for _ in range(5000)]
    taken: list = []
    done = threading.Event()

    def slot_thread() -> None:
        while not done.is_set():
            taken.extend(handoff.joiners(batch))
        taken.extend(handoff.joiners(batch))

    thread = threading.Thread(target=slot_thread)
    thread.start()
    for request in handed:
        handoff.join(request)
    left = handoff.release()  # the batch ends: the loop takes back what is still handed
    done.set()
    thread.join()
    waiting.put_back(left)
    assert sorted(map(id, taken + list(waiting))) == sorted(map(id, handed))
    assert len({id(r) for r in taken} & {id(r) for r in waiting}) == 0
