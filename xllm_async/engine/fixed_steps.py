"""The fixed-steps scheduler: batches of new requests, each run to completion
on one of N execution slots, several batches in flight at once."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable

from .batch import GenerationBatch, fail_all
from .beam import BeamRequest, BeamSearchBatch
from .budget import BatchBudget
from .request import QueuedRequest

log = logging.getLogger("xllm_async.scheduler")
SHORT_BATCH_STEPS = 4  # a batch of at most this many tokens per sequence is prefill-bound: short


class FixedStepsBatcher:
    """A coroutine on the event loop that forms batches and hands them to free slots.

    It sleeps until a request arrives (never polls), waits for a free slot,
    lets the batch fill while another slot is busy (_fill), only then takes
    the batch (its fair share while others run short batches: _fair_share),
    hands it over and goes straight back to forming the next. The slot
    thread runs prefill and every decode round, delivering each step's
    tokens as they exist, then frees itself.
    """

    def __init__(self, runner, slots, budget: BatchBudget, deliver: Callable[[list], None],
                 loop: asyncio.AbstractEventLoop, metrics=None) -> None:
        self.runner = runner
        self.budget = budget
        self.metrics = metrics
        self.waiting: deque[QueuedRequest] = deque()
        self._deliver = deliver  # thread-safe: schedules delivery on the loop
        self._loop = loop
        self._arrived = asyncio.Event()  # a request arrived or a slot came free
        self._last_batch = (0, 0.0)  # (requests, prefill seconds) of the batch that finished last
        self._running: dict[int, tuple[int, int]] = {}  # slot index -> (requests, steps) of its batch
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

    def add(self, requests: list[QueuedRequest]) -> None:
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
            await self._fill()
            batch = self.budget.take(self.waiting, limit=self._fair_share())
            if not batch:  # everything that waited was aborted
                self._free.put_nowait(slot)
                continue
            self._running[slot.index] = (len(batch), max(r.max_steps for r in batch))
            slot.submit(functools.partial(self._run_to_completion, slot, batch))

    async def _fill(self) -> None:
        """Let a batch fill up before it starts, when that is likely to pay.

        Clients in a closed loop send their next requests right after their
        answers, so when a batch of k has just finished, about k requests are on
        their way; a slot that starts on the first of them runs a batch of one,
        and the next batches stay small. So, while another slot is still busy
        (an idle server never waits), wait until as many requests wait as the
        last finished batch held, or a slot comes free, but never longer than
        that batch's prefill took: a request waits at most one prefill's time
        for company. Every wake-up is an arrival, a freed slot or that one
        deadline; nothing polls.
        """
        size, prefill_seconds = self._last_batch
        if len(self.waiting) >= size or self.busy_slots <= 1:
            return
        deadline = self._loop.time() + prefill_seconds
        timer = self._loop.call_at(deadline, self._arrived.set)
        try:
            while (len(self.waiting) < min(size, self.budget.max_seqs) and self.busy_slots > 1
                   and self._loop.time() < deadline):
                self._arrived.clear()
                await self._arrived.wait()
        finally:
            timer.cancel()

    def _fair_share(self) -> int:
        """At most this many requests for the new batch (0: no limit).

        A slot that frees up while others run short batches takes its share of
        the requests in the server, not all that wait: otherwise one big and one
        small batch alternate for good (a big one leaves few behind, whose
        clients come back together), and the small ones waste the slot. Only
        against short batches (prefill-heavy, a few steps), so that what is
        left waits for one short batch at most, never for a long generation.
        """
        running = self._running.values()
        if not running or any(steps > SHORT_BATCH_STEPS for _, steps in running):
            return 0
        in_server = sum(size for size, _ in running) + len(self.waiting)
        return -(-in_server // self._num_slots)  # ceil

    def _release(self, slot, size: int, prefill_seconds: float) -> None:
        self._running.pop(slot.index, None)
        self._last_batch = (size, prefill_seconds)
        self._free.put_nowait(slot)
        self._arrived.set()

    def _run_to_completion(self, slot, requests: list[QueuedRequest]) -> None:
        """On the slot's thread: prefill, then decode rounds until every sequence is done."""
        batch = None
        started = time.perf_counter()
        prefill_seconds = 0.0
        try:
            batch_type = BeamSearchBatch if isinstance(requests[0], BeamRequest) else GenerationBatch
            batch = batch_type(self.runner, requests, self.metrics)
            self._deliver(batch.prefill())
            prefill_seconds = time.perf_counter() - started
            while batch:
                self._deliver(batch.decode())
        except Exception as exc:
            log.exception("slot %d: batch of %d failed", slot.index, len(requests))
            self._deliver(batch.fail(exc) if batch is not None else fail_all(requests, exc))
        finally:
            slot.busy_seconds += time.perf_counter() - started
            slot.batches_run += 1
            self._loop.call_soon_threadsafe(self._release, slot, len(requests), prefill_seconds)
