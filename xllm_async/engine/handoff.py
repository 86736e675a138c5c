"""The one door between the event loop and the slot threads.

Everything the two sides share lives in the two classes below, with its locking; neither side
reaches into the other's objects. The loop side (engine/: admission, budgets, scheduling decisions,
output streams) imports no torch; the slot side (execution/: the step loop, batches, sampling)
imports no asyncio; both import this module, which imports neither.

Who touches what (tests/test_handoff.py checks the locking; tests/test_layout.py the imports):

WaitingQueue, the requests waiting for a batch:
    the loop appends (add) and takes (a batch it starts); a wide batch's thread takes too (its
    follow-on batch). Every take and every rewrite of the queue holds `lock`; appends need none
    (deque.extend is atomic, and a taker only ever pops from the other end).

SlotHandoff, one per slot:
    loop -> slot   hand(): the batch to run (through slot.submit); joining: requests handed to its
                   running long generation batch, appended under `_lock`, taken under it by the
                   slot's thread at a step boundary; may_widen: whether its batch may take every
                   core now (written by the loop whenever what decides it changes, read by the
                   slot's thread before each step and between layers); return_delay and
                   idle_others: what the follow-on rule needs to know of the loop.
    slot -> loop   made(): its batch, once made (the loop reads its size for free seats);
                   busy (continuous: a batch in flight); ended() / followed(): posted to the loop
                   with `post` (loop.call_soon_threadsafe), never called on the slot's thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from .budget import BatchBudget
from .policies import back_at_once, follows_on
from .request import QueuedRequest


@runtime_checkable
class Binding(Protocol):
    """What a slot's thread is bound to, as the scheduler sees it (runtime/device.py StreamBinding)."""

    @property
    def can_widen(self) -> bool:
        """Whether it takes every core while the other slots are idle (one slot at most: runtime/executor.py)."""

    def share_cores(self, alone: bool) -> None:
        """On a CPU: every core while alone, else its share (a no-op elsewhere)."""


@runtime_checkable
class Slot(Protocol):
    """An execution slot, as the engine and the step loop use it (runtime/executor.py ExecutionSlot)."""

    index: int
    binding: Binding
    busy_seconds: float  # written on its thread, read when metrics are scraped
    batches_run: int

    def submit(self, job: Callable[[], None]) -> None:
        """Run job on the slot's thread, after whatever it runs now."""

    def stop(self) -> None:
        """End the thread once its jobs are done."""


class WaitingQueue:
    """The requests waiting for a batch, in arrival order (see the module's note for who may do what)."""

    __slots__ = ("_queue", "lock", "arrived")

    def __init__(self) -> None:
        self._queue: deque[QueuedRequest] = deque()
        self.lock = threading.Lock()
        # Set when requests arrive: the continuous scheduler's thread sleeps on it while idle.
        self.arrived = threading.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __getitem__(self, index: int) -> QueuedRequest:
        return self._queue[index]

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._queue)

    def extend(self, requests: list[QueuedRequest]) -> None:
        self._queue.extend(requests)
        # Set takes the event's lock and notifies; once set (every arrival under fixed_steps, whose
        # slots never wait on it) that is all cost. Safe to skip: the waiter clears it before it
        # looks at the queue, and these requests are in the queue before is_set() is read.
        if not self.arrived.is_set():
            self.arrived.set()

    def put_back(self, requests: list[QueuedRequest]) -> None:
        """First in line again (handed to a batch that ended before taking them)."""
        with self.lock:
            self._queue.extendleft(reversed(requests))

    def take(self, budget: BatchBudget, seqs_in_use: int = 0, limit: int = 0,
             cache_in_use: tuple[int, int] = (0, 0)) -> list[QueuedRequest]:
        """BatchBudget.take over the queue, under its lock."""
        with self.lock:
            return budget.take(self._queue, seqs_in_use, limit, cache_in_use)

    def pop_front_locked(self) -> QueuedRequest:
        """The request at the front, popped by a caller that holds `lock`."""
        return self._queue.popleft()

    def take_if(self, wanted: Callable[[WaitingQueue], bool], budget: BatchBudget) -> list[QueuedRequest]:
        """A batch off the queue if wanted(queue) holds, both under its lock (a follow-on's decision
        and its take are one step: nothing the loop does comes between them)."""
        with self.lock:
            return budget.take(self._queue) if wanted(self) else []

    def drop_aborted(self) -> int:
        """Take requests answered while they waited (timed out, client gone) off the queue now;
        returns how many live requests wait."""
        with self.lock:
            live = [req for req in self._queue if not req.aborted]
            if len(live) != len(self._queue):
                self._queue.clear()
                self._queue.extend(live)
        return len(live)


class SlotHandoff:
    """What the event loop and one slot's thread share (see the module's note)."""

    __slots__ = ("slot", "waiting", "budget", "may_widen", "return_delay", "idle_others", "busy", "batch",
                 "_joining", "_lock", "_post", "_ended", "_followed")

    def __init__(self, slot, waiting: WaitingQueue, budget: BatchBudget, post: Callable[..., object],
                 ended: Callable[..., None] | None = None, followed: Callable[..., None] | None = None) -> None:
        self.slot = slot
        self.waiting = waiting
        self.budget = budget
        self.may_widen = False
        self.return_delay = 0.0
        self.idle_others = 0
        self.busy = False
        self.batch = None  # the running long generation batch, once its thread has made it
        self._joining: deque[QueuedRequest] | None = None  # None: its batch takes no joiners
        self._lock = threading.Lock()
        self._post = post
        self._ended = ended
        self._followed = followed

    @property
    def index(self) -> int:
        return self.slot.index

    @property
    def binding(self):
        return self.slot.binding

    # --- on the loop ---

    def hand(self, run: Callable[..., None], requests: list[QueuedRequest], wide: bool, split: bool,
             joinable: bool) -> None:
        """Give the slot's thread a batch: run(self, requests, wide, split) runs there."""
        self.batch = None
        with self._lock:
            self._joining = deque() if joinable else None
        self.slot.submit(_Job(run, self, requests, wide, split))

    def follow(self, joinable: bool) -> None:
        """The slot's thread went on with a follow-on batch: its joiners' queue anew."""
        self.batch = None
        with self._lock:
            self._joining = deque() if joinable else None

    @property
    def joinable(self) -> bool:
        return self._joining is not None

    @property
    def num_joining(self) -> int:
        joining = self._joining
        return len(joining) if joining is not None else 0

    def join(self, request: QueuedRequest) -> None:
        """Hand a request to the running generation batch: it is prefilled into it at its next step."""
        with self._lock:
            self._joining.append(request)

    def release(self) -> list[QueuedRequest]:
        """The slot's batch ended: the requests handed to it too late, to wait again."""
        with self._lock:
            left, self._joining = list(self._joining or ()), None
        self.batch = None
        return left

    # --- on the slot's thread ---

    def joiners(self, batch) -> list[QueuedRequest]:
        """Before a step: the requests handed to the batch that it takes in now."""
        if not self._joining:  # (a racy peek: a request appended just now joins at the next step)
            return []
        with self._lock:
            if not self._joining:
                return []
            return self.budget.take(self._joining, len(batch), cache_in_use=batch.cache_in_use())

    def made(self, batch) -> None:
        """The batch exists: a long generation's seats now count its finished rows out."""
        if self._joining is not None:
            self.batch = batch

    def cores(self) -> None:
        """Before each step and between a forward's layers: the cores as the loop last said."""
        self.slot.binding.share_cores(self.may_widen)

    def follow_on(self, prefill_seconds: float) -> list[QueuedRequest]:
        """After a wide batch: the next batch, taken here without a round trip through the loop,
        where the follow-on rule says so (policies.follows_on)."""
        back = back_at_once(self.return_delay, prefill_seconds)
        return self.waiting.take_if(lambda waiting: follows_on(waiting, self.idle_others, back), self.budget)

    def ended(self, size: int, prefill_seconds: float) -> None:
        self._post(self._ended, self.slot, size, prefill_seconds)

    def followed(self, size: int, prefill_seconds: float, batch: list[QueuedRequest]) -> None:
        self._post(self._followed, self.slot, size, prefill_seconds, batch)


class _Job:
    """A batch handed to a slot's thread (a partial whose args a test can read: handoff, requests, ...)."""

    __slots__ = ("func", "args")

    def __init__(self, func: Callable[..., None], *args) -> None:
        self.func = func
        self.args = args

    def __call__(self) -> None:
        self.func(*self.args)
