"""The forward cut at attention into pieces replayed from graphs (runtime/graphs.py) against the
plain forward, in float32: packed prompts of mixed lengths, decode steps, scoring, beams, and
batches beyond the largest bucket.

Here (no accelerator) the pieces run as they are, on a slot thread as in the server, which checks
everything but the capture itself: the static buffers, the padding rows, the cut at attention.
XLLM_TEST_DEVICE=cuda:0 runs the same tests with real CUDA graphs (perf/gpu_seed.sh does)."""

from __future__ import annotations

import os

import pytest
import torch

from xllm_async.runtime.device import graph_capture
from xllm_async.runtime.executor import ExecutionSlot
from xllm_async.runtime.graphs import PiecewiseGraphs, buckets

from .test_generation import random_prompts
from .test_native_engine import assert_same_beams, run_beams

DEVICE = torch.device(os.environ.get("XLLM_TEST_DEVICE", "cpu"))
MAX_ROWS = 128
TOLERANCE = {"atol": 2e-4, "rtol": 2e-4}


def as_is(piece):
    """A stand-in for a graph capture: the piece itself is its replay."""
    return piece


@pytest.fixture(scope="module")
def slot():
    slot = ExecutionSlot(0, DEVICE, 1)
    slot.start()
    yield slot
    slot.stop()


@pytest.fixture(scope="module")
def runners(tiny_model_dir, slot):
    """(plain, graphed): two runners of the tiny model; the graphed one replays its pieces on `slot`."""
    from xllm_async.runtime.model_runner import ModelRunner

    plain = ModelRunner(tiny_model_dir, DEVICE, "float32")
    graphed = ModelRunner(tiny_model_dir, DEVICE, "float32")
    for runner in (plain, graphed):
        runner.set_kv_cache(64 << 20, 1)
    capture = None if DEVICE.type != "cpu" else as_is
    graphs = slot.call(lambda: graphed.capture_graphs(MAX_ROWS, capture))
    assert graphs is not None and graphs.max_rows == MAX_ROWS
    return plain, graphed


def test_buckets_cover_every_row_count_with_little_padding():
    for top in (1, 5, 16, 100, 256, 320, 2048, 8192):
        sizes = buckets(top)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == top
        for rows in range(1, top + 1):
            size = next(s for s in sizes if s >= rows)
            assert size < 2 * rows if rows <= 16 else size <= (1.5 if rows <= 256 else 1.25) * rows
    assert len(buckets(8192)) <= 34  # each bucket costs layers + 1 captures per slot


def test_graphed_prefill_and_decode_equal_the_plain_forward(runners, slot):
    plain, graphed = runners
    prompts = random_prompts(31, [3, 40, 1, 17, 17, 17, 30])  # 125 tokens: the largest bucket

    def steps(runner):
        out = []
        prefilled = runner.prefill(prompts, capacity=60)
        logits, kv = prefilled.logits, prefilled.cache
        out.append(logits)
        for _ in range(4):
            logits = runner.decode(kv, logits.argmax(-1).tolist())
            out.append(logits)
        kv.select([5, 0, 2])  # rows leave: fewer rows, another bucket
        out.append(runner.decode(kv, out[-1][[5, 0, 2]].argmax(-1).tolist()))
        return [t.cpu() for t in out]

    with torch.inference_mode():
        expected = steps(plain)
    for found, wanted in zip(slot.call(lambda: steps(graphed)), expected):
        torch.testing.assert_close(found, wanted, **TOLERANCE)


def test_graphed_one_token_prefill_and_scoring_equal_the_plain_forward(runners, slot):
    plain, graphed = runners
    prompts = random_prompts(32, [5, 40, 1, 17, 2])
    scored = [3, None, 0, 0, 20]

    def run(runner):
        logits = runner.prefill(prompts).logits  # no cache: the one-token requests' path
        scored_out = runner.prefill_scored(prompts, 0, None, scored)
        return logits.cpu(), scored_out.logits.cpu(), scored_out.scores

    with torch.inference_mode():
        expected = run(plain)
    found = slot.call(lambda: run(graphed))
    torch.testing.assert_close(found[0], expected[0], **TOLERANCE)
    torch.testing.assert_close(found[1], expected[1], **TOLERANCE)
    for mine, theirs in zip(found[2], expected[2]):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.logprobs == pytest.approx(theirs.logprobs, abs=2e-4)


def test_graphed_beams_equal_plain_beams(runners, slot):
    plain, graphed = runners
    prompts = random_prompts(33, [25, 7, 60, 3])
    widths, rounds = [8, 16, 3, 5], [3, 2, 4, 1]
    with torch.inference_mode():
        expected = run_beams(plain, prompts, widths, rounds, digits=None)
    assert_same_beams(slot.call(lambda: run_beams(graphed, prompts, widths, rounds, digits=None)), expected)


def test_a_batch_beyond_the_largest_bucket_runs_the_plain_forward(runners, slot, monkeypatch):
    plain, graphed = runners
    prompts = random_prompts(34, [100, 60])  # 160 rows: no bucket holds them
    with torch.inference_mode():
        expected = plain.prefill(prompts).logits
    replays = []
    monkeypatch.setattr(PiecewiseGraphs, "forward", lambda *a: replays.append(a))
    found = slot.call(lambda: graphed.prefill(prompts)).logits
    assert not replays
    torch.testing.assert_close(found.cpu(), expected.cpu(), **TOLERANCE)


def test_a_slot_call_returns_its_value_and_raises_its_error(slot):
    assert slot.call(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        slot.call(lambda: 1 / 0)
    assert slot.call(lambda: "still running") == "still running"


def test_no_graphs_on_a_cpu(runners):
    assert graph_capture(torch.device("cpu")) is None
    if DEVICE.type == "cpu":
        assert runners[0].capture_graphs(64) is None  # (the graphed runner's were captured with a stand-in)


def test_a_decode_step_as_one_masked_call_equals_a_call_per_length(runners, monkeypatch):
    """The accelerators' decode attention (every row in one call, the keys beyond each row's length
    masked), run here on the CPU against the CPU's calls per run of equal lengths."""
    from xllm_async.model.attention_backends import MaskedSdpaAttention, SdpaAttention

    plain, _ = runners
    prompts = random_prompts(35, [3, 40, 1, 17, 17])

    def steps():
        prefilled = plain.prefill(prompts, capacity=50)
        logits, kv = prefilled.logits, prefilled.cache
        out = []
        for _ in range(3):
            logits = plain.decode(kv, logits.argmax(-1).tolist())
            out.append(logits)
        return out

    with torch.inference_mode():
        monkeypatch.setattr(plain, "attention", SdpaAttention(plain.dtype))  # a call per run of lengths
        expected = steps()
        monkeypatch.setattr(plain, "attention", MaskedSdpaAttention(plain.dtype))
        for found, wanted in zip(steps(), expected):
            torch.testing.assert_close(found, wanted, **TOLERANCE)
