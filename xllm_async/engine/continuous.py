"""The continuous scheduler (the baseline): one batch in flight on one slot,
iteration-level batching. New requests are prefilled as soon as they arrive
and merged into the running batch; finished ones leave after every step."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from .batch import GenerationBatch, fail_all
from .budget import BatchBudget
from .request import EngineRequest

log = logging.getLogger("xllm_async.scheduler")


class ContinuousScheduler:
    """The step loop runs on the slot's own thread, so one step follows the
    previous one with no round trip through the event loop. The loop only
    appends to `waiting` and sets `_arrived`; the thread sleeps on it when idle.
    """

    def __init__(self, runner, slot, budget: BatchBudget, deliver: Callable[[list], None], metrics=None) -> None:
        self.runner = runner
        self.slot = slot
        self.budget = budget
        self.metrics = metrics
        self.waiting: deque[EngineRequest] = deque()
        self._deliver = deliver
        self._arrived = threading.Event()
        self._stopping = False
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
        self._stopping = True
        self._arrived.set()

    def _serve(self) -> None:
        running: GenerationBatch | None = None
        while not self._stopping:
            if running is None:
                # Clear before looking, so an arrival between the two still wakes us.
                self._arrived.clear()
                if not self.waiting:
                    self._arrived.wait()
                    continue
            new = self.budget.take(self.waiting, len(running) if running else 0,
                                   cache_in_use=running.cache_in_use() if running else (0, 0))
            self._running = True
            started = time.perf_counter()
            if new:
                running = self._prefill_into(running, new)
                self.slot.batches_run += 1
            elif running is not None:
                running = self._decode(running)
            self.slot.busy_seconds += time.perf_counter() - started
            self._running = running is not None

    def _prefill_into(self, running: GenerationBatch | None, requests: list[EngineRequest]):
        batch = running
        try:
            if running is None:
                batch = GenerationBatch(self.runner, requests, self.metrics)
                self._deliver(batch.prefill())
            else:
                self._deliver(running.add(requests))
        except Exception as exc:
            log.exception("prefill of %d request(s) failed", len(requests))
            self._deliver(fail_all(requests, exc))
            return running
        return batch if batch else None

    def _decode(self, running: GenerationBatch) -> GenerationBatch | None:
        try:
            self._deliver(running.decode())
        except Exception as exc:
            log.exception("decode step of %d request(s) failed", len(running))
            self._deliver(running.fail(exc))
        return running if running else None
