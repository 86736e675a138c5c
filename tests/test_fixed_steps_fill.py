"""The fixed-steps batcher lets a batch fill while another slot is busy or the
last batch's clients are coming back, never makes a lone request on a quiet
server wait, nor any request longer than a prefill, and takes a fair share of
the requests while the other slots run short batches."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from xllm_async.config import Settings
from xllm_async.engine.budget import BatchBudget
from xllm_async.engine.fixed_steps import FixedStepsScheduler
from xllm_async.engine.handoff import SlotHandoff, WaitingQueue
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.policies import FILL_RETURNS, RETURN_WITHIN, SPLIT_AT, ReturnEstimate
from xllm_async.engine.request import EngineRequest
from xllm_async.metrics import Metrics
from xllm_async.runtime.model_runner import ModelRunner
from xllm_async.service import Service

from .client import post


class HeldSlot:
    """A slot that keeps every job it is given (so it stays busy) and records its batch.
    wide: a CPU slot that takes every core while the others are idle (StreamBinding.can_widen)."""

    def __init__(self, index: int, wide: bool = False) -> None:
        self.index = index
        self.binding = SimpleNamespace(can_widen=wide)
        self.batches: list[list] = []

    def submit(self, job) -> None:
        self.batches.append(job.args[1])  # StepLoop.run_handed(handoff, batch, wide, split)


def request(max_tokens: int = 1, prompt_len: int = 3) -> EngineRequest:
    return EngineRequest(0, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), sink=None)


def finished_elsewhere(batcher: FixedStepsScheduler, clock, size: int, prefill_seconds: float) -> None:
    """As if a batch of `size` had just finished on a slot outside the test: its clients are on their way."""
    batcher.returns.finished(clock.time(), size, prefill_seconds)
    batcher._publish()  # (the scheduler tells its slots after every change it makes itself)


async def started(batcher: FixedStepsScheduler, slots: list[HeldSlot]) -> list[list]:
    for _ in range(20):  # loop iterations, not time: the batcher coroutine runs whatever is due
        await asyncio.sleep(0)
    return [b for s in slots for b in s.batches]


class ManualClock:
    """The running loop, but with a clock that moves only when the test says (advance): the
    batcher's timers fire then, and never because the machine was slow. `lag` makes time()
    read that much behind the clock the timers use, as uvloop's millisecond clock can."""

    def __init__(self, loop, lag: float = 0.0) -> None:
        self._loop = loop
        self._now = 1000.0
        self._lag = lag
        self._timers: list[asyncio.TimerHandle] = []

    def time(self) -> float:
        return self._now - self._lag

    def call_at(self, when: float, callback, *args) -> asyncio.TimerHandle:
        timer = asyncio.TimerHandle(when, callback, args, self._loop)
        self._timers.append(timer)
        return timer

    def call_later(self, delay: float, callback, *args) -> asyncio.TimerHandle:
        return self.call_at(self._now + delay, callback, *args)

    def advance(self, seconds: float) -> None:
        self._now += seconds
        due = sorted((t for t in self._timers if t.when() <= self._now and not t.cancelled()),
                     key=lambda t: t.when())
        self._timers = [t for t in self._timers if t not in due and not t.cancelled()]
        for timer in due:
            timer._run()

    def __getattr__(self, name):
        return getattr(self._loop, name)


@contextlib.asynccontextmanager
async def running_batcher(num_slots: int, lag: float = 0.0, metrics=None, wide: bool = False):
    """A running batcher over slots that never finish on their own, on a manual clock:
    (batcher, slots, clock). wide: slot 0 takes every core while alone, as on a CPU."""
    slots = [HeldSlot(i, wide and i == 0) for i in range(num_slots)]
    clock = ManualClock(asyncio.get_running_loop(), lag)
    steps = {slot.index: SimpleNamespace(run_handed=None) for slot in slots}  # HeldSlot never runs them
    batcher = FixedStepsScheduler(steps, slots, BatchBudget(256, 8192), clock, metrics)
    batcher.start()
    try:
        yield batcher, slots, clock
    finally:
        await batcher.stop()


@pytest.fixture
async def two_slots():
    async with running_batcher(2) as running:
        yield running


async def test_a_request_starts_at_once_when_no_other_slot_is_busy(two_slots):
    batcher, slots, clock = two_slots
    batcher.returns.last_size, batcher.returns.last_prefill = 8, 10.0  # a big batch, a long prefill, long ago
    batcher.add([request()])
    assert [len(b) for b in await started(batcher, slots)] == [1]


async def test_on_an_idle_server_the_last_batchs_clients_are_waited_for(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request()])
    batcher.ended(slots[0], 3, 10.0)  # a batch of 3 just finished: every slot idle now
    batcher.add([request()])
    assert len(await started(batcher, slots)) == 1  # the first one back waits for the others...
    batcher.add([request(), request()])
    assert [len(b) for b in await started(batcher, slots)] == [1, 3]  # ...and leaves with them


async def test_on_an_idle_server_the_wait_ends_a_prefill_after_the_last_batch(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request()])
    batcher.ended(slots[0], 16, 0.05)
    batcher.add([request()])
    assert len(await started(batcher, slots)) == 1
    clock.advance(0.04)
    assert len(await started(batcher, slots)) == 1  # still waiting 40 ms on
    clock.advance(0.02)
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]  # it went alone after 50 ms


@pytest.fixture
async def one_slot():
    async with running_batcher(1) as running:
        yield running


async def test_one_slot_at_concurrency_two_runs_batches_of_two_not_alternating_ones(one_slot):
    batcher, slots, clock = one_slot
    batcher.add([request()])  # client A's request runs...
    batcher.add([request()])  # ...while client B's waits
    batcher.ended(slots[0], 1, 10.0)  # A's answer goes out: A comes back, B is here
    assert len(await started(batcher, slots)) == 1  # B does not start alone...
    batcher.add([request()])
    assert [len(b) for b in await started(batcher, slots)] == [1, 2]  # ...but with A's next


async def test_requests_answered_while_waiting_leave_the_queue_when_a_batch_ends(one_slot):
    batcher, slots, clock = one_slot
    batcher.add([request(max_tokens=500)])
    gone = [request(), request()]
    batcher.add(gone)
    assert batcher.num_waiting == 2
    for req in gone:
        req.done = req.aborted = True  # timed out or the client left
    batcher.ended(slots[0], 1, 10.0)
    assert batcher.num_waiting == 0  # not counted against the queue limit while a batch fills


async def test_a_lone_client_never_waits_after_its_own_batch(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request()])
    batcher.ended(slots[0], 1, 10.0)  # concurrency 1: the last batch held one request
    batcher.add([request()])
    assert [len(s.batches) for s in slots] == [2, 0]  # started inside add(), as on a quiet server


async def test_with_a_busy_slot_the_batch_fills_to_the_last_batch_size(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request(max_tokens=500)])  # long: no fair-share limit applies against it
    await started(batcher, slots)  # slot 0 is now busy for good
    finished_elsewhere(batcher, clock, 3, 10.0)
    batcher.add([request()])
    assert len(await started(batcher, slots)) == 1  # the lone request waits for company...
    batcher.add([request(), request()])
    assert [len(b) for b in await started(batcher, slots)] == [1, 3]  # ...and leaves with it


async def test_a_fill_beside_a_busy_slot_ends_when_that_slot_comes_free(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request(max_tokens=500)])
    await started(batcher, slots)
    finished_elsewhere(batcher, clock, 3, 10.0)
    batcher.add([request()])
    assert len(await started(batcher, slots)) == 1  # waiting for company beside the busy slot...
    batcher.ended(slots[0], 5, 10.0)
    # ...until that slot frees: then it starts, rather than both slots waiting for the freed
    # batch's clients.
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]


async def test_once_every_answered_client_is_back_a_freed_slot_waits_no_more(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request(prompt_len=320) for _ in range(16)])
    batcher.add([request(prompt_len=320) for _ in range(16)])
    batcher.ended(slots[0], 16, 10.0)  # both batches end at once: 32 clients on their way back
    batcher.ended(slots[1], 16, 10.0)
    batcher.add([request(prompt_len=320) for _ in range(32)])  # all back together
    # The token budget (8192) lets one slot take 25; the other slot starts on the other 7 at
    # once: nobody else is coming, so waiting for company would idle it for a whole prefill.
    # (No slot here may widen, so the one freed last, slot 1, takes the first: policies.pick_slot.)
    await started(batcher, slots)
    assert [[len(b) for b in s.batches] for s in slots] == [[16, 7], [16, 25]]


async def test_a_batch_that_waited_for_company_is_counted_with_its_wait():
    metrics = Metrics()
    async with running_batcher(2, metrics=metrics) as (batcher, slots, clock):
        batcher.add([request()])  # a quiet server: starts at once, no wait
        finished_elsewhere(batcher, clock, 2, 10.0)
        batcher.add([request()])  # beside the busy slot: waits for the other client
        await started(batcher, slots)
        clock.advance(0.02)  # (far inside the wait's 10 s limit: only the arrival ends it)
        batcher.add([request()])
        await started(batcher, slots)
    assert [len(b) for s in slots for b in s.batches] == [1, 2]
    fill = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode())
            if f.name == "xllm:batch_fill_wait_seconds" for s in f.samples}
    assert fill["xllm:batch_fill_wait_seconds_count"] == 1
    assert fill["xllm:batch_fill_wait_seconds_sum"] == pytest.approx(0.02)  # the manual clock's seconds


async def test_the_wait_never_exceeds_the_last_prefill(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request()])
    await started(batcher, slots)
    finished_elsewhere(batcher, clock, 16, 0.05)
    batcher.add([request()])
    assert len(await started(batcher, slots)) == 1
    clock.advance(0.04)
    assert len(await started(batcher, slots)) == 1  # still waiting 40 ms on
    clock.advance(0.02)
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]  # it went alone after 50 ms


async def test_against_short_batches_a_slot_takes_its_fair_share(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request() for _ in range(2)])
    await started(batcher, slots)  # slot 0 runs 2 one-token requests (short) for good
    batcher.add([request() for _ in range(6)])
    # 2 running + 6 waiting over 2 slots: 4 each, so 2 stay for slot 0's turn.
    assert [len(b) for b in await started(batcher, slots)] == [2, 4]
    assert len(batcher.waiting) == 2


async def test_against_a_long_batch_a_slot_takes_everything(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request(max_tokens=500)])
    await started(batcher, slots)
    batcher.add([request() for _ in range(6)])
    assert [len(b) for b in await started(batcher, slots)] == [1, 6]  # nobody left behind a long one


async def test_on_an_idle_server_add_starts_the_batch_before_returning(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request()])
    assert [len(s.batches) for s in slots] == [1, 0]  # no loop iteration in between


async def test_the_most_recently_freed_slot_is_taken_first(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request()])
    batcher.add([request()])  # both slots busy now
    batcher.ended(slots[1], 1, 0.001)
    batcher.ended(slots[0], 1, 0.001)
    batcher.add([request()])
    assert [len(s.batches) for s in slots] == [2, 1]  # slot 0 came free last: its thread is warm


async def test_a_wait_ends_when_its_timer_fires_whatever_the_clock_reads():
    # time() reads 5 ms behind the timers' clock: the timer fires while time() still reads
    # before its deadline.
    async with running_batcher(1, lag=0.005) as (batcher, slots, clock):
        batcher.add([request()])
        batcher.ended(slots[0], 16, 0.02)  # 16 clients coming back: the next request waits for them
        batcher.add([request()])
        assert len(await started(batcher, slots)) == 1
        clock.advance(0.02)
        await started(batcher, slots)
        assert [len(b) for b in slots[0].batches] == [1, 1]  # it went alone when the timer fired


async def test_requests_that_arrive_on_their_own_are_not_waited_for(two_slots):
    # Open loop: each finished batch's "clients" are repaid only by arrivals that come a whole
    # prefill later (strangers, not clients coming back). Once that is the average, a free slot
    # beside a busy one starts at once instead of holding its request for company.
    batcher, slots, clock = two_slots
    batcher.add([request(max_tokens=500)])  # slot 0 busy for good
    await started(batcher, slots)
    for _ in range(8):
        finished_elsewhere(batcher, clock, 2, 0.010)
        clock.advance(0.012)  # the next arrivals come a prefill and more after the batch ended
        batcher.returns.arrived(clock.time(), 2)
    assert batcher.returns.return_delay > 0.010 * 0.5
    finished_elsewhere(batcher, clock, 3, 0.010)
    batcher.add([request()])
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]  # started, no wait


async def test_clients_that_come_back_at_once_are_still_waited_for(two_slots):
    batcher, slots, clock = two_slots
    batcher.add([request(max_tokens=500)])
    await started(batcher, slots)
    for _ in range(8):
        finished_elsewhere(batcher, clock, 2, 0.010)
        clock.advance(0.0005)  # closed loop: back within a twentieth of a prefill
        batcher.returns.arrived(clock.time(), 2)
    finished_elsewhere(batcher, clock, 3, 0.010)
    batcher.add([request()])
    assert len(await started(batcher, slots)) == 1  # this one waits for company


async def test_clients_who_never_come_back_do_not_hide_a_closed_loop(two_slots):
    # A benchmark's warm-up ends with 16 answered clients who never send again. Then a closed
    # loop: batches of 2 every 10 ms, their clients back within half a millisecond. Counted
    # oldest batch first, every arrival paid for the warm-up's clients and looked 8 batches late.
    batcher, slots, clock = two_slots
    finished_elsewhere(batcher, clock, 16, 0.010)
    for _ in range(16):
        finished_elsewhere(batcher, clock, 2, 0.010)
        clock.advance(0.0005)
        batcher.returns.arrived(clock.time(), 2)
        clock.advance(0.0095)
    assert batcher.returns.return_delay < 0.010 * RETURN_WITHIN
    assert batcher.returns.returning == 0  # the warm-up's clients are no longer counted on


@pytest.fixture
async def wide_slot():
    async with running_batcher(2, wide=True) as running:
        yield running


async def test_nothing_starts_beside_a_short_batch_on_every_core(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.add([request()])  # alone on an idle server: slot 0 takes every core
    assert batcher.wide_slot == 0
    batcher.add([request(), request()])
    assert [len(b) for b in await started(batcher, slots)] == [1]  # slot 1 stays idle...
    assert len(batcher.waiting) == 2  # ...and they wait for slot 0


async def test_beside_a_long_generation_a_free_slot_starts_as_before(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.add([request(max_tokens=500)])  # long: decode-bound, shares its cores from its next step
    assert batcher.wide_slot is None
    batcher.add([request()])
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]


async def test_beside_a_long_generation_on_every_core_long_ones_join_it(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.add([request(max_tokens=500)])  # alone: its decode steps take every core
    batcher.add([request(max_tokens=200), request(max_tokens=300)])
    assert [len(b) for b in await started(batcher, slots)] == [1]  # slot 1 stays idle...
    assert batcher.joining[0] == 2 and not batcher.waiting  # ...they join at its next step
    batcher.add([request()])  # a short one still gets a batch of its own
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]


async def test_long_ones_join_only_into_free_seats(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.budget = BatchBudget(3, 8192)
    batcher.add([request(max_tokens=500)])
    batcher.add([request(max_tokens=500) for _ in range(3)])  # two seats left: the third starts beside
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]
    assert batcher.joining[0] == 2
    batcher.ended(slots[1], 1, 0.010)
    seated = Seated([request(max_tokens=500)])  # slot 0's batch, as its thread made it...
    batcher.handoff(0).made(seated)
    assert len(batcher.handoff(0).joiners(seated)) == 2  # ...took them in, and two of its three have finished since
    batcher.add([request(max_tokens=500) for _ in range(3)])
    assert batcher.joining[0] == 2 and len(batcher.waiting) == 0  # its two free seats, and...
    assert [len(b) for b in await started(batcher, slots)] == [1, 1, 1]  # ...slot 1 for the last


async def test_long_ones_do_not_join_a_batch_on_a_slot_that_cannot_widen(two_slots):
    batcher, slots, clock = two_slots  # an accelerator's slots overlap on their own streams
    batcher.add([request(max_tokens=500)])
    batcher.add([request(max_tokens=500)])
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]


async def test_after_a_wide_batch_its_own_thread_takes_what_waited(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.returns.return_delay = 0.010  # requests arrive on their own: a prefill after an answer
    batcher.add([request()])
    batcher.add([request(), request()])
    following = batcher.handoff(0).follow_on(0.010)  # what slot 0's thread does at its end
    assert len(following) == 2 and not batcher.waiting
    batcher.followed(slots[0], 1, 0.010, following)
    assert batcher.wide_slot == 0 and batcher.running[0] == (2, 1)  # still alone on every core
    batcher.add([request()])
    assert len(await started(batcher, slots)) == 1 and len(batcher.waiting) == 1  # waits for it again
    batcher.ended(slots[0], 2, 0.010)  # nothing was waiting when it ended: the loop starts the rest
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]
    assert batcher.wide_slot == 0


async def test_a_follow_on_batch_stays_on_every_core_when_requests_arrive_as_it_is_taken(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.returns.return_delay = 0.010
    batcher.add([request()])
    batcher.add([request()])
    following = batcher.handoff(0).follow_on(0.010)  # slot 0's thread takes it...
    batcher.add([request()])  # ...and one more arrives before the loop hears of it
    batcher.followed(slots[0], 1, 0.010, following)
    assert batcher.wide_slot == 0  # the thread runs it on every core: nothing may start beside it
    assert len(await started(batcher, slots)) == 1 and len(batcher.waiting) == 1


async def test_in_a_closed_loop_a_wide_batch_hands_back_so_the_next_one_fills(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.returns.return_delay = 0.0005  # clients back within a twentieth of a prefill
    batcher.add([request()])  # client A's request runs on every core...
    batcher.add([request()])  # ...while client B's waits
    assert batcher.handoff(0).follow_on(0.010) == []  # not taken on the thread...
    batcher.ended(slots[0], 1, 0.010)
    assert len(await started(batcher, slots)) == 1  # ...B waits for A's next request...
    batcher.add([request()])
    assert [len(b) for b in await started(batcher, slots)] == [1, 2]  # ...and they run together


async def test_a_long_generation_at_the_front_goes_back_to_the_loop(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.returns.return_delay = 0.010
    batcher.add([request()])
    batcher.add([request(max_tokens=500), request()])
    assert batcher.handoff(0).follow_on(0.010) == []
    assert len(batcher.waiting) == 2


async def test_on_an_idle_server_enough_short_requests_split_between_the_slots(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.add([request() for _ in range(5)])  # five arrive at once: 3 + 2, each on its own cores
    assert [len(b) for b in await started(batcher, slots)] == [3, 2]
    assert batcher.wide_slot is None and not batcher.waiting


async def test_a_split_batch_is_told_it_is_alone_once_its_partner_ends(wide_slot):
    """What a slot's thread reads before each step and between a forward's layers (its handoff's
    may_widen, which the scheduler publishes from batcher.alone): split batches run on their own
    cores while both run, and the one left takes every core, unless the ended batch's clients are
    coming right back (closed loop) to start one on the freed slot."""
    batcher, slots, clock = wide_slot
    for return_delay, alone_after in ((3600.0, True), (0.0, False)):  # open loop, closed loop
        batcher.returns = ReturnEstimate(return_delay)
        batcher.add([request() for _ in range(4)])
        assert [len(b) for b in await started(batcher, slots)][-2:] == [2, 2]
        assert not batcher.alone() and not batcher.handoff(0).may_widen
        batcher.ended(slots[1], 2, 0.010)
        assert batcher.alone() is alone_after and batcher.handoff(0).may_widen is alone_after
        batcher.ended(slots[0], 2, 0.010)


def test_a_slot_that_may_widen_has_its_cores_follow_the_rule_between_layers():
    told = []
    slot = SimpleNamespace(index=0, binding=SimpleNamespace(can_widen=True, share_cores=told.append))
    handoff = SlotHandoff(slot, WaitingQueue(), BatchBudget(8, 64), post=None)
    handoff.cores()
    handoff.may_widen = True  # the loop published a change
    handoff.cores()
    assert told == [False, True]


async def test_fewer_than_split_at_run_together_on_every_core(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.add([request() for _ in range(SPLIT_AT - 1)])
    assert [len(b) for b in await started(batcher, slots)] == [SPLIT_AT - 1]
    assert batcher.wide_slot == 0


async def test_a_wide_batch_keeps_every_core_while_clients_are_on_their_way(wide_slot):
    """Arrivals wait for a wide batch, so clients coming back start nothing beside it: it does
    not give a core back between layers (batcher.alone) for them."""
    batcher, slots, clock = wide_slot
    batcher.add([request()])
    await started(batcher, slots)
    assert batcher.wide_slot == 0
    finished_elsewhere(batcher, clock, 4, 0.010)  # closed loop: four clients on their way
    assert batcher.returns.on_their_way and batcher.alone() and batcher.handoff(0).may_widen


class Seated(list):
    """A running generation batch's rows, as the budget sees them when requests join it."""

    def cache_in_use(self) -> tuple[int, int]:
        return len(self), 0


class _StepsBatch:
    """Stands in for GenerationBatch in StepLoop.run: `steps` decode steps, each one noting the
    thread count its slot was told to use at the step's start."""

    def __init__(self, binding, steps: int, between_layers) -> None:
        self.binding, self.left, self.told, self.between_layers = binding, steps, [], between_layers

    def __len__(self) -> int:
        return self.left

    def prefill(self) -> list:
        self.told.append(self.binding.told[-1])
        return []

    def decode(self) -> list:
        self.told.append(self.binding.told[-1])
        self.left -= 1
        return []


async def test_a_step_starts_on_the_cores_the_layers_would_give_it(wide_slot, monkeypatch):
    """A step's start asks the scheduler what its layers do (batcher.alone): a lone long generation
    runs its steps on its share while finished batches' clients are on their way (a closed loop:
    they start beside it), on every core once they are back, never wide for one layer only."""
    from xllm_async.execution import steps

    batcher, slots, clock = wide_slot
    binding = slots[0].binding
    binding.told = []
    binding.share_cores = lambda alone: binding.told.append(alone)
    made = []
    monkeypatch.setattr(steps, "GenerationBatch", lambda runner, requests, metrics, between_layers:
                        made.append(_StepsBatch(binding, 2, between_layers)) or made[-1])
    loop = steps.StepLoop(None, SimpleNamespace(index=0, busy_seconds=0.0, batches_run=0), lambda items: None)
    batcher.add([request(max_tokens=500)])  # slot 0 runs a lone long generation
    assert batcher.wide_slot is None and batcher.busy_slots == 1
    handoff = batcher.handoff(0)
    cores = handoff.cores
    finished_elsewhere(batcher, clock, 4, 0.010)  # closed loop: four clients on their way
    for _ in range(2):
        binding.share_cores(handoff.may_widen)  # before the prefill (StepLoop.run_handed)
        loop.run([request(max_tokens=500)], cores=cores)
        batcher.returns.arrived(clock.time(), 4)  # they are back
        batcher._publish()
    assert [b.told for b in made] == [[False] * 3, [True] * 3]
    assert all(b.between_layers == cores for b in made)  # the batch's forwards call it between layers


async def test_long_generations_and_slots_that_cannot_widen_are_not_split(two_slots, wide_slot):
    for batcher, slots, max_tokens in ((two_slots[0], two_slots[1], 1), (wide_slot[0], wide_slot[1], 500)):
        batcher.add([request(max_tokens=max_tokens) for _ in range(4)])
        assert [len(b) for b in await started(batcher, slots)] == [4]  # on an accelerator / a long generation


async def test_after_a_wide_batch_enough_waiting_go_back_to_the_loop_to_split(wide_slot):
    batcher, slots, clock = wide_slot
    batcher.returns.return_delay = 0.010  # requests arrive on their own
    batcher.add([request()])  # alone, on every core
    batcher.add([request() for _ in range(4)])  # arrive meanwhile: too many for one thread's follow-on
    assert batcher.handoff(0).follow_on(0.010) == [] and len(batcher.waiting) == 4
    batcher.ended(slots[0], 1, 0.010)
    assert [len(b) for b in await started(batcher, slots)] == [1, 2, 2]
    assert batcher.wide_slot is None


async def test_a_wait_for_company_lasts_a_few_return_delays_at_most(one_slot):
    batcher, slots, clock = one_slot
    batcher.returns.return_delay = 0.002
    batcher.add([request()])
    batcher.ended(slots[0], 16, 0.100)  # 16 clients on their way, usually back within 2 ms
    batcher.add([request()])
    clock.advance(FILL_RETURNS * 0.002 - 0.001)
    assert len(await started(batcher, slots)) == 1  # still waiting...
    clock.advance(0.002)
    assert len(await started(batcher, slots)) == 2  # ...not a whole 100 ms prefill


async def test_requests_that_fill_a_batch_wait_for_nobody(one_slot):
    batcher, slots, clock = one_slot
    batcher.add([request()])
    batcher.ended(slots[0], 16, 10.0)  # 16 clients on their way
    batcher.add([request(prompt_len=5000), request(prompt_len=5000)])  # over the 8,192-token budget
    assert [len(b) for b in await started(batcher, slots)] == [1, 1]  # the first goes at once


GATE = 4243  # a prompt holding this token id waits in its prefill until the test opens the gate


class GatedRunner(ModelRunner):
    """Records each prefill's thread and batch size (before its answers go out, so a test that
    has its answers sees them recorded)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.gate = threading.Event(), threading.Event()
        self.prefills: list[tuple[str, int]] = []

    def prefill(self, prompts, capacity=0, into=None, between_layers=None, hits=None):
        self.prefills.append((threading.current_thread().name, len(prompts)))
        if any(GATE in p for p in prompts):
            self.entered.set()
            self.gate.wait(120)
        return super().prefill(prompts, capacity, into, between_layers, hits)


@pytest.mark.parametrize("arrive", [2, 3])
async def test_served_requests_wait_for_the_wide_batch_and_follow_it_on_its_thread(tiny_model_dir, arrive):
    """Through the real server and slot threads: while a short batch runs alone on every core,
    requests that arrive on their own wait for it; then its thread runs them next, in one batch,
    or, SPLIT_AT of them and more, the two slots share them."""
    settings = Settings(model=tiny_model_dir, port=0, scheduler="fixed_steps", concurrent_execute_stream_num=2,
                        access_log="off")
    runner = GatedRunner(tiny_model_dir, torch.device("cpu"))
    service = Service(settings, runner=runner)
    await service.start()
    port, batcher = service.http.port, service.engine.scheduler
    binding = service.slots[0].binding
    binding.all_threads = max(binding.all_threads, binding.cpu_threads + 1)  # on a 1-core machine too
    batcher.returns.return_delay = 3600.0  # requests arrive on their own (open loop)
    body = {"max_tokens": 1}
    try:
        first = asyncio.create_task(asyncio.to_thread(post, port, "/v1/completions", {**body, "prompt": [1, GATE, 3]}))
        assert await asyncio.to_thread(runner.entered.wait, 120)
        others = [asyncio.create_task(asyncio.to_thread(post, port, "/v1/completions", {**body, "prompt": [1, 2, n]}))
                  for n in range(5, 5 + arrive)]
        for _ in range(12000):  # until they all wait: bounded, never timed
            if len(batcher.waiting) == arrive:
                break
            await asyncio.sleep(0.01)
        assert len(batcher.waiting) == arrive and batcher.wide_slot == 0
        runner.gate.set()
        results = await asyncio.gather(first, *others)
        assert all(status == 200 and answer["usage"]["completion_tokens"] == 1 for status, answer, _ in results)
        if arrive < SPLIT_AT:
            assert runner.prefills == [("xllm-slot-0", 1), ("xllm-slot-0", arrive)]
        else:
            assert runner.prefills[0] == ("xllm-slot-0", 1)
            assert sorted(runner.prefills[1:]) == [("xllm-slot-0", 2), ("xllm-slot-1", 1)]
        assert service.engine.unfinished == set()
    finally:
        runner.gate.set()
        await service.shutdown()
