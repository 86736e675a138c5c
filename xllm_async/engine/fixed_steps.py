"""The fixed-steps scheduler: batches of new requests, each run to completion
on one of N execution slots, several batches in flight at once."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import deque
from collections.abc import Callable, Mapping
from types import MappingProxyType

from .budget import BatchBudget
from .policies import BatchFormation, CoreRule, JoinRule, ReturnEstimate, short_batch
from .request import EngineRequest, QueuedRequest
from .steps import StepLoop


class FixedStepsBatcher:
    """A coroutine on the event loop that forms batches and hands them to free slots.

    It sleeps until a request arrives (never polls), waits for a free slot, lets the batch fill
    while the clients of finished batches are on their way back (ReturnEstimate), takes its share
    of what waits (BatchFormation), hands it to the slot and goes straight back to forming the
    next. When a slot is free and there is nothing to wait for, add() starts the batch itself. The
    slot's thread runs the batch through its StepLoop, delivering each step's tokens as they exist,
    then reports back (ended / followed).

    On a CPU, a short batch alone takes every core and the requests that arrive meanwhile wait for
    it, its thread taking them when it ends (CoreRule); long generations join a running generation
    batch at its next step instead of waiting for a whole batch (JoinRule).

    The state the loop and the slot threads share lives here: `waiting` (popped under _take_lock,
    by the loop and by a wide batch's thread), and the joiners per slot (the loop appends, only
    that slot's thread pops, at a step boundary).
    """

    def __init__(self, runner, slots, budget: BatchBudget, deliver: Callable[[list], None],
                 loop: asyncio.AbstractEventLoop, metrics=None, returns: ReturnEstimate | None = None) -> None:
        self.budget = budget
        self.metrics = metrics
        self.waiting: deque[QueuedRequest] = deque()
        self.returns = returns or ReturnEstimate()
        self.formation = BatchFormation()
        self.core_rule = CoreRule()
        self.join_rule = JoinRule()
        self._loop = loop
        self._arrived = asyncio.Event()  # a request arrived or a slot came free
        self._steps = {slot.index: StepLoop(runner, slot, deliver, metrics) for slot in slots}
        self._slots = {slot.index: slot for slot in slots}
        self._running: dict[int, tuple[int, int]] = {}  # slot index -> (requests, steps) of its batch
        self.running: Mapping[int, tuple[int, int]] = MappingProxyType(self._running)
        self._idle: list = list(reversed(slots))  # free slots, the most recently freed last
        self._num_slots = len(slots)
        self._filling = False  # _run holds a slot while its batch fills
        self._wide: int | None = None  # the slot running a short batch on every core
        self._take_lock = threading.Lock()
        self._task: asyncio.Task | None = None
        self._joining: dict[int, deque[QueuedRequest]] = {}  # slot -> requests handed to its long generation batch
        self._generating: dict[int, object] = {}  # slot -> that batch, once its thread has made it

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(q) for q in self._joining.values())

    @property
    def busy_slots(self) -> int:
        return self._num_slots - len(self._idle)

    @property
    def wide_slot(self) -> int | None:
        """The slot running a short batch on every core (None: none is)."""
        return self._wide

    @property
    def joining(self) -> dict[int, int]:
        """Slot -> requests handed to its running long generation batch, not yet taken in."""
        return {index: len(queue) for index, queue in self._joining.items()}

    def start(self) -> None:
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def add(self, requests: list[QueuedRequest]) -> None:
        self.waiting.extend(requests)
        if self.returns.returning:
            self.returns.arrived(self._loop.time(), len(requests))
        # A free slot with nothing worth waiting for starts the batch right here, not one loop
        # iteration later in _run: that hop would add to a lone request's latency.
        # (While a short batch runs on every core, the slot takes them itself when it ends.)
        if self._wide is None and not self._filling:
            if self._idle and self._join_instead():
                self._join(long_only=True)
            if self._idle and self.waiting and not self._worth_filling(self.busy_slots):
                self._start(self._take_idle())
            elif not self._idle and self._joining:
                self._join()
        if self.waiting:
            self._arrived.set()

    def alone(self) -> bool:
        """Whether a running batch may take every core now (CoreRule.alone): read on a slot's
        thread before each step and between a forward's layers."""
        return self.core_rule.alone(self.busy_slots, self._wide is not None, self.returns.on_their_way)

    def _join_instead(self) -> bool:
        if self.busy_slots != 1 or len(self._joining) != 1 or not self.waiting:
            return False
        (index,) = self._joining
        return self.join_rule.join_instead(1, 1, self._slots[index].binding.can_widen, self.waiting[0],
                                           self._seats(index))

    def _join(self, long_only: bool = False) -> None:
        """Hand the generation requests at the front of the queue to the running long generation
        batches (JoinRule): they prefill into it at its next step."""
        with self._take_lock:
            while self.waiting:
                index = self.join_rule.target({i: self._running[i][0] + len(q) for i, q in self._joining.items()})
                if not self.join_rule.joins(self.waiting[0], long_only, self._seats(index) if long_only else 0):
                    return
                self._joining[index].append(self.waiting.popleft())

    def _seats(self, index: int) -> int:
        batch = self._generating.get(index)
        seated = len(batch) if batch is not None else self._running[index][0]
        return self.join_rule.seats(self.budget.max_seqs, seated, len(self._joining[index]))

    def _worth_filling(self, others_busy: int) -> bool:
        return self.returns.worth_waiting(self._loop.time(), self.waiting, others_busy, self.budget)

    async def _run(self) -> None:
        while True:
            while not (self.waiting and self._idle) or self._wide is not None:
                self._arrived.clear()
                await self._arrived.wait()
            slot = self._take_idle()
            self._filling = True
            try:
                await self._fill()
            finally:
                self._filling = False
            self._start(slot)

    async def _fill(self) -> None:
        """Let a batch fill up before it starts while that is likely to pay (ReturnEstimate): until
        enough requests wait, a slot comes free (when it began beside a busy one), or the deadline.
        Every wake-up is an arrival, a freed slot or that one deadline; nothing polls."""
        others_busy = self.busy_slots - 1  # the slot in hand counts as busy
        if not self._worth_filling(others_busy):
            return
        expired = False

        def expire() -> None:
            # A flag, not a clock comparison: uvloop's timers and loop.time() tick in whole
            # milliseconds, so a timer can fire while loop.time() still reads just before its
            # deadline, and a wait that compared clocks would sleep on with nothing left to wake it.
            nonlocal expired
            expired = True
            self._arrived.set()

        timer = self._loop.call_at(self.returns.wait_deadline(self._loop.time(), others_busy), expire)
        began = self._loop.time()  # on the timer's clock, so that a test's manual clock measures it too
        try:
            while not expired and self._still_worth_filling(others_busy):
                self._arrived.clear()
                await self._arrived.wait()
        finally:
            timer.cancel()
            if self.metrics is not None:
                self.metrics.fill.observe(self._loop.time() - began)

    def _still_worth_filling(self, others_busy_at_start: int) -> bool:
        if others_busy_at_start:
            # Began beside a busy slot: it ends when a slot comes free. The freed slot is idle too
            # now, and starting beats both slots waiting.
            return self.busy_slots > 1 and self._worth_filling(self.busy_slots - 1)
        return self._worth_filling(0)  # began on an idle server (and only this coroutine starts batches)

    def _take_idle(self):
        return self._idle.pop(self.core_rule.pick(self._idle))

    def _start(self, slot) -> None:
        """Take the next batch off the queue and hand it to this slot."""
        alone = not self._running
        with self._take_lock:
            split = alone and slot.binding.can_widen and self.core_rule.split(len(self._idle), self.waiting)
            limit = self.formation.share(self._running.values(), len(self.waiting), self._num_slots,
                                         len(self._idle), split)
            batch = self.budget.take(self.waiting, limit=limit)
        if not batch:  # everything that waited was aborted
            self._idle.append(slot)
            return
        split = self.core_rule.starts_split(alone, batch, len(self._idle), len(self.waiting))
        wide = self._mark_running(slot, batch, alone and not split)
        slot.submit(functools.partial(self._run_to_completion, slot, batch, wide, split))

    def _mark_running(self, slot, batch: list, alone: bool) -> bool:
        """Record the batch a slot now runs; returns whether it runs on every core (wide)."""
        self._running[slot.index] = (len(batch), max(r.max_steps for r in batch))
        if not short_batch(batch) and isinstance(batch[0], EngineRequest):
            self._joining[slot.index] = deque()
        wide = self.core_rule.wide(alone, batch, slot.binding.can_widen)
        self._wide = slot.index if wide else None
        return wide

    # --- what a slot's thread reports back, on the loop (call_soon_threadsafe) ---

    def ended(self, slot, size: int, prefill_seconds: float) -> None:
        """A slot's batch of `size` ended and the slot is free."""
        self._finished(slot, size, prefill_seconds)
        self.returns.waited_at_release = self.drop_aborted()
        self._idle.append(slot)
        self._arrived.set()

    def followed(self, slot, size: int, prefill_seconds: float, batch: list) -> None:
        """A wide batch ended and its slot's thread went on with `batch`, which waited for it."""
        self._finished(slot, size, prefill_seconds)
        self._mark_running(slot, batch, alone=True)
        self._arrived.set()

    def _finished(self, slot, size: int, prefill_seconds: float) -> None:
        self._running.pop(slot.index, None)
        if self._wide == slot.index:
            self._wide = None
        self._generating.pop(slot.index, None)
        left = self._joining.pop(slot.index, None)
        if left:  # handed over too late for the batch that ended: first in line again
            with self._take_lock:
                self.waiting.extendleft(reversed(left))
        self.returns.finished(self._loop.time(), size, prefill_seconds)

    def drop_aborted(self) -> int:
        """Take requests that were answered while they waited (timed out, client gone) off the
        queue now, not at the next take(): a batch may wait for company first, and meanwhile they
        would count against the queue limit. Returns how many live requests wait."""
        with self._take_lock:
            live = [req for req in self.waiting if not req.aborted]
            if len(live) != len(self.waiting):
                self.waiting.clear()
                self.waiting.extend(live)
        return len(live)

    # --- on a slot's thread ---

    def _run_to_completion(self, slot, requests: list[QueuedRequest], wide: bool, split: bool) -> None:
        """Run the batch; after a wide one, the batches that waited for it. split: the batch shares
        the waiting requests with an idle slot's, which may not have started yet: its prefill
        begins on its own share of the cores."""
        cores = self.core_rule.cores(slot.binding, self.alone)
        while True:
            slot.binding.share_cores(not split and self.alone())
            prefill_seconds = self._steps[slot.index].run(
                requests, functools.partial(self.joiners, slot.index), cores, functools.partial(self.made, slot.index))
            split = False
            following = self.follow_on(prefill_seconds) if wide else []
            if not following:
                self._loop.call_soon_threadsafe(self.ended, slot, len(requests), prefill_seconds)
                return
            self._loop.call_soon_threadsafe(self.followed, slot, len(requests), prefill_seconds, following)
            requests = following
            wide = short_batch(following)

    def made(self, index: int, batch) -> None:
        """The slot's thread made its batch: a long generation's size now counts its finished rows out."""
        if index in self._joining:
            self._generating[index] = batch

    def joiners(self, index: int, batch) -> list[QueuedRequest]:
        """Before a step of the slot's batch: the requests handed to it that it takes in now."""
        joining = self._joining.get(index)
        if not joining:
            return []
        return self.budget.take(joining, len(batch), cache_in_use=batch.cache_in_use())

    def follow_on(self, prefill_seconds: float) -> list[QueuedRequest]:
        """After a short batch on every core: the next batch, taken on its thread (CoreRule.follows_on)."""
        with self._take_lock:
            if not self.core_rule.follows_on(self.waiting, len(self._idle), self.returns.back_at_once(prefill_seconds)):
                return []
            return self.budget.take(self.waiting)
