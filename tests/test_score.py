"""POST /v1/score (ranking): every score equals transformers run on history + candidate one at a
time, alone and in shared batches, with and without the prefix cache; an item's score equals the
cumulative_logprob the constrained beam search gives it."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from .client import post
from .conftest import start_together
from .test_beam_search import ITEMS, beam_request
from .test_generation import random_prompts

TOL = 1e-4
NAMES = {key: f"sku-{i}" for i, key in enumerate(ITEMS)}
KEYS = {name: key for key, name in NAMES.items()}


SCORE_ENVS = {"plain": {}, "prefix-cache": {"XLLM_PREFIX_CACHE": "on", "XLLM_KV_CACHE_BYTES": "64M"}}


@pytest.fixture(scope="module")
def score_servers(tiny_model_dir, tmp_path_factory):
    """One slot (so that requests queued behind a held forward share the next batch), 8 sequences and
    200 prompt tokens a batch (so that a long query's many candidates are split), the item table
    loaded; with and without the prefix cache, both started together (start_together)."""
    table = tmp_path_factory.mktemp("items") / "items.tsv"
    table.write_text("".join(f"{name}\t{' '.join(map(str, key))}\n" for key, name in NAMES.items()))
    args = ["--model", tiny_model_dir, "--served-model-name", "tiny", "--item-table", str(table),
            "--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "1",
            "--max-seqs-per-batch", "8", "--max-tokens-per-batch", "200"]
    started = start_together(*((args, env) for env in SCORE_ENVS.values()))
    yield dict(zip(SCORE_ENVS, started))
    for server in started:
        server.stop()


@pytest.fixture(scope="module", params=list(SCORE_ENVS))
def score_server(request, score_servers):
    return score_servers[request.param]


def log_softmax(reference, sequence: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities at every position of one sequence [len, vocab]."""
    with torch.inference_mode():
        logits = reference.model(torch.tensor([sequence])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def label_reference(reference, sequence: list[int], labels: list[int], softmax: bool) -> list[float]:
    """SGLang's score: the labels' probabilities after the sequence, or their softmax over the labels."""
    row = log_softmax(reference, sequence)[-1, labels]
    return (torch.softmax(row, 0) if softmax else row.exp()).tolist()


def summed_reference(reference, query: list[int], item: list[int]) -> float:
    logprobs = log_softmax(reference, query + item)
    return sum(float(logprobs[len(query) + i - 1, t]) for i, t in enumerate(item))


def item_reference(reference, query: list[int], key: tuple[int, ...]) -> float:
    """The item's log-probability renormalised over the table's tokens at each depth, as the
    constrained beam search (and transformers' renormalize_logits with allowed tokens) computes it."""
    with torch.inference_mode():
        logits = reference.model(torch.tensor([query + list(key)])).logits[0].float()
    total = 0.0
    for depth, token in enumerate(key):
        allowed = sorted({k[depth] for k in ITEMS if k[:depth] == key[:depth]})
        row = logits[len(query) + depth - 1]
        total += float(row[token] - torch.logsumexp(row[allowed], 0))
    return total


def assert_scores(got: list, expected: list) -> None:
    """Log-probabilities within TOL; label probabilities too, compared as logs (a random model's
    probabilities are far below any absolute tolerance)."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if isinstance(b, list):
            assert [math.log(x) for x in a] == pytest.approx([math.log(x) for x in b], abs=TOL)
        else:
            assert a == pytest.approx(b, abs=TOL)


def score(port: int, **body):
    status, answer, _ = post(port, "/v1/score", body, timeout=300)
    assert status == 200, answer
    return answer


QUERY = random_prompts(11, [40])[0]
TOKEN_ITEMS = random_prompts(12, [1, 3, 2, 5, 3, 1, 4, 3, 2, 3])
LABELS = [15, 300, 2001, 77777]


@pytest.mark.parametrize("item_first", [False, True])
@pytest.mark.parametrize("softmax", [False, True])
def test_label_scores_equal_transformers(score_server, reference, item_first, softmax):
    answer = score(score_server.port, query=QUERY, items=TOKEN_ITEMS, label_token_ids=LABELS,
                   apply_softmax=softmax, item_first=item_first, model="tiny")
    assert answer["object"] == "scoring" and answer["model"] == "tiny"
    assert len(answer["scores"]) == len(TOKEN_ITEMS)
    for item, got in zip(TOKEN_ITEMS, answer["scores"]):
        sequence = item + QUERY if item_first else QUERY + item
        assert_scores([got], [label_reference(reference, sequence, LABELS, softmax)])
    tokens = (len(QUERY) * len(TOKEN_ITEMS) if item_first else len(QUERY)) + sum(map(len, TOKEN_ITEMS))
    assert answer["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


@pytest.mark.parametrize("item_first", [False, True])
def test_text_queries_and_items_are_scored_as_sglang_concatenates_them(score_server, reference, item_first):
    query, items = "The capital of France is", [" Paris", " London", " a city of lights", "!"]
    labels = reference.tokenizer.encode(" yes no maybe")
    answer = score(score_server.port, query=query, items=items, label_token_ids=labels, item_first=item_first)
    for item, got in zip(items, answer["scores"]):
        sequence = reference.tokenizer.encode(item + query if item_first else query + item)
        assert_scores([got], [label_reference(reference, sequence, labels, False)])


def test_token_candidates_of_any_length_get_their_summed_logprob(score_server, reference):
    answer = score(score_server.port, query=QUERY, items=TOKEN_ITEMS)
    expected = [summed_reference(reference, QUERY, item) for item in TOKEN_ITEMS]
    assert_scores(answer["scores"], expected)


@pytest.mark.parametrize("labels", [None, LABELS])
def test_more_candidates_than_a_batch_holds_are_split_and_all_scored(score_server, reference, labels):
    """150 query tokens + 30 candidates' fed tokens exceed the 200-token budget: two requests of the
    query (25 and 5 candidates), each still equal to its reference."""
    query = random_prompts(15, [150])[0]
    items = random_prompts(16, [3] * 30)
    body = {"query": query, "items": items} if labels is None else {"query": query, "items": items,
                                                                      "label_token_ids": labels}
    answer = score(score_server.port, **body)
    if labels is None:
        expected = [summed_reference(reference, query, item) for item in items]
    else:
        expected = [label_reference(reference, query + item, labels, False) for item in items]
    assert_scores(answer["scores"], expected)


def test_item_ids_are_scored_as_the_constrained_beam_search_normalises(score_server, reference):
    names = [NAMES[key] for key in ITEMS[::37]] + ["sku-5"]
    answer = score(score_server.port, query=QUERY, item_ids=names)
    expected = [item_reference(reference, QUERY, KEYS[name]) for name in names]
    assert_scores(answer["scores"], expected)


def test_a_beam_searchs_items_get_its_cumulative_logprob(score_server):
    for prompt in random_prompts(13, [9, 33]):
        status, body, _ = beam_request(score_server.port, prompt, 8, 8, 3)
        assert status == 200, body
        choices = body["choices"]
        answer = score(score_server.port, query=prompt, item_ids=[c["item_id"] for c in choices])
        for choice, got in zip(choices, answer["scores"]):
            assert math.isclose(got, choice["cumulative_logprob"], abs_tol=1e-5)
        # and the ranks agree
        assert sorted(range(len(choices)), key=lambda i: -answer["scores"][i]) == list(range(len(choices)))


def test_requests_sharing_batches_get_their_own_answers(score_server, reference):
    """Requests of every kind queued behind a held forward run as one batch (one slot), at several
    compositions; each still equals its reference."""
    queries = random_prompts(14, [5, 60, 17, 33])
    bodies = [
        {"query": queries[0], "items": TOKEN_ITEMS[:3], "label_token_ids": LABELS},
        {"query": queries[1], "items": TOKEN_ITEMS[3:5]},
        {"query": queries[2], "item_ids": [NAMES[k] for k in ITEMS[5:8]]},
        {"query": queries[3], "items": TOKEN_ITEMS[6:9], "label_token_ids": LABELS, "item_first": True},
    ]

    def expected(body) -> list:
        query = body["query"]
        if "item_ids" in body:
            return [item_reference(reference, query, KEYS[n]) for n in body["item_ids"]]
        if "label_token_ids" not in body:
            return [summed_reference(reference, query, item) for item in body["items"]]
        return [label_reference(reference, item + query if body.get("item_first") else query + item, LABELS, False)
                for item in body["items"]]

    wanted = [expected(b) for b in bodies]
    for composition in ([0, 1, 2, 3], [2, 0], [3, 1, 1]):
        # (the hold ends before the pool waits for its answers: contexts exit last first)
        with ThreadPoolExecutor(len(composition) + 1) as pool, score_server.hold("prefill"):
            blocker = pool.submit(post, score_server.port, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1})
            score_server.hold.wait_held("prefill")
            answers = [pool.submit(score, score_server.port, **bodies[i]) for i in composition]
            # (a score request is one engine request here; item_first makes one per item)
            wait_queued(score_server, sum(len(bodies[i]["items"]) if bodies[i].get("item_first") else 1
                                          for i in composition))
        assert blocker.result()[0] == 200
        for i, answer in zip(composition, answers):
            assert_scores(answer.result()["scores"], wanted[i])


def wait_queued(server, requests: int) -> None:
    """Until this many engine requests wait."""
    from .hold import wait_until
    from .test_robustness import metric

    wait_until(lambda: metric(server, "xllm:num_requests_waiting") >= requests, what="requests queued")


@pytest.mark.parametrize("body,param,needle", [
    ({"query": [1, 2], "item_ids": ["sku-1", "nope", "gone"]}, "item_ids", "nope"),
    ({"query": [1, 2]}, "items", "items"),
    ({"query": [1, 2], "items": [[3]], "item_ids": ["sku-1"]}, "items", "one of them"),
    ({"query": [], "items": [[3]]}, "query", "query"),
    ({"query": [1, 2], "items": [[3]], "apply_softmax": True}, "apply_softmax", "label_token_ids"),
    ({"query": [1, 2], "items": [[3]], "item_first": True}, "item_first", "label_token_ids"),
    ({"query": [1, 2], "items": [[3]], "label_token_ids": [10**9]}, "label_token_ids", "vocabulary"),
    ({"query": [1, 2], "items": ["text"]}, "items", "token ids"),
    ({"query": [1, 2], "items": [[]]}, "items", "non-empty"),
    ({"query": [1, 2], "items": [[3]], "model": "other"}, "model", "other"),
])
def test_bad_score_requests_get_400_naming_the_field(score_server, body, param, needle):
    status, answer, _ = post(score_server.port, "/v1/score", body)
    assert status in (400, 404), answer
    assert answer["error"]["param"] == param and needle in answer["error"]["message"]


def test_item_ids_need_a_table_and_scoring_needs_fixed_steps(servers):
    status, answer, _ = post(servers("fixed_steps-N2").port, "/v1/score", {"query": [1, 2], "item_ids": ["a"]})
    assert status == 400 and "XLLM_ITEM_TABLE" in answer["error"]["message"]
    status, answer, _ = post(servers("continuous-N1").port, "/v1/score", {"query": [1, 2], "items": [[3]]})
    assert status == 400 and "fixed_steps" in answer["error"]["message"]
