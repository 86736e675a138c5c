"""The step loop both schedulers run on a slot's thread: prefill a batch, then every step let
the requests that join it in and decode, until every sequence is done; a forward that raises
answers its requests with the error."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..engine.handoff import SlotHandoff
from ..engine.policies import short_batch
from ..engine.request import BeamRequest, QueuedRequest
from ..engine.score_request import ScoreRequest
from .batch import GenerationBatch, fail_all
from .beam import BeamSearchBatch
from .grammar import Grammars
from .prepare import prepare
from .score_batch import ScoreBatch

log = logging.getLogger("xllm_async.scheduler")


class Execution:
    """What the engine on the loop is given of the slot side (service.py builds it): the runner, a
    step loop for each slot, and what a request needs before it joins a batch (prepare.py). The
    engine calls these and imports none of them."""

    __slots__ = ("runner", "grammars")

    def __init__(self, runner) -> None:
        self.runner = runner
        self.grammars = Grammars(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)

    def step_loop(self, slot, deliver: Callable[[list], None], metrics=None) -> StepLoop:
        return StepLoop(self.runner, slot, deliver, metrics)

    def prepare(self, request: QueuedRequest) -> None:
        prepare(self.runner, request)

    def compile_grammar(self, kind: str, text: str):
        """A structured output's grammar, compiled (blocks: the engine calls it on its compile threads)."""
        return self.grammars.compile(kind, text)


class StepLoop:
    """One slot's batches, one at a time, on that slot's thread (as nano-vllm's engine loop
    serves its scheduler: the scheduler decides what runs, this runs it).

    deliver hands each step's [(request, delta), ...] to the event loop (thread-safe). A failed
    prefill or decode answers every unanswered request of the batch with the error and ends it; a
    failed join answers only the requests that were joining, and the batch goes on without them.
    """

    def __init__(self, runner, slot, deliver: Callable[[list], None], metrics=None) -> None:
        self.runner = runner
        self.slot = slot
        self.metrics = metrics
        self.stopping = False  # set from outside: the loop ends after the step under way
        self._deliver = deliver

    def run(self, requests: list[QueuedRequest], joiners: Callable[[object], list] | None = None,
            cores: Callable[[], None] | None = None, started: Callable[[object], None] | None = None) -> float:
        """Run one batch of requests to completion; returns its prefill's seconds.

        joiners(batch): before every step, the requests that join the batch now (prefilled into it
        first). cores(): before every step after the prefill, and between a forward's layers, takes
        or gives back CPU cores as the scheduler's core rule says now (StreamBinding.share_cores),
        so that a prefill begun beside another slot's batch widens once that one ends, and a step
        never starts on every core only to give one back at its first layer. started(batch): told
        the batch once it exists."""
        slot = self.slot
        mark = time.perf_counter()
        prefill_seconds = 0.0
        batch = None
        try:
            if isinstance(requests[0], BeamRequest):
                batch = BeamSearchBatch(self.runner, requests, self.metrics, cores)
            elif isinstance(requests[0], ScoreRequest):
                batch = ScoreBatch(self.runner, requests, self.metrics, cores)
            else:
                batch = GenerationBatch(self.runner, requests, self.metrics, cores)
            if started is not None:
                started(batch)
            self._deliver(batch.prefill())
            prefill_seconds = time.perf_counter() - mark
            while batch and not self.stopping:
                mark = self._count(mark)
                if cores is not None:
                    cores()
                new = joiners(batch) if joiners is not None else None
                if new:
                    requests = requests + new  # answered with the batch if a later step fails
                    self._join(batch, new)
                else:
                    self._deliver(batch.decode())
        except Exception as exc:
            log.exception("slot %d: batch of %d failed", slot.index, len(requests))
            self._deliver(fail_all([r for r in requests if r.finish_reason is None], exc))
        finally:
            self._count(mark)
            slot.batches_run += 1  # a prefill batch, answered or failed
        return prefill_seconds

    def run_handed(self, handoff: SlotHandoff, requests: list[QueuedRequest], wide: bool, split: bool) -> None:
        """The fixed-steps scheduler's batch, handed through the slot's handoff: run it; after a
        wide one, the batches that waited for it (follow-on). split: the batch shares the waiting
        requests with an idle slot's, which may not have started yet: its prefill begins on its own
        share of the cores."""
        cores = handoff.cores if handoff.binding.can_widen else None
        while True:
            handoff.binding.share_cores(not split and handoff.may_widen)
            prefill_seconds = self.run(requests, handoff.joiners, cores, handoff.made)
            split = False
            following = handoff.follow_on(prefill_seconds) if wide else []
            if not following:
                handoff.ended(len(requests), prefill_seconds)
                return
            handoff.followed(len(requests), prefill_seconds, following)
            requests = following
            wide = short_batch(following)

    def serve(self, handoff: SlotHandoff) -> None:
        """The continuous scheduler's slot: sleep while nothing waits; run what waits, taking
        whatever arrives into the running batch before every step."""
        waiting, budget = handoff.waiting, handoff.budget

        def joiners(batch) -> list[QueuedRequest]:
            return waiting.take(budget, len(batch), cache_in_use=batch.cache_in_use())

        while not self.stopping:
            # Clear before looking, so an arrival between the two still wakes us.
            waiting.arrived.clear()
            if not waiting:
                waiting.arrived.wait()
                continue
            new = waiting.take(budget)
            if new:
                handoff.busy = True
                self.run(new, joiners)
                handoff.busy = False

    def _join(self, batch, new: list[QueuedRequest]) -> None:
        try:
            self._deliver(batch.add(new))
        except Exception as exc:  # the running rows are intact (GenerationBatch.add): they go on
            log.exception("slot %d: prefill of %d joining request(s) failed", self.slot.index, len(new))
            self._deliver(fail_all(new, exc))
        self.slot.batches_run += 1

    def _count(self, mark: float) -> float:
        """Add the seconds since mark to the slot's busy time (read by metrics as it runs)."""
        now = time.perf_counter()
        self.slot.busy_seconds += now - mark
        return now
