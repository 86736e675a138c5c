"""The engine: admits requests and drives the configured scheduler, on the event loop. It knows
nothing of HTTP (callers hand it requests, engine/request.py, and read OutputStreams) and nothing
of torch: what runs on the slots' threads it is given (execution/steps.py's Execution)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from ..metrics import Gauge, Metrics, PerSlot
from .budget import BatchBudget
from .continuous import ContinuousScheduler
from .fixed_steps import FixedStepsScheduler
from .request import Delta, QueuedRequest
from .scheduler import Scheduler

log = logging.getLogger("xllm_async.engine")

# Grammars compiling at once (structured outputs): a slow one holds a thread, not the loop or a batch.
GRAMMAR_THREADS = 2


class EngineFull(Exception):
    """The admission queue is full; the caller should retry later."""


class TooManySequences(ValueError):
    """One request holds more sequences than the queue ever admits: retrying cannot help."""


class CacheTooSmall(ValueError):
    """One request needs more key/value cache than a slot has, even alone: retrying cannot help."""


class Engine:
    def __init__(self, execution, slots, scheduler: str, max_seqs_per_batch: int, max_tokens_per_batch: int,
                 max_queued_requests: int, metrics: Metrics | None = None, queue_timeout: float = 0.0) -> None:
        """execution: the slot side (execution/steps.py's Execution): its runner, a step loop per
        slot, and what a request needs before it joins a batch."""
        self.execution = execution
        self.runner = runner = execution.runner
        self.slots = slots
        self.max_queued_requests = max_queued_requests
        self.queue_timeout = queue_timeout  # 0 = a request may wait as long as it takes
        self.metrics = metrics or Metrics()
        self.unfinished: set[QueuedRequest] = set()  # admitted, not yet finished or aborted
        self._loop = asyncio.get_running_loop()
        self._grammar_threads = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="xllm-grammar")
        self.budget = budget = BatchBudget(max_seqs_per_batch, max_tokens_per_batch, runner.packed,
                                           runner.kv_tokens, runner.shares_beam_prompts,
                                           runner if runner.caches_prefixes else None)
        self.scheduler: Scheduler
        if scheduler == "continuous":
            # One batch in flight: the continuous baseline uses the first slot only.
            steps = execution.step_loop(slots[0], self._deliver_threadsafe, self.metrics)
            self.scheduler = ContinuousScheduler(steps, slots[0], budget)
        else:
            steps = {slot.index: execution.step_loop(slot, self._deliver_threadsafe, self.metrics) for slot in slots}
            self.scheduler = FixedStepsScheduler(steps, slots, budget, self._loop, self.metrics)
        self.metrics.add(Gauge("num_requests_waiting", "Sequences waiting for a batch.",
                               lambda: self.scheduler.num_waiting))
        self.metrics.add(Gauge("num_requests_running", "Sequences in a running batch.",
                               lambda: max(0, len(self.unfinished) - self.scheduler.num_waiting)))
        self.metrics.add(Gauge("slots_busy", "Execution slots running a batch now.",
                               lambda: self.scheduler.busy_slots))
        self.metrics.add(PerSlot("slot_busy_seconds_total", "Seconds each execution slot spent running batches.",
                                 "counter", lambda: [s.busy_seconds for s in slots]))
        self.metrics.add(PerSlot("slot_batches_total", "Prefill batches each execution slot ran.",
                                 "counter", lambda: [s.batches_run for s in slots]))
        self.scheduler.start()

    def compile_grammar(self, kind: str, text: str) -> asyncio.Future:
        """A structured output's grammar compiled on a thread of its own (execution/grammar.py): the
        caller awaits it before submit(), so that a grammar still compiling never holds up a batch."""
        return self._loop.run_in_executor(self._grammar_threads, self.execution.compile_grammar, kind, text)

    def submit(self, requests: list[QueuedRequest]) -> None:
        """Queue the sequences of one API request; all of them or none."""
        if len(requests) > self.max_queued_requests:
            raise TooManySequences(f"the request holds {len(requests)} sequences and at most "
                                   f"{self.max_queued_requests} may wait at once (XLLM_MAX_QUEUED_REQUESTS)")
        for req in requests:
            if self.budget.never_fits(req):
                raise CacheTooSmall(f"it needs {self.budget.cache_alone(req)} tokens of key/value cache and an "
                                    f"execution slot holds {self.budget.kv_tokens} (XLLM_KV_CACHE_BYTES)")
        if self.scheduler.num_waiting + len(requests) > self.max_queued_requests:
            raise EngineFull(f"{self.scheduler.num_waiting} requests are already waiting")
        for req in requests:  # (raises here, for this caller alone, not inside a batch it would share)
            self.execution.prepare(req)
        self.unfinished.update(requests)
        self.scheduler.add(requests)
        if self.queue_timeout:
            self._loop.call_later(self.queue_timeout, self._expire, requests)

    def abort(self, requests: list[QueuedRequest]) -> None:
        """The caller is gone: skip these if waiting, drop them at the next step if running."""
        waited = [req for req in requests if self._end(req, "abort") and not req.started]
        if waited:  # their places in the queue are free at once, not when a batch next ends
            self.scheduler.drop_aborted()

    def end_all(self, reason: str, message: str) -> None:
        """Answer every unfinished sequence now with this reason (the server is going away)."""
        for req in list(self.unfinished):
            if self._end(req, reason):
                req.sink.push(Delta(req.index, "", None, None, reason, message))

    def _expire(self, requests: list[QueuedRequest]) -> None:
        # Only sequences that never started: one that runs is answered in full.
        message = f"Request waited more than {self.queue_timeout} s for a batch"
        expired = [req for req in requests if not req.started and self._end(req, "timeout")]
        for req in expired:
            req.sink.push(Delta(req.index, "", None, None, "timeout", message))
        if expired:
            self.scheduler.drop_aborted()

    def _end(self, req: QueuedRequest, reason: str) -> bool:
        if req.done:
            return False
        req.done = req.aborted = True  # a scheduler skips it, a batch drops it at the next step
        self.unfinished.discard(req)
        self.metrics.finished.inc(1, reason)
        return True

    async def stop(self) -> None:
        self._grammar_threads.shutdown(wait=False, cancel_futures=True)
        await self.scheduler.stop()
        for slot in self.slots:
            await asyncio.to_thread(slot.stop)

    def _deliver_threadsafe(self, items: list) -> None:
        # Called on a slot thread once per step: one wake-up of the loop per step.
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[tuple[QueuedRequest, Delta]]) -> None:
        for req, delta in items:
            if req.done:  # aborted while this step ran
                continue
            if delta.finish_reason is not None:
                req.done = True
                self.unfinished.discard(req)
                self.metrics.finished.inc(1, delta.finish_reason)
            req.sink.push(delta)
