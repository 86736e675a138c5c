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
    for _ in range(3):  # (with the prefix cache, the second time keeps the prompts, the third finds them)
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


def test_candidate_kernel_equals_the_torch_stages(native, trie, monkeypatch):
    """Stage 2 and the merge on our kernel (csrc/candidate_attention.cpp) give the scores the torch
    operators give (the path of a CPU without our kernels)."""
    from xllm_async.model import cpu_kernels

    if cpu_kernels.candidate_attention() is None or getattr(native.attention, "prefix_kernel", None) is None:
        pytest.skip("our CPU kernels do not serve here")
    chosen = bodies(trie)
    kernel = run(native, chosen)
    monkeypatch.setattr(cpu_kernels, "candidate_attention", lambda: None)
    plain = run(native, chosen)
    for a, b in zip(kernel, plain):
        assert_scores(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidate_kernel_merges_a_prompt_and_ancestors(dtype):
    """The kernel's rows against the torch reference: softmax over a prompt's keys and each row's
    ancestors' (root first, itself last), rows of several depths and key-head groups."""
    from xllm_async.model import cpu_kernels
    from xllm_async.model.attention_backends import plain_attention

    op = cpu_kernels.candidate_attention()
    if op is None:
        pytest.skip("our CPU kernels do not serve here")
    torch.manual_seed(0)
    parents = [-1, -1, 0, 0, 2, 1, 4]
    chains: list[list[int]] = []
    for row, parent in enumerate(parents):
        chains.append((chains[parent] if parent >= 0 else []) + [row])
    rows, heads, kv_heads, dim, prompt, scale = len(parents), 4, 2, 32, 11, 0.3
    q = torch.randn(rows, heads, dim).to(dtype)
    qkv = torch.randn(rows, 2, kv_heads, dim).to(dtype)  # (k and v views with a row stride, as a layer's)
    k, v = qkv[:, 0], qkv[:, 1]
    keys, values = torch.randn(kv_heads, prompt, dim).to(dtype), torch.randn(kv_heads, prompt, dim).to(dtype)
    out1, lse1 = plain_attention(q.float().view(rows, kv_heads, 2, dim).transpose(0, 1),
                                 keys.float()[:, None], values.float()[:, None], scale)
    out1, lse1 = out1.transpose(0, 1).reshape(rows, heads, dim), lse1.transpose(0, 1).reshape(rows, heads)
    depth = max(len(c) for c in chains)
    ancestors = torch.tensor([c + [-1] * (depth - len(c)) for c in chains])
    got = op(q, k, v, ancestors, out1.to(dtype).contiguous(), lse1.contiguous(), scale)
    for r, chain in enumerate(chains):
        all_keys = torch.cat([keys.float(), k.float()[chain].transpose(0, 1)], dim=1)  # [kv_heads, keys, dim]
        all_values = torch.cat([values.float(), v.float()[chain].transpose(0, 1)], dim=1)
        want, _ = plain_attention(q[r].float().view(kv_heads, 2, dim), all_keys, all_values, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got[r].float(), want.reshape(heads, dim), atol=tol), r


def test_leaves_tokens_at_once_equal_one_at_a_time(trie):
    """ItemTrie.tokens_of_leaves (what `item_ids` are turned into) is tokens() of each leaf."""
    import numpy as np

    leaves = np.array([0, trie.leaves - 1, 5, 5, *range(1, trie.leaves, 7)])
    assert trie.tokens_of_leaves(leaves).tolist() == [trie.tokens(int(leaf)) for leaf in leaves]
    assert [tuple(t) for t in trie.tokens_of_leaves(np.arange(trie.leaves)).tolist()] == sorted(set(ITEMS))
