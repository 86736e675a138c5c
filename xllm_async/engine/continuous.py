"""The continuous scheduler (the baseline): one batch in flight on one slot,
iteration-level batching. New requests are prefilled as soon as they arrive
and merged into the running batch; finished ones leave after every step."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .budget import BatchBudget
from .request import EngineRequest
from .steps import StepLoop


class ContinuousScheduler:
    """The step loop runs on the slot's own thread, so one step follows the
    previous one with no round trip through the event loop. The loop only
    appends to `waiting` and sets `_arrived`; the thread sleeps on it when idle,
    and while a batch runs, takes what waits into it before every step.
    """

    def __init__(self, runner, slot, budget: BatchBudget, deliver: Callable[[list], None], metrics=None) -> None:
        self.slot = slot
        self.budget = budget
        self.waiting: deque[EngineRequest] = deque()
        self._steps = StepLoop(runner, slot, deliver, metrics)
        self._arrived = threading.Event()
        self._running = False  # a batch is in flight (read by metrics)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def busy_slots(self) -> int:
        return 1 if self._running else 0

    def drop_aborted(self) -> None:
        """Nothing to do now: the slot thread skips aborted requests at its next step, milliseconds away."""

    def start(self) -> None:
        self.slot.submit(self._serve)

    def add(self, requests: list[EngineRequest]) -> None:
        self.waiting.extend(requests)
        self._arrived.set()

    async def stop(self) -> None:
        self._steps.stopping = True
        self._arrived.set()

    def _serve(self) -> None:
        while not self._steps.stopping:
            # Clear before looking, so an arrival between the two still wakes us.
            self._arrived.clear()
            if not self.waiting:
                self._arrived.wait()
                continue
            new = self.budget.take(self.waiting)
            if new:
                self._running = True
                self._steps.run(new, self._joiners)
                self._running = False

    def _joiners(self, batch) -> list[EngineRequest]:
        return self.budget.take(self.waiting, len(batch), cache_in_use=batch.cache_in_use())
