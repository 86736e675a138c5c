"""The fixed-steps scheduler's rules (engine/fixed_steps.py): decisions over what the scheduler
tells them (what waits, which slots run what, the clock), tested through those numbers alone
(tests/test_scheduler_policies.py).

- ReturnEstimate: are the clients of finished batches on their way back, and is a batch worth
  holding for them (how long at most)?
- batch_share: how many requests the next batch takes (its fair share).
- The core rule (pick_slot, alone, split, wide, starts_split, follows_on): on a CPU, which batch
  takes every core (wide), when waiting requests are split between idle slots, and when a wide
  batch's thread takes what waited for it (follow-on).
- The join rule (seats, join_target, joins, join_instead): which long generations join a running
  batch instead of starting one of their own.

ReturnEstimate holds state (what it has seen of returning clients); everything else here is a pure
function of its arguments.

How the scheduler stands against the continuous one: perf/RESULTS.md, "The seed workload",
"SmolLM2 generation" and "Open loop". The experiments behind the constants (among them
perf/experiments/wide_or_split.py, one batch on every core against two on a core each) are in
perf/history/.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from .budget import BatchBudget
from .request import EngineRequest, QueuedRequest

# A batch waits for company only while finished batches' clients have been back within this
# share of a prefill, on average (RETURN_DELAY_WEIGHT: the weight of the latest batch in it).
# Clients in a closed loop are back within a small share of a prefill; arrivals of their own (open
# loop) come about one prefill later; at 0.5, open-loop bursts passed for clients.
RETURN_WITHIN = 0.2
RETURN_DELAY_WEIGHT = 0.25
FILL_RETURNS = 4  # a wait for company lasts at most this many average return delays (and a prefill)
MAX_OWED = 64  # finished batches whose clients are tracked
OWED_FOR = 2.0  # prefills: clients of a batch not back after this long are not counted on any more
SHORT_BATCH_STEPS = 4  # a batch of at most this many tokens per sequence is prefill-bound: short
# On an idle CPU server, at least this many short requests waiting are split between the idle slots,
# each batch on its own cores, rather than run as one batch on every core. Two waiting still run
# together, as a closed loop at concurrency 2 has it.
SPLIT_AT = 3


def short_batch(batch: Sequence[QueuedRequest]) -> bool:
    """A prefill-bound batch: at most SHORT_BATCH_STEPS tokens a sequence."""
    return max(r.max_steps for r in batch) <= SHORT_BATCH_STEPS


def long_request(request: QueuedRequest) -> bool:
    """A generation request of more than SHORT_BATCH_STEPS tokens (not a beam search)."""
    return isinstance(request, EngineRequest) and request.max_steps > SHORT_BATCH_STEPS


def short_request(request: QueuedRequest) -> bool:
    """A generation request of at most SHORT_BATCH_STEPS tokens (beam searches are never split)."""
    return isinstance(request, EngineRequest) and request.max_steps <= SHORT_BATCH_STEPS


class ReturnEstimate:
    """The clients answered by finished batches whose next requests have not arrived yet.

    A closed-loop estimate: every arrival counts as one of them coming back, the latest batch's
    first. Clients in a closed loop send their next request at once; requests that arrive on their
    own (open loop) repay a batch only as fast as they arrive, about a batch's time later, and
    waiting for them is waiting for strangers. return_delay, how long a finished batch's clients
    took to be back (a running average), tells the two apart: 0 until measured, a closed loop.
    """

    def __init__(self, return_delay: float = 0.0) -> None:
        self.return_delay = return_delay
        self.last_size = 0  # requests of the batch that finished last
        self.last_prefill = 0.0  # and its prefill's seconds
        self.released_at = -math.inf  # the clock when it finished
        self.waited_at_release = 0  # requests already waiting then
        self.returning = 0  # clients not back yet
        self._owed: deque[list] = deque()  # per batch, oldest first: [clock when it finished, clients not back]

    def finished(self, now: float, size: int, prefill_seconds: float) -> None:
        """A batch of `size` ended: its clients are on their way back."""
        self.last_size, self.last_prefill = size, prefill_seconds
        self.returning += size
        self.released_at = now
        self._owed.append([now, size])
        self._forget_stale(now)

    def arrived(self, now: float, count: int) -> None:
        """Count arrivals as the clients of finished batches coming back, the latest batch first;
        a batch whose clients are all back adds how long that took to the running average.

        Latest first: clients who never come back (a benchmark's warm-up, a client that left)
        stay at the bottom until they are too old to count. Oldest first, every later arrival
        paid for them and looked a whole batch late, closed loop or not."""
        if not self.returning:
            return
        self._forget_stale(now)
        self.returning = max(0, self.returning - count)
        while count and self._owed:
            entry = self._owed[-1]
            back = min(count, entry[1])
            entry[1] -= back
            count -= back
            if not entry[1]:
                self._owed.pop()
                self._returned_after(now - entry[0])

    def _forget_stale(self, now: float) -> None:
        """Batches whose clients are not all back OWED_FOR prefills after it ended: they are not
        coming (or come on their own); the wait so far goes into the average."""
        horizon = self.last_prefill * OWED_FOR
        while self._owed and (now - self._owed[0][0] > horizon or len(self._owed) > MAX_OWED):
            released_at, never = self._owed.popleft()
            self.returning -= never
            self._returned_after(now - released_at)

    def _returned_after(self, seconds: float) -> None:
        self.return_delay += RETURN_DELAY_WEIGHT * (seconds - self.return_delay)

    @property
    def on_their_way(self) -> bool:
        """Whether answered clients are about to be back: some are not yet, and finished batches'
        clients have been coming back within RETURN_WITHIN of a prefill (a closed loop)."""
        return bool(self.returning) and self.return_delay <= self.last_prefill * RETURN_WITHIN

    def back_at_once(self, prefill_seconds: float) -> bool:
        """Whether clients come back within RETURN_WITHIN of this prefill (a closed loop)."""
        return back_at_once(self.return_delay, prefill_seconds)

    def worth_waiting(self, now: float, waiting: Sequence[QueuedRequest], others_busy: int,
                      budget: BatchBudget) -> bool:
        """Whether a batch about to start should wait for company, with others_busy other slots
        running: while another slot is busy, until as many wait as the last batch held; with every
        slot idle and the last batch ended less than its prefill ago, for its clients plus those
        that waited through it (one slot at concurrency 2: batches of two, not alternating ones)."""
        if not self.on_their_way:
            # Every answered client is back already (another slot may have taken them): waiting
            # could only end at the timer or a freed slot, with the cores idle meanwhile. Or they
            # have not been coming back right away: a wait would hold these requests for arrivals
            # no answer brings sooner.
            return False
        if others_busy > 0:
            expected = self.last_size
        elif now - self.released_at < self.last_prefill:
            expected = self.last_size + self.waited_at_release
        else:
            return False
        return len(waiting) < min(expected, budget.max_seqs) and not budget.filled_by(waiting)

    def wait_deadline(self, now: float, others_busy: int) -> float:
        """When a wait for company that begins now ends at the latest: a prefill (with every other
        slot idle, from the last batch's end), and at most FILL_RETURNS average return delays."""
        start = now if others_busy else self.released_at
        longest = self.last_prefill
        if self.return_delay:
            longest = min(longest, FILL_RETURNS * self.return_delay)
        return start + longest


def back_at_once(return_delay: float, prefill_seconds: float) -> bool:
    """Whether clients that come back after return_delay are back within RETURN_WITHIN of this
    prefill (a closed loop)."""
    return return_delay <= prefill_seconds * RETURN_WITHIN


def batch_share(running: Iterable[tuple[int, int]], waiting: int, slots: int, idle: int, split: bool) -> int:
    """At most this many requests for the batch a slot starts now (0: no limit). running:
    (requests, steps) of every running batch; idle: the other idle slots; split: the waiting
    requests are to be shared between the idle slots (split()).

    A slot that frees up while others run short batches takes its share of the requests in the
    server, not all that wait: otherwise one big and one small batch alternate for good (a big
    one leaves few behind, whose clients come back together), and the small ones waste the
    slot. Only against short batches, so that what is left waits for one short batch at most,
    never for a long generation."""
    running = list(running)
    if not running:
        return -(-waiting // (idle + 1)) if split else 0  # this slot and the idle ones
    if any(steps > SHORT_BATCH_STEPS for _, steps in running):
        return 0
    return -(-(sum(size for size, _ in running) + waiting) // slots)  # ceil


# --- the core rule: on a CPU, how a short batch's slot shares the cores (StreamBinding.share_cores) ---
#
# A short batch that runs alone takes every core (wide), and nothing starts beside it: what arrives
# meanwhile waits for it, as it would for the continuous scheduler's next step, and its slot's thread
# takes it when it ends (follow-on); a batch beside it would share the cores, so the first answer
# comes later and the second no sooner. Once SPLIT_AT or more short requests wait on an idle server,
# the idle slots share them instead, each batch on its own cores: batches that end at different
# times let the slot freed first take what came meanwhile, so a queue drains sooner.

def pick_slot(idle: Sequence) -> int:
    """Which idle slot takes the next batch (its position in idle, the most recently freed last):
    one that may take every core while alone (binding.can_widen: runtime/executor.py says which)
    if idle, else the one freed last, so that at low load one thread (and its core's caches) works."""
    for i, slot in enumerate(idle):
        if slot.binding.can_widen:
            return i
    return len(idle) - 1


def alone(busy_slots: int, wide: bool, clients_on_their_way: bool) -> bool:
    """Whether a running batch may take every core now: not while another batch runs; nor, once
    that one has ended, while its clients are on their way back (they would start a batch on the
    freed slot: three threads on two cores). A wide batch keeps every core: what arrives waits for it."""
    return busy_slots == 1 and (wide or not clients_on_their_way)


def split(idle_slots: int, waiting: Sequence[QueuedRequest]) -> bool:
    """Whether the waiting requests are worth short batches on their own cores rather than one on
    every core: SPLIT_AT or more, a short one at the front, another slot idle. A lone request or
    two still get every core."""
    return idle_slots > 0 and len(waiting) >= SPLIT_AT and short_request(waiting[0])


def wide(alone: bool, batch: Sequence[QueuedRequest], can_widen: bool) -> bool:
    """Whether a batch starting on a slot that may widen runs on every core: short, and alone."""
    return alone and can_widen and short_batch(batch)


def starts_split(alone: bool, batch: Sequence[QueuedRequest], idle_slots: int, waiting: int) -> bool:
    """A short batch that leaves requests for an idle slot does not take every core: they start
    beside it at once, each batch on its own cores."""
    return alone and short_batch(batch) and idle_slots > 0 and waiting > 0


def follows_on(waiting: Sequence[QueuedRequest], idle_slots: int, back_at_once: bool) -> bool:
    """After a wide batch, on its thread: whether that thread takes the next batch itself, without
    a round trip through the event loop. Not when clients come back at once (a closed loop: the
    loop lets the batch fill first), nor with nothing waiting, nor enough to split (the loop shares
    them), nor a long generation at the front (the loop runs it where others can join it)."""
    if back_at_once or not waiting or split(idle_slots, waiting):
        return False
    return not long_request(waiting[0])


# --- the join rule: long generations joining a running generation batch at its next step ---
#
# While every slot is busy, generation requests that arrive join the running long generation batch
# with the fewest sequences, as under the continuous scheduler, instead of waiting for a whole
# batch. On a CPU they join it even with a slot idle while it runs alone on every core: decode is
# bound by reading the weights, and a step reads every weight once whatever its rows, so one batch
# on every core beats two on a core each. Short, prefill-heavy batches still start on their own;
# beam searches never join.

def seats(max_seqs: int, seated: int, joining: int) -> int:
    """Sequences a running generation batch can still take in."""
    return max_seqs - seated - joining


def join_target(sizes: Mapping[int, int]) -> int:
    """The slot whose batch joiners go to: sizes, slot -> sequences running and joining."""
    return min(sizes, key=sizes.__getitem__)


def joins(request: QueuedRequest, long_only: bool, seats: int) -> bool:
    """Whether the request at the front of the queue joins the target batch. long_only (with a
    slot idle: join_instead): only a long generation, and only into a free seat."""
    if not isinstance(request, EngineRequest):
        return False  # a beam search waits for a slot of its own
    return not long_only or (long_request(request) and seats > 0)


def join_instead(busy_slots: int, joinable: int, can_widen: bool, front: QueuedRequest | None, seats: int) -> bool:
    """Whether the long generation at the front of the queue joins the one long generation batch
    that runs alone (on a slot that may widen), rather than start a batch of its own on an idle
    slot. Not on accelerators, whose slots overlap on streams of their own."""
    return (busy_slots == 1 and joinable == 1 and front is not None and can_widen
            and long_request(front) and seats > 0)
