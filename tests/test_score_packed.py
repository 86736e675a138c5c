"""A score request's candidates in its prompt's forward (runner.score_prefill, model/candidate_prefill.py,
execution/candidate_plan.py), in-process on the tiny model in float32: every score equals
transformers run on prompt + candidate one at a time, and the rounds path (a beam_decode per token),
at several batch compositions, with candidates of different lengths, shared prefixes, repeats,
labels, items whose last depths have no choice, and prompts found in the prefix cache."""

from __future__ import annotations

import pytest
import torch

from xllm_async.engine.score_request import ScoreRequest
from xllm_async.execution.candidate_plan import CandidatePlan
from xllm_async.execution.item_trie import ItemTrie
from xllm_async.execution.score_batch import ScoreBatch

from .test_beam_search import ITEMS
from .test_generation import random_prompts
from .test_score import TOL, item_reference, log_softmax, summed_reference

LABELS = [15, 300, 2001, 77777]
QUERIES = random_prompts(21, [40, 37, 33, 9])  # (all but the last hold a 32-token block of the prefix cache)
TOKENS = random_prompts(22, [1, 3, 2, 5, 3, 1, 4])
SHARED = [[7, 8, 9], [7, 8, 10], [7, 11], [7, 8, 9], [12], [7, 8, 9, 13]]


@pytest.fixture(scope="module", params=["plain", "prefix-cache"])
def native(request, tiny_model_dir):
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    runner.set_kv_cache(64 << 20, 1, 0.5 if request.param == "prefix-cache" else 0.0)
    return runner


@pytest.fixture(scope="module")
def trie():
    return ItemTrie.of(ITEMS, torch.device("cpu"))


def bodies(trie) -> list[dict]:
    items = [list(k) for k in ITEMS[::37]] + [list(ITEMS[5])]
    return [
        {"query": QUERIES[0], "candidates": TOKENS + SHARED},
        {"query": QUERIES[1], "candidates": SHARED + [[]], "labels": LABELS},
        {"query": QUERIES[2], "candidates": items, "trie": trie},
        {"query": QUERIES[3], "candidates": [[5], [6], [5]]},
    ]


def assert_scores(got: list, wanted: list) -> None:
    """Log-probabilities (a float, or a list for labels: the engine's, before api/score.py makes them
    probabilities) within TOL."""
    assert len(got) == len(wanted)
    for a, b in zip(got, wanted):
        assert a == pytest.approx(b, abs=TOL)


def run(runner, chosen: list[dict], cached: list | None = None) -> list[list]:
    """Each request's results (and, into `cached`, its prompt tokens found in the prefix cache)."""
    requests = [ScoreRequest(i, b["query"], b["candidates"], None, b.get("labels"), b.get("trie"))
                for i, b in enumerate(chosen)]
    batch = ScoreBatch(runner, requests)
    with torch.inference_mode():
        batch.prefill()
        while batch:
            batch.decode()
    if cached is not None:
        cached[:] = [r.cached_tokens for r in requests]
    return [r.results for r in requests]


def expected(reference, body: dict) -> list:
    query = body["query"]
    if body.get("trie") is not None:
        return [item_reference(reference, query, tuple(c)) for c in body["candidates"]]
    if body.get("labels") is not None:
        return [log_softmax(reference, query + c)[-1, body["labels"]].tolist() for c in body["candidates"]]
    return [summed_reference(reference, query, c) for c in body["candidates"]]


@pytest.mark.parametrize("composition", [[0, 1, 2, 3], [2, 0], [3, 1, 1], [2]])
def test_packed_scores_equal_transformers_at_several_compositions(native, reference, trie, composition):
    chosen = [bodies(trie)[i] for i in composition]
    cached: list = []
    for _ in range(2):  # (with the prefix cache, the second time finds the prompts there)
        for body, got in zip(chosen, run(native, chosen, cached)):
            assert_scores(got, expected(reference, body))
    assert any(cached) == native.caches_prefixes


def test_packed_scores_equal_the_rounds_path(native, trie, monkeypatch):
    chosen = bodies(trie)
    packed = run(native, chosen)
    monkeypatch.setattr(native, "packs_candidates", False)
    rounds = run(native, chosen)
    for a, b in zip(packed, rounds):
        assert_scores(a, b)


def test_shared_prefixes_are_fed_once_and_choiceless_depths_not_at_all(trie):
    plan = CandidatePlan(ScoreRequest(0, [1, 2], SHARED, None))
    # Each candidate feeds all but its last token; the prefixes 7 and 7 8 are shared: 3 rows, not 10.
    assert (plan.tokens, plan.parents) == ([7, 8, 9], [-1, 0, 1])
    assert plan.paths == [[0, 1], [0, 1], [0], [0, 1], [], [0, 1, 2]]
    labelled = CandidatePlan(ScoreRequest(0, [1, 2], SHARED, None, LABELS))
    assert len(labelled.tokens) == 7  # every token: 7, 8, 9, 10, 11, 12, 13
    # An item needs the rows before its last depth with a choice: none after it.
    items = [list(k) for k in ITEMS]
    plan = CandidatePlan(ScoreRequest(0, [1, 2], items, None, trie=trie))
    for item, path, fed in zip(items, plan.paths, plan.walk.fed):
        assert [plan.tokens[r] for r in path] == item[:fed]
        siblings = {k[fed] for k in ITEMS if list(k[:fed]) == item[:fed]}
        assert fed == 0 or len(siblings) > 1
        for depth in range(fed + 1, len(item)):
            assert len({k[depth] for k in ITEMS if list(k[:depth]) == item[:depth]}) == 1
