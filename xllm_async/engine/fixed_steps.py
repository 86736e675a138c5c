"""The fixed-steps scheduler: batches of new requests, each run to completion
on one of N execution slots, several batches in flight at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from .batch import GenerationBatch, fail_all
from .beam import BeamRequest, BeamSearchBatch
from .budget import BatchBudget
from .request import EngineRequest

log = logging.getLogger("xllm_async.scheduler")


class FixedStepsBatcher:
    """A coroutine on the event loop that forms batches and hands them to free slots.

    It sleeps until a request arrives (never polls), waits for a free slot,
    only then takes the batch (so requests that arrived meanwhile join it),
    hands it over and goes straight back to forming the next one. The slot
    thread runs prefill and every decode round, delivering each step's tokens
    as they exist, then frees itself.
    """

    def __init__(self, runner, slots, budget: BatchBudget, deliver: Callable[[list], None],
                 loop: asyncio.AbstractEventLoop, metrics=None) -> None:
        self.runner = runner
        self.budget = budget
        self.metrics = metrics
        self.waiting: deque[EngineRequest] = deque()
        self._deliver = deliver  # thread-safe: schedules delivery on the loop
        self._loop = loop
        self._arrived = asyncio.Event()
        self._free: asyncio.Queue = asyncio.Queue()
        self._num_slots = len(slots)
        for slot in slots:
            self._free.put_nowait(slot)
        self._task: asyncio.Task | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def busy_slots(self) -> int:
        return self._num_slots - self._free.qsize()

    def start(self) -> None:
        self._task = self._loop.create_task(self._run())

    def add(self, requests: list[EngineRequest]) -> None:
        self.waiting.extend(requests)
        self._arrived.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            while not self.waiting:
                self._arrived.clear()
                await self._arrived.wait()
            slot = await self._free.get()
            batch = self.budget.take(self.waiting)
            if not batch:  # everything that waited was aborted
                self._free.put_nowait(slot)
                continue
            slot.submit(lambda slot=slot, batch=batch: self._run_to_completion(slot, batch))

    def _run_to_completion(self, slot, requests: list[EngineRequest]) -> None:
        """On the slot's thread: prefill, then decode rounds until every sequence is done."""
        batch = None
        started = time.perf_counter()
        try:
            batch_type = BeamSearchBatch if isinstance(requests[0], BeamRequest) else GenerationBatch
            batch = batch_type(self.runner, requests, self.metrics)
            self._deliver(batch.prefill())
            while batch:
                self._deliver(batch.decode())
        except Exception as exc:
            log.exception("slot %d: batch of %d failed", slot.index, len(requests))
            self._deliver(batch.fail(exc) if batch is not None else fail_all(requests, exc))
        finally:
            slot.busy_seconds += time.perf_counter() - started
            slot.batches_run += 1
            self._loop.call_soon_threadsafe(self._free.put_nowait, slot)
