"""Engine pieces on their own: detokenisation, stop strings, budgets, the
left-padded cache, sampling filters."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from xllm_async.engine.budget import BatchBudget
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import EngineRequest
from xllm_async.execution.detokenizer import IncrementalDetokenizer
from xllm_async.execution.sampling import sample


@pytest.fixture(scope="module")
def tokenizer(reference):
    return reference.tokenizer


def test_detokenizer_never_splits_a_multibyte_character(tokenizer):
    text = "naïve café 東京 🙂 done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    # The emoji is several byte tokens: some pushes must have returned nothing.
    assert "" in pieces


def make_request(tokenizer, stop=(), max_tokens=50, index=0) -> EngineRequest:
    req = EngineRequest(index, [1, 2, 3], SamplingParams(max_tokens=max_tokens, stop=tuple(stop)), sink=None)
    req.bind(IncrementalDetokenizer(tokenizer), frozenset({151645}), 1000)
    return req


def test_stop_string_is_held_back_then_cut(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma")
    req = make_request(tokenizer, stop=["STOP"])
    out = ""
    for t in ids:
        delta = req.append(t, None)
        out += delta.text
        if delta.finish_reason:
            break
    assert req.finish_reason == "stop"
    assert out == "alpha beta "


def test_length_and_eos_finish(tokenizer):
    req = make_request(tokenizer, max_tokens=2)
    assert req.append(100, None).finish_reason is None
    assert req.append(101, None).finish_reason == "length"
    req = make_request(tokenizer)
    delta = req.append(151645, None)
    assert delta.finish_reason == "stop" and delta.text == ""


def test_budget_takes_fifo_under_padded_tokens_and_seqs(tokenizer):
    reqs = [EngineRequest(i, [0] * n, SamplingParams(), None) for i, n in enumerate([10, 10, 30, 5])]
    waiting = deque(reqs)
    batch = BatchBudget(max_seqs=8, max_tokens=60).take(waiting)
    assert batch == reqs[:2]  # a third would pad to 3 x 30 = 90 > 60
    assert list(waiting) == reqs[2:]
    assert BatchBudget(max_seqs=1, max_tokens=1000).take(deque(reqs)) == reqs[:1]


def test_budget_always_takes_one_and_drops_aborted():
    big = EngineRequest(0, [0] * 500, SamplingParams(), None)
    gone = EngineRequest(1, [0] * 5, SamplingParams(), None)
    gone.aborted = True
    waiting = deque([gone, big])
    assert BatchBudget(max_seqs=4, max_tokens=100).take(waiting) == [big]
    assert not waiting


def test_kv_cache_select_and_merge_keep_rows_exact(reference):
    from xllm_async.runtime.hf_runner import TransformersRunner

    runner = TransformersRunner.__new__(TransformersRunner)  # reuse the loaded reference model
    runner.model, runner.config, runner.device, runner.pad_id = (reference.model, reference.model.config,
                                                                 torch.device("cpu"), 0)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16]]
    with torch.inference_mode():
        prefilled = runner.prefill(prompts, capacity=1)
        logits, kv = prefilled.logits, prefilled.cache
        prefilled = runner.prefill(prompts[2:], capacity=1)
        one_logits, one_kv = prefilled.logits, prefilled.cache
        kv.select([0, 1])
        kv.merge(one_kv)
        tokens = logits.argmax(-1).tolist()[:2] + one_logits.argmax(-1).tolist()
        merged = runner.decode(kv, tokens)
        for row, prompt in enumerate(prompts):
            alone = reference.model(torch.tensor([prompt + [tokens[row]]])).logits[0, -1]
            torch.testing.assert_close(merged[row], alone.float(), atol=1e-4, rtol=1e-4)


def test_greedy_and_filters_in_sample():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [3.0, 0.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    tokens, logprobs = sample(logits, [greedy, greedy], [None, None])
    assert tokens == [1, 0] and logprobs == [None, None]
    top1 = SamplingParams(temperature=1.0, top_k=2)
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits[:1], [top1], [gen])[0][0] for _ in range(50)}
    assert seen <= {1, 3} and len(seen) == 2
    with_lp = SamplingParams(temperature=0.0, logprobs=2)
    _, (lp,) = sample(logits[:1], [with_lp], [None])
    assert [t for t, _ in lp.top] == [1, 3]
    assert abs(lp.logprob - float(torch.log_softmax(logits[0], -1)[1])) < 1e-6


def test_sampling_follows_the_distribution_and_the_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(1)
    plain = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits, [plain], [gen])[0][0]] += 1
    torch.testing.assert_close(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    nucleus = SamplingParams(temperature=1.0, top_p=0.7)  # 0.5 + 0.3 cover it: tokens 2 and 3 never come
    assert {sample(logits, [nucleus], [gen])[0][0] for _ in range(300)} == {0, 1}
    both = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.5, top_k=3)]
    rows = torch.cat([logits, logits])
    seen = {tuple(sample(rows, both, [gen, gen])[0]) for _ in range(200)}
    assert {first for first, _ in seen} == {0} and {second for _, second in seen} <= {0, 1, 2}


def test_argmax_rows_answers_as_torch_argmax_on_ties_nans_and_views():
    from xllm_async.execution.sampling import argmax_rows

    torch.manual_seed(0)
    with torch.inference_mode():  # as on a slot thread
        scores = torch.randn(5, 3000)
        scores[1] = 0.0  # all tied: the first
        scores[2, 7] = scores[2, 9] = 1e9  # two tied maxima: the first
        scores[3, 11] = float("nan")  # NaN counts as the largest
        wide = torch.randn(4, 2, 3000)[:, -1, :]  # a strided view, as logits[:, -1, :]
        for t in (scores, wide):
            assert argmax_rows(t) == t.argmax(dim=-1).tolist()
    assert argmax_rows(scores)[1:4] == [0, 7, 11]
    half = torch.randn(3, 500, requires_grad=True).bfloat16()  # no numpy bfloat16: torch answers
    assert argmax_rows(half) == half.argmax(dim=-1).tolist()


def test_budget_counts_a_beam_as_copied_rows_where_prompts_are_not_shared():
    """Our engine keeps a beam request's prompt once (its beams' own tokens beside it); the
    transformers engine copies the prompt into every beam: beam_width rows of prompt + rounds - 1."""
    from collections import deque

    from xllm_async.engine.budget import BatchBudget
    from xllm_async.engine.request import BeamRequest

    beam = BeamRequest(0, [1] * 10, 128, 20, None)
    assert BatchBudget(1024, 8192, packed=True, kv_tokens=4096).cache_alone(beam) == 10 + 128 * 19
    copied = BatchBudget(1024, 8192, packed=False, kv_tokens=3000)
    assert copied.cache_alone(beam) == 128 * 29 and copied.never_fits(beam)
    two = deque([BeamRequest(0, [1] * 10, 64, 20, None), BeamRequest(1, [1] * 10, 64, 20, None)])
    assert len(copied.take(two)) == 1  # 2 x 64 x 29 = 3,712 tokens of 3,000: the second waits
