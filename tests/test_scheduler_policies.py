"""The fixed-steps scheduler's rules, each through its decision (engine/policies.py), and the
step loop both schedulers run (execution/steps.py). No clock but the numbers the tests pass."""

from __future__ import annotations

from types import SimpleNamespace

from xllm_async.engine import policies
from xllm_async.engine.budget import BatchBudget
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.policies import FILL_RETURNS, OWED_FOR, SHORT_BATCH_STEPS, SPLIT_AT, ReturnEstimate
from xllm_async.engine.request import BeamRequest, EngineRequest
from xllm_async.execution.steps import StepLoop


def request(max_tokens: int = 1) -> EngineRequest:
    return EngineRequest(0, [1, 2, 3], SamplingParams(max_tokens=max_tokens), sink=None)


BUDGET = BatchBudget(256, 8192)


def test_a_closed_loop_is_assumed_until_clients_are_seen_coming_back():
    returns = ReturnEstimate()
    assert not returns.on_their_way  # nobody answered yet
    returns.finished(10.0, 4, 0.1)
    assert returns.on_their_way and returns.returning == 4
    returns.arrived(10.001, 4)
    assert not returns.on_their_way and returns.return_delay < 0.1 * 0.2


def test_a_batch_waits_beside_a_busy_slot_for_as_many_as_the_last_batch_held():
    returns = ReturnEstimate()
    returns.finished(10.0, 3, 0.1)
    assert returns.worth_waiting(10.0, [request()], 1, BUDGET)
    assert not returns.worth_waiting(10.0, [request()] * 3, 1, BUDGET)
    assert not returns.worth_waiting(10.0, [request()], 1, BatchBudget(1, 8192))  # a full batch waits for nobody


def test_on_an_idle_server_a_batch_waits_only_within_a_prefill_of_the_last_one():
    returns = ReturnEstimate()
    returns.finished(10.0, 1, 0.1)
    returns.waited_at_release = 1  # one request waited through it: two on their way in all
    assert returns.worth_waiting(10.05, [request()], 0, BUDGET)
    assert not returns.worth_waiting(10.2, [request()], 0, BUDGET)
    assert returns.wait_deadline(10.05, 0) == 10.1  # a prefill from the last batch's end
    assert returns.wait_deadline(10.05, 1) == 10.15  # beside a busy slot: a prefill from now


def test_a_wait_lasts_a_few_return_delays_at_most():
    returns = ReturnEstimate(return_delay=0.002)
    returns.finished(10.0, 16, 0.1)
    assert returns.wait_deadline(10.0, 1) == 10.0 + FILL_RETURNS * 0.002


def test_clients_not_back_within_a_few_prefills_are_not_counted_on():
    returns = ReturnEstimate()
    returns.finished(10.0, 16, 0.1)
    returns.arrived(10.0 + OWED_FOR * 0.1 + 0.001, 1)
    assert returns.returning == 0 and returns.return_delay > 0.1 * 0.2  # looks like an open loop now
    assert not returns.back_at_once(0.1) and returns.back_at_once(10.0)


def test_against_short_batches_a_slot_takes_its_share_of_the_server():
    assert policies.batch_share([(2, 1)], 6, 2, 0, False) == 4
    assert policies.batch_share([(1, 500)], 6, 2, 0, False) == 0  # beside a long one: everything
    assert policies.batch_share([], 6, 2, 1, False) == 0
    assert policies.batch_share([], 5, 2, 1, True) == 3  # split on an idle server: 3 + 2


def test_the_core_rule():
    short, long = request(), request(SHORT_BATCH_STEPS + 1)
    assert policies.alone(1, False, False) and policies.alone(1, True, True)
    assert not policies.alone(1, False, True) and not policies.alone(2, True, False)
    assert policies.split(1, [short] * SPLIT_AT) and not policies.split(1, [short] * (SPLIT_AT - 1))
    assert not policies.split(0, [short] * SPLIT_AT) and not policies.split(1, [long] + [short] * SPLIT_AT)
    assert policies.wide(True, [short], True) and not policies.wide(True, [long], True)
    assert not policies.wide(True, [short], False) and not policies.wide(False, [short], True)
    assert policies.starts_split(True, [short], 1, 2) and not policies.starts_split(True, [short], 1, 0)
    assert policies.follows_on([short, short], 1, False)
    assert not policies.follows_on([short, short], 1, True)  # closed loop: the loop lets it fill
    assert not policies.follows_on([long, short], 1, False)  # a long one goes where others can join it
    assert not policies.follows_on([short] * SPLIT_AT, 1, False)  # enough to split: the loop shares them
    assert not policies.follows_on([], 1, False)


def test_the_join_rule():
    short, long = request(), request(SHORT_BATCH_STEPS + 1)
    beam = BeamRequest(0, [1, 2], 2, 2, None)
    assert policies.seats(8, 3, 2) == 3
    assert policies.join_target({0: 5, 1: 2}) == 1
    assert policies.joins(short, False, 0) and not policies.joins(beam, False, 5)
    assert policies.joins(long, True, 1) and not policies.joins(long, True, 0) and not policies.joins(short, True, 5)
    assert policies.join_instead(1, 1, True, long, 1)
    assert not policies.join_instead(1, 1, False, long, 1)  # an accelerator's slot
    assert not policies.join_instead(2, 1, True, long, 1) and not policies.join_instead(1, 1, True, short, 1)
    assert not policies.join_instead(1, 1, True, long, 0) and not policies.join_instead(1, 1, True, None, 1)


class _Batch:
    """A generation batch of `steps` decode steps whose joins fail."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def __len__(self) -> int:
        return self.left

    def prefill(self) -> list:
        return ["prefilled"]

    def add(self, requests) -> list:
        raise RuntimeError("injected: join failed")

    def decode(self) -> list:
        self.left -= 1
        return ["decoded"]


def test_a_failed_join_fails_its_joiners_and_the_batch_goes_on(monkeypatch):
    from xllm_async.execution import steps

    monkeypatch.setattr(steps, "GenerationBatch", lambda runner, requests, metrics, between_layers: _Batch(2))
    delivered = []
    slot = SimpleNamespace(index=0, busy_seconds=0.0, batches_run=0)
    first, joining = request(), [request()]
    offered = [joining]
    StepLoop(None, slot, delivered.append).run([first], lambda batch: offered.pop() if offered else [])
    assert delivered[0] == ["prefilled"] and delivered[-2:] == [["decoded"], ["decoded"]]
    assert joining[0].finish_reason == "error" and first.finish_reason is None
    assert slot.batches_run == 2  # the batch and the join: prefill batches
