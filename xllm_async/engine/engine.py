"""The engine: admits requests and drives the configured scheduler. It knows
nothing of HTTP; callers hand it EngineRequests and read OutputStreams."""

from __future__ import annotations

import asyncio
import logging

from .budget import BatchBudget
from .continuous import ContinuousScheduler
from .fixed_steps import FixedStepsBatcher
from .request import EngineRequest

log = logging.getLogger("xllm_async.engine")


class EngineFull(Exception):
    """The admission queue is full; the caller should retry later."""


class Engine:
    def __init__(self, runner, slots, scheduler: str, max_seqs_per_batch: int, max_tokens_per_batch: int,
                 max_queued_requests: int, max_model_len: int) -> None:
        self.runner = runner
        self.slots = slots
        self.scheduler_name = scheduler
        self.max_queued_requests = max_queued_requests
        self.max_model_len = max_model_len
        self._loop = asyncio.get_running_loop()
        budget = BatchBudget(max_seqs_per_batch, max_tokens_per_batch)
        if scheduler == "continuous":
            # One batch in flight: the continuous baseline uses the first slot only.
            self.scheduler = ContinuousScheduler(runner, slots[0], budget, self._deliver_threadsafe)
        else:
            self.scheduler = FixedStepsBatcher(runner, slots, budget, self._deliver_threadsafe, self._loop)
        self.scheduler.start()

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def submit(self, requests: list[EngineRequest]) -> None:
        """Queue the sequences of one API request; all of them or none."""
        if self.scheduler.num_waiting + len(requests) > self.max_queued_requests:
            raise EngineFull(f"{self.scheduler.num_waiting} requests are already waiting")
        self.scheduler.add(requests)

    @staticmethod
    def abort(requests: list[EngineRequest]) -> None:
        """The caller is gone: skip these if waiting, drop them at the next step if running."""
        for req in requests:
            req.aborted = True

    async def stop(self) -> None:
        await self.scheduler.stop()
        for slot in self.slots:
            await asyncio.to_thread(slot.stop)

    def _deliver_threadsafe(self, items: list) -> None:
        # Called on a slot thread once per step: one wake-up of the loop per step.
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    @staticmethod
    def _deliver(items: list) -> None:
        for sink, delta in items:
            sink.push(delta)
