"""The fixed-steps scheduler: batches of new requests, each run to completion
on one of N execution slots, several batches in flight at once."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType

from . import policies
from .budget import BatchBudget
from .handoff import SlotHandoff, WaitingQueue
from .policies import ReturnEstimate, short_batch
from .request import EngineRequest, QueuedRequest
from .scheduler import Scheduler


class FixedStepsScheduler(Scheduler):
    """A coroutine on the event loop that forms batches and hands them to free slots.

    It sleeps until a request arrives (never polls), waits for a free slot, lets the batch fill
    while the clients of finished batches are on their way back (ReturnEstimate), takes its share
    of what waits (policies.batch_share), hands it to the slot and goes straight back to forming
    the next. When a slot is free and there is nothing to wait for, add() starts the batch itself.
    The slot's thread runs the batch (StepLoop.run_handed), delivering each step's tokens as they
    exist, then reports back (ended / followed, posted to the loop).

    On a CPU, a short batch alone takes every core and the requests that arrive meanwhile wait for
    it, its thread taking them when it ends (the core rule); long generations join a running
    generation batch at its next step instead of waiting for a whole batch (the join rule).

    Everything here runs on the event loop. What a slot's thread shares with it is in its
    SlotHandoff and the WaitingQueue (engine/handoff.py), and nowhere else.
    """

    def __init__(self, steps: Mapping[int, object], slots, budget: BatchBudget, loop: asyncio.AbstractEventLoop,
                 metrics=None, returns: ReturnEstimate | None = None) -> None:
        self.budget = budget
        self.metrics = metrics
        self.waiting = WaitingQueue()
        self.returns = returns or ReturnEstimate()
        self._loop = loop
        self._arrived = asyncio.Event()  # a request arrived or a slot came free
        self._steps = steps  # slot index -> its StepLoop (execution/steps.py), run on its thread
        self._handoffs = {slot.index: SlotHandoff(slot, self.waiting, budget, loop.call_soon_threadsafe,
                                                  self.ended, self.followed) for slot in slots}
        self._running: dict[int, tuple[int, int]] = {}  # slot index -> (requests, steps) of its batch
        self.running: Mapping[int, tuple[int, int]] = MappingProxyType(self._running)
        self._idle: list = list(reversed(slots))  # free slots, the most recently freed last
        self._num_slots = len(slots)
        self._filling = False  # _run holds a slot while its batch fills
        self._wide: int | None = None  # the slot running a short batch on every core
        self._published: tuple | None = None  # what _publish last told the handoffs
        self._task: asyncio.Task | None = None

    @property
    def num_waiting(self) -> int:
        count = len(self.waiting)
        for handoff in self._handoffs.values():  # (every submit asks: no generator)
            count += handoff.num_joining
        return count

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
        return {i: h.num_joining for i, h in self._handoffs.items() if h.joinable}

    def _any_joinable(self) -> bool:
        """Whether a running batch takes joiners (add() asks on every arrival while the slots are busy:
        a plain loop, not the joining map)."""
        for handoff in self._handoffs.values():  # noqa: SIM110  (a plain loop: cheaper than any() and a generator)
            if handoff.joinable:
                return True
        return False

    def handoff(self, index: int) -> SlotHandoff:
        return self._handoffs[index]

    def start(self) -> None:
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def add(self, requests: list[QueuedRequest]) -> None:
        self.waiting.extend(requests)
        if self.returns.returning:
            self.returns.arrived(self._loop.time(), len(requests))
            self._publish()
        # A free slot with nothing worth waiting for starts the batch right here, not one loop
        # iteration later in _run: that hop would add to a lone request's latency.
        # (While a short batch runs on every core, the slot takes them itself when it ends.)
        if self._wide is None and not self._filling:
            if self._idle and self._join_instead():
                self._join(long_only=True)
            if self._idle and self.waiting and not self._worth_filling(self.busy_slots):
                self._start(self._take_idle())
            elif not self._idle and self._any_joinable():
                self._join()
        if self.waiting:
            self._arrived.set()

    def alone(self) -> bool:
        """Whether a running batch may take every core now (policies.alone); published to the slots'
        handoffs (may_widen) whenever it may have changed."""
        return policies.alone(self.busy_slots, self._wide is not None, self.returns.on_their_way)

    def _publish(self) -> None:
        """Tell the slots' threads what they read of the loop's state: whether a batch may take every
        core, and what the follow-on rule needs. Called after every change of what decides them."""
        state = (self.alone(), self.returns.return_delay, len(self._idle))
        if state == self._published:  # (most arrivals change none of it)
            return
        self._published = state
        for handoff in self._handoffs.values():
            handoff.may_widen, handoff.return_delay, handoff.idle_others = state

    def _join_instead(self) -> bool:
        joinable = [h for h in self._handoffs.values() if h.joinable]
        front = self.waiting[0] if self.waiting else None
        if len(joinable) != 1:
            return False
        target = joinable[0]
        return policies.join_instead(self.busy_slots, len(joinable), target.binding.can_widen, front,
                                     self._seats(target))

    def _join(self, long_only: bool = False) -> None:
        """Hand the generation requests at the front of the queue to the running long generation
        batches (the join rule): they prefill into it at its next step. (On the loop, the only
        taker of the queue's front while no batch runs wide.)"""
        with self.waiting.lock:
            while self.waiting:
                joinable = {i: h for i, h in self._handoffs.items() if h.joinable}
                target = joinable[policies.join_target(
                    {i: self._running[i][0] + h.num_joining for i, h in joinable.items()})]
                front = self.waiting[0]
                if not policies.joins(front, long_only, self._seats(target) if long_only else 0):
                    return
                target.join(self.waiting.pop_front_locked())

    def _seats(self, handoff: SlotHandoff) -> int:
        batch = handoff.batch
        seated = len(batch) if batch is not None else self._running[handoff.index][0]
        return policies.seats(self.budget.max_seqs, seated, handoff.num_joining)

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
        slot = self._idle.pop(policies.pick_slot(self._idle))
        self._publish()
        return slot

    def _start(self, slot) -> None:
        """Take the next batch off the queue and hand it to this slot."""
        alone = not self._running
        split = alone and slot.binding.can_widen and policies.split(len(self._idle), self.waiting)
        limit = policies.batch_share(self._running.values(), len(self.waiting), self._num_slots,
                                     len(self._idle), split)
        batch = self.waiting.take(self.budget, limit=limit)
        if not batch:  # everything that waited was aborted
            self._idle.append(slot)
            self._publish()
            return
        split = policies.starts_split(alone, batch, len(self._idle), len(self.waiting))
        wide = self._mark_running(slot, batch, alone and not split)
        handoff = self._handoffs[slot.index]
        handoff.hand(self._steps[slot.index].run_handed, batch, wide, split, joinable=self._joinable(batch))

    @staticmethod
    def _joinable(batch: list) -> bool:
        """Whether later requests may join this batch: a long generation's (the join rule)."""
        return not short_batch(batch) and isinstance(batch[0], EngineRequest)

    def _mark_running(self, slot, batch: list, alone: bool) -> bool:
        """Record the batch a slot now runs; returns whether it runs on every core (wide)."""
        self._running[slot.index] = (len(batch), max(r.max_steps for r in batch))
        wide = policies.wide(alone, batch, slot.binding.can_widen)
        self._wide = slot.index if wide else None
        self._publish()
        return wide

    # --- what a slot's thread reports back, posted to the loop (SlotHandoff.ended / followed) ---

    def ended(self, slot, size: int, prefill_seconds: float) -> None:
        """A slot's batch of `size` ended and the slot is free."""
        self._finished(slot, size, prefill_seconds)
        self.returns.waited_at_release = self.drop_aborted()
        self._idle.append(slot)
        self._publish()
        self._arrived.set()

    def followed(self, slot, size: int, prefill_seconds: float, batch: list) -> None:
        """A wide batch ended and its slot's thread went on with `batch`, which waited for it."""
        self._finished(slot, size, prefill_seconds)
        self._handoffs[slot.index].follow(self._joinable(batch))
        self._mark_running(slot, batch, alone=True)
        self._arrived.set()

    def _finished(self, slot, size: int, prefill_seconds: float) -> None:
        self._running.pop(slot.index, None)
        if self._wide == slot.index:
            self._wide = None
        left = self._handoffs[slot.index].release()
        if left:  # handed over too late for the batch that ended: first in line again
            self.waiting.put_back(left)
        self.returns.finished(self._loop.time(), size, prefill_seconds)

    def drop_aborted(self) -> int:
        """Take requests that were answered while they waited (timed out, client gone) off the
        queue now, not at the next take(): a batch may wait for company first, and meanwhile they
        would count against the queue limit. Returns how many live requests wait."""
        return self.waiting.drop_aborted()
