"""The continuous scheduler (the baseline): one batch in flight on one slot,
iteration-level batching. New requests are prefilled as soon as they arrive
and merged into the running batch; finished ones leave after every step."""

from __future__ import annotations

from .budget import BatchBudget
from .handoff import SlotHandoff, WaitingQueue
from .request import QueuedRequest
from .scheduler import Scheduler


class ContinuousScheduler(Scheduler):
    """The step loop runs on the slot's own thread (StepLoop.serve), so one step follows the
    previous one with no round trip through the event loop. The loop only appends to `waiting`
    (which wakes the thread); the thread sleeps while nothing waits and, while a batch runs, takes
    what waits into it before every step.
    """

    def __init__(self, steps, slot, budget: BatchBudget) -> None:
        self.slot = slot
        self.budget = budget
        self.waiting = WaitingQueue()
        self._steps = steps  # the slot's StepLoop (execution/steps.py)
        self._handoff = SlotHandoff(slot, self.waiting, budget, post=_never_posts)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def busy_slots(self) -> int:
        return 1 if self._handoff.busy else 0

    def drop_aborted(self) -> int:
        return self.waiting.drop_aborted()

    def start(self) -> None:
        self.slot.submit(lambda: self._steps.serve(self._handoff))

    def add(self, requests: list[QueuedRequest]) -> None:
        self.waiting.extend(requests)

    async def stop(self) -> None:
        self._steps.stopping = True
        self.waiting.arrived.set()


def _never_posts(*_args) -> None:
    raise AssertionError("the continuous scheduler's slot reports nothing to the loop")
