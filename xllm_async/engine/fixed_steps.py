"""The fixed-steps scheduler: batches of new requests, each run to completion
on one of N execution slots, several batches in flight at once."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from .batch import GenerationBatch, fail_all
from .beam import BeamRequest, BeamSearchBatch
from .budget import BatchBudget
from .request import EngineRequest, QueuedRequest

log = logging.getLogger("xllm_async.scheduler")
# A batch waits for company only while finished batches' clients have been back within this
# share of a prefill, on average (RETURN_DELAY_WEIGHT: the weight of the latest batch in it).
# Measured here: clients in a closed loop are back within 0.02-0.1 of a prefill, arrivals of their
# own (open loop) come about one prefill later; at 0.5, open-loop bursts passed for clients.
RETURN_WITHIN = 0.2
RETURN_DELAY_WEIGHT = 0.25
FILL_RETURNS = 4  # a wait for company lasts at most this many average return delays (and a prefill)
MAX_OWED = 64  # finished batches whose clients are tracked
OWED_FOR = 2.0  # prefills: clients of a batch not back after this long are not counted on any more
SHORT_BATCH_STEPS = 4  # a batch of at most this many tokens per sequence is prefill-bound: short
# On an idle CPU server, at least this many short requests waiting are split between the idle slots,
# each batch on its own cores, rather than run as one batch on every core (_split_waiting). Two
# waiting still run together, as a closed loop at concurrency 2 has it.
SPLIT_AT = 3


class FixedStepsBatcher:
    """A coroutine on the event loop that forms batches and hands them to free slots.

    It sleeps until a request arrives (never polls), waits for a free slot,
    lets the batch fill while another slot is busy or the last batch's
    clients are on their way back (_fill), only then takes
    the batch (its fair share while others run short batches: _fair_share),
    hands it over and goes straight back to forming the next. When a slot is
    free and there is nothing to wait for, add() starts the batch itself. The
    slot thread runs prefill and every decode round, delivering each step's
    tokens as they exist, then frees itself.

    A short batch that runs alone on a CPU takes every core (StreamBinding.share_cores), and
    nothing starts beside it: requests that arrive meanwhile wait for it, as they would for the
    continuous scheduler's next step, and its slot's thread takes them itself when it ends
    (_follow_on), or, in a closed loop, hands back to the loop so that the batch fills first.
    Once SPLIT_AT or more wait, the idle slots share them instead, each batch on its own cores
    (_split_waiting): queued-up requests drain sooner that way.

    Long generations do not make new requests wait for a whole batch: while
    every slot is busy, generation requests that arrive join a running
    generation batch of more than SHORT_BATCH_STEPS steps at its next step
    (_join), as under the continuous scheduler. On a CPU they join it even
    with a slot idle, while it runs alone on every core (_join_instead): a
    decode step reads every weight whatever its rows, so one batch of eight
    beats two of four on a core each. Short, prefill-heavy batches
    (recommendation, scoring) and beam searches keep running to completion.
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
        self._released_at = -math.inf  # loop time when it finished
        self._waited_at_release = 0  # requests already waiting then
        # Clients answered by finished batches whose next requests have not arrived yet (a
        # closed-loop estimate: every arrival counts as one of them coming back), and the same
        # per batch, oldest first: [loop time it finished, clients not back yet].
        self._returning = 0
        self._owed: deque[list] = deque()
        # How long a finished batch's clients took to be back, a running average over batches.
        # Clients in a closed loop send their next request at once; requests that arrive on their
        # own (open loop) repay a batch only as fast as they arrive, about a batch's time later,
        # and waiting for them is waiting for strangers. 0 until measured: a closed loop is assumed.
        self._return_delay = 0.0
        self._running: dict[int, tuple[int, int]] = {}  # slot index -> (requests, steps) of its batch
        # Free slots, the most recently freed last: it is taken first, so that
        # at low load one thread (and its core's caches) does the work.
        self._idle: list = list(reversed(slots))
        self._slots = {slot.index: slot for slot in slots}
        self._num_slots = len(slots)
        for slot in slots:
            slot.binding.alone = self._alone  # read on its thread between layers (StreamBinding.rebalance)
        self._filling = False  # _run holds a slot while its batch fills
        # The slot running a short batch on every core (None: none is): requests that arrive meanwhile
        # wait for it and it takes them itself when it ends (_follow_on), instead of a batch beside it.
        self._wide: int | None = None
        # `waiting` is popped by the loop and, after a wide batch, by that slot's thread.
        self._take_lock = threading.Lock()
        self._task: asyncio.Task | None = None
        # slot index -> requests handed to its running long generation batch: the loop appends,
        # only that slot's thread pops (at a step boundary), and _release puts what is left back.
        self._joining: dict[int, deque[QueuedRequest]] = {}
        # slot index -> its running long generation batch, once its thread has made it: the loop reads
        # its size (_seats) while the thread steps it.
        self._generating: dict[int, GenerationBatch] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(q) for q in self._joining.values())

    @property
    def busy_slots(self) -> int:
        return self._num_slots - len(self._idle)

    def start(self) -> None:
        self._task = self._loop.create_task(self._run())

    def add(self, requests: list[QueuedRequest]) -> None:
        self.waiting.extend(requests)
        if self._returning:
            self._repay(len(requests))
        # A free slot with nothing worth waiting for starts the batch right here,
        # not one loop iteration later in _run: that hop is tens of microseconds
        # on a lone request's latency.
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

    def _repay(self, arrived: int) -> None:
        """Count arrivals as the clients of finished batches coming back, the latest batch first;
        a batch whose clients are all back adds how long that took to the running average.

        Latest first: clients who never come back (a benchmark's warm-up, a client that left)
        stay at the bottom until they are too old to count (_forget_stale). Oldest first, every
        later arrival paid for them and looked a whole batch late, closed loop or not."""
        now = self._loop.time()
        self._forget_stale(now)
        self._returning = max(0, self._returning - arrived)
        while arrived and self._owed:
            entry = self._owed[-1]
            back = min(arrived, entry[1])
            entry[1] -= back
            arrived -= back
            if not entry[1]:
                self._owed.pop()
                self._returned_after(now - entry[0])

    def _forget_stale(self, now: float) -> None:
        """Batches whose clients are not all back OWED_FOR prefills after it ended: they are not
        coming (or come on their own); the wait so far goes into the average."""
        horizon = self._last_batch[1] * OWED_FOR
        while self._owed and (now - self._owed[0][0] > horizon or len(self._owed) > MAX_OWED):
            released_at, never = self._owed.popleft()
            self._returning -= never
            self._returned_after(now - released_at)

    def _returned_after(self, seconds: float) -> None:
        """A finished batch's clients took this long to be back: into the running average."""
        self._return_delay += RETURN_DELAY_WEIGHT * (seconds - self._return_delay)

    def _join(self, long_only: bool = False) -> None:
        """Every slot is busy: hand the generation requests at the front of the queue to the
        running long generation batch with the fewest sequences (it prefills them at its next
        step). A beam search at the front stops the hand-over: it waits for a slot of its own.
        long_only (_join_instead): only long generations, and only into the batch's free seats."""
        with self._take_lock:
            while self.waiting and isinstance(self.waiting[0], EngineRequest):
                slot_index = min(self._joining, key=lambda i: self._running[i][0] + len(self._joining[i]))
                if long_only and not (_long_request(self.waiting[0]) and self._seats(slot_index)):
                    return
                self._joining[slot_index].append(self.waiting.popleft())

    def _join_instead(self) -> bool:
        """Whether the long generation at the front of the queue joins the long generation batch
        that runs alone on every core rather than start a batch of its own on an idle slot.

        On a CPU, decode is bound by reading the weights: a step reads every weight once whatever its
        rows, so one batch on every core beats two on a core each, which read them twice at half the
        bandwidth (SmolLM2 128 / 128 at eight clients, bfloat16, AMD EPYC: 313 tokens/s before this rule,
        469 after, the continuous scheduler's 444; perf/RESULTS.md, seventeenth session). The joiner
        waits for the step under way, as under the continuous scheduler. Short requests still start
        beside it: a prefill-heavy batch of its own keeps fixed-steps' throughput. Not on
        accelerators, whose slots overlap on streams of their own (not measured there)."""
        if self.busy_slots != 1 or len(self._joining) != 1 or not self.waiting:
            return False
        (slot_index,) = self._joining
        return (self._slots[slot_index].binding.can_widen and _long_request(self.waiting[0])
                and self._seats(slot_index) > 0)

    def _seats(self, slot_index: int) -> int:
        """Sequences a running generation batch can still take in (max_seqs_per_batch)."""
        batch = self._generating.get(slot_index)
        seated = len(batch) if batch is not None else self._running[slot_index][0]
        return self.budget.max_seqs - seated - len(self._joining[slot_index])

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

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

    def _alone(self) -> bool:
        """Read on a slot's thread between a forward's layers (StreamBinding.rebalance): whether its
        batch may take every core. Not while another batch runs; nor, once that one has ended, while
        its clients are on their way back (a closed loop): they would start a batch on the freed slot
        within the layer, three threads on two cores. A wide batch (_wide) keeps every core: what
        arrives waits for it, nothing starts beside it."""
        return self.busy_slots == 1 and (self._wide is not None or not self._clients_on_their_way())

    def _clients_on_their_way(self) -> bool:
        """Whether answered clients are about to be back: some are not yet, and finished batches'
        clients have been coming back within RETURN_WITHIN of a prefill (a closed loop)."""
        return bool(self._returning) and self._return_delay <= self._last_batch[1] * RETURN_WITHIN

    def _take_idle(self):
        """An idle slot: slot 0 if it is idle (the one that may take every core while alone:
        executor.start_slots), else the one freed last."""
        for i, slot in enumerate(self._idle):
            if slot.index == 0:
                return self._idle.pop(i)
        return self._idle.pop()

    def _start(self, slot) -> None:
        """Take the next batch off the queue and hand it to this slot."""
        alone = not self._running
        with self._take_lock:
            batch = self.budget.take(self.waiting, limit=self._fair_share(slot))
        if not batch:  # everything that waited was aborted
            self._idle.append(slot)
            return
        # A short batch that leaves requests for an idle slot does not take every core: they start
        # beside it at once (next in _run), each batch on its own cores.
        split = alone and _short(batch) and bool(self._idle and self.waiting)
        wide = self._mark_running(slot, batch, alone and not split)
        slot.submit(functools.partial(self._run_to_completion, slot, batch, wide, split))

    def _mark_running(self, slot, batch: list, alone: bool) -> bool:
        """Record the batch a slot now runs; returns whether it runs short on every core (wide):
        alone is whether it may (no other batch runs, none starts beside it)."""
        self._running[slot.index] = (len(batch), max(r.max_steps for r in batch))
        short = _short(batch)
        if not short and isinstance(batch[0], EngineRequest):
            self._joining[slot.index] = deque()
        wide = alone and short and slot.binding.can_widen
        self._wide = slot.index if wide else None
        return wide

    def _split_waiting(self) -> bool:
        """Whether the waiting requests are worth two short batches on their own cores rather
        than one on every core: SPLIT_AT or more, a short one at the front, another slot idle.

        Not for the arithmetic: alone, one batch on every core computes sooner (perf/wide_or_split.py,
        4 x 320 tokens: 16.6 against 24.4 ms; 16 x 320: 72.6 against 74.6), and beside a thread that
        takes a core now and then, as the event loop's does, the two come level. For the queue: a
        batch on every core holds every arrival until it ends, while two batches end at different
        times and the slot freed first takes what came meanwhile. Served with arrivals of their own,
        that brought fixed_steps' mean and P99 from 1.07-1.37x continuous's to 0.85-0.97x
        (perf/RESULTS.md, fifteenth session). A lone request or two still get every core."""
        return bool(self._idle) and len(self.waiting) >= SPLIT_AT and _short_request(self.waiting[0])

    def _worth_filling(self, others_busy: int) -> bool:
        """Whether a batch about to start should wait for company (see _fill)."""
        if not self._clients_on_their_way():
            # Every answered client is back already (another slot may have taken them): waiting
            # could only end at the timer or a freed slot, with the cores idle meanwhile. Or they
            # have not been coming back right away (requests arrive on their own): a wait would
            # hold these requests for arrivals no answer brings sooner.
            return False
        if others_busy > 0:
            expected = self._last_batch[0]
        elif self._loop.time() - self._released_at < self._last_batch[1]:
            # Every slot idle, the last batch finished less than its prefill ago: its clients are on
            # their way back, and those that waited through it are here. With one slot at concurrency
            # 2 this turns alternating batches of one into batches of two.
            expected = self._last_batch[0] + self._waited_at_release
        else:
            return False
        return len(self.waiting) < min(expected, self.budget.max_seqs) and not self.budget.filled_by(self.waiting)

    async def _fill(self) -> None:
        """Let a batch fill up before it starts, when that is likely to pay.

        Clients in a closed loop send their next requests right after their
        answers, so when a batch of k has just finished, about k requests are on
        their way; a slot that starts on the first of them runs a batch of one,
        and the next batches stay small. So, while another slot is still busy,
        wait until as many requests wait as the last finished batch held, or a
        slot comes free. And while every slot is idle but the last batch
        finished less than its prefill ago (with one slot, its clients come back
        to an idle server: without the wait, batches of one and of k-1
        alternate), wait for its k clients plus those that waited through it
        (at concurrency 2: batches of two, not alternating ones). Never longer
        than that batch's prefill took: a request waits at most one prefill's
        time for company. And never once as many requests have arrived as the
        finished batches answered: when two batches end together, their clients
        come back together, one slot takes all its budget allows, and the rest
        start on the other slot at once rather than wait for clients who are
        already here. A lone request on a quiet server never waits: the last
        batch held one, or finished long ago. Every wake-up is an arrival, a
        freed slot or that one deadline; nothing polls.
        """
        # The slot in hand counts as busy; "another slot" is any beyond it.
        others_busy = self.busy_slots - 1
        if not self._worth_filling(others_busy):
            return
        # With every other slot idle, the wait is for the last batch's clients: a prefill from its end.
        start = self._loop.time() if others_busy else self._released_at
        expired = False

        def expire() -> None:
            # A flag, not a clock comparison: uvloop's timers and loop.time() tick in whole
            # milliseconds, so a timer can fire while loop.time() still reads just before its
            # deadline, and a wait that compared clocks would sleep on with nothing left to wake it.
            nonlocal expired
            expired = True
            self._arrived.set()

        longest = self._last_batch[1]
        if self._return_delay:
            longest = min(longest, FILL_RETURNS * self._return_delay)
        timer = self._loop.call_at(start + longest, expire)
        # Measured on the clock the wait's timer runs on (whole milliseconds under uvloop, as fine
        # as the wait itself), so that a test's manual clock measures it too.
        began = self._loop.time()
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

    def _fair_share(self, slot) -> int:
        """At most this many requests for the new batch (0: no limit).

        A slot that frees up while others run short batches takes its share of
        the requests in the server, not all that wait: otherwise one big and one
        small batch alternate for good (a big one leaves few behind, whose
        clients come back together), and the small ones waste the slot. Only
        against short batches (prefill-heavy, a few steps), so that what is
        left waits for one short batch at most, never for a long generation.
        On an idle server, requests to split (_split_waiting) are shared the
        same way between the idle slots.
        """
        running = self._running.values()
        if not running:
            if slot.binding.can_widen and self._split_waiting():
                return -(-len(self.waiting) // (len(self._idle) + 1))  # this slot and the idle ones
            return 0
        if any(steps > SHORT_BATCH_STEPS for _, steps in running):
            return 0
        in_server = sum(size for size, _ in running) + len(self.waiting)
        return -(-in_server // self._num_slots)  # ceil

    def _release(self, slot, size: int, prefill_seconds: float) -> None:
        self._finished(slot, size, prefill_seconds)
        self._waited_at_release = self.drop_aborted()
        self._idle.append(slot)
        self._arrived.set()

    def _followed(self, slot, size: int, prefill_seconds: float, batch: list) -> None:
        """A wide batch ended and its slot went on with the next one (_follow_on)."""
        self._finished(slot, size, prefill_seconds)
        self._mark_running(slot, batch, alone=True)
        self._arrived.set()

    def _finished(self, slot, size: int, prefill_seconds: float) -> None:
        """The bookkeeping of a batch that ended: its clients are on their way back."""
        self._running.pop(slot.index, None)
        if self._wide == slot.index:
            self._wide = None
        self._generating.pop(slot.index, None)
        left = self._joining.pop(slot.index, None)
        if left:  # handed over too late for the batch that ended: first in line again
            with self._take_lock:
                self.waiting.extendleft(reversed(left))
        self._last_batch = (size, prefill_seconds)
        self._returning += size
        self._released_at = self._loop.time()
        self._owed.append([self._released_at, size])
        self._forget_stale(self._released_at)

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

    def _run_to_completion(self, slot, requests: list[QueuedRequest], wide: bool, split: bool = False) -> None:
        """On the slot's thread: run the batch; after a wide one, the batches that waited for it.
        split: the batch shares the waiting requests with an idle slot's, which starts next."""
        while True:
            prefill_seconds = self._run_batch(slot, requests, split)
            split = False
            following = self._follow_on(prefill_seconds) if wide else []
            if not following:
                self._loop.call_soon_threadsafe(self._release, slot, len(requests), prefill_seconds)
                return
            self._loop.call_soon_threadsafe(self._followed, slot, len(requests), prefill_seconds, following)
            requests = following
            wide = _short(following)

    def _follow_on(self, prefill_seconds) -> list[QueuedRequest]:
        """On the slot's thread, after a short batch on every core: the next batch, taken here.

        While a short batch runs on every core, a batch started beside it would share the cores
        with it (one thread each, or three threads on two cores): both take about as long as the
        two in turn, so the first answer comes later and the second no sooner (perf/RESULTS.md).
        So arrivals wait for it, as the continuous scheduler's next step would, and this thread
        takes them at once, without a round trip through the event loop. A long generation at the
        front goes back to the loop, which runs it where others can join it.
        """
        if self._return_delay <= prefill_seconds * RETURN_WITHIN:
            return []  # clients come back at once (closed loop): the loop lets the batch fill first
        with self._take_lock:
            if not self.waiting or self._split_waiting():
                return []  # nothing to do, or enough for two batches: the loop splits them (_fair_share)
            first = self.waiting[0]
            if isinstance(first, EngineRequest) and first.max_steps > SHORT_BATCH_STEPS:
                return []
            return self.budget.take(self.waiting)

    def _run_batch(self, slot, requests: list[QueuedRequest], split: bool = False) -> float:
        """On the slot's thread: prefill, then decode rounds until every sequence is done;
        returns the prefill's seconds. Each step takes every core while its batch runs alone
        (_alone), except a split batch's prefill at its start: its partner may not have started
        yet. Within a forward, the slot takes or gives back cores between layers by the same rule
        (binding.rebalance): a prefill that began beside another batch widens once that one ends.
        One rule for both, so that a step never starts on every core only to give one back at its
        first layer."""
        batch = None
        started = time.perf_counter()
        prefill_seconds = 0.0
        try:
            if isinstance(requests[0], BeamRequest):
                batch = BeamSearchBatch(self.runner, requests, self.metrics)
            else:
                batch = GenerationBatch(self.runner, requests, self.metrics)
                if slot.index in self._joining:
                    self._generating[slot.index] = batch
            binding = slot.binding
            binding.share_cores(not split and self._alone())
            self._deliver(batch.prefill())
            prefill_seconds = time.perf_counter() - started
            while batch:
                binding.share_cores(self._alone())
                joining = self._joining.get(slot.index)
                if joining:
                    new = self.budget.take(joining, len(batch), cache_in_use=batch.cache_in_use())
                    if new:
                        requests = requests + new  # answered with the batch if a forward fails
                        self._deliver(batch.add(new))
                        if not batch:
                            break
                self._deliver(batch.decode())
        except Exception as exc:
            log.exception("slot %d: batch of %d failed", slot.index, len(requests))
            # Every request not yet answered, those that were joining included.
            self._deliver(fail_all([r for r in requests if r.finish_reason is None], exc))
        finally:
            slot.busy_seconds += time.perf_counter() - started
            slot.batches_run += 1
        return prefill_seconds


def _short(batch: list) -> bool:
    """A prefill-bound batch: at most SHORT_BATCH_STEPS tokens a sequence."""
    return max(r.max_steps for r in batch) <= SHORT_BATCH_STEPS


def _long_request(request: QueuedRequest) -> bool:
    """A generation request of more than SHORT_BATCH_STEPS tokens (not a beam search)."""
    return isinstance(request, EngineRequest) and request.max_steps > SHORT_BATCH_STEPS


def _short_request(request: QueuedRequest) -> bool:
    """A generation request of at most SHORT_BATCH_STEPS tokens (beam searches are never split)."""
    return isinstance(request, EngineRequest) and request.max_steps <= SHORT_BATCH_STEPS
