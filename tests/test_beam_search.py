"""Generative-recommendation requests: beam search through the real server
equals transformers' beam search, batched and concurrent, on 1 and 2 slots."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from .client import counts, post
from .conftest import ServerProcess
from .hold import wait_until
from .test_generation import random_prompts
from .test_robustness import metric

CASES = [  # (prompt length, beam_width, num_return_sequences, rounds)
    (7, 8, 3, 3), (30, 4, 4, 2), (3, 16, 5, 3), (50, 1, 1, 4), (12, 6, 2, 1), (21, 32, 8, 3),
]


@pytest.fixture(scope="module")
def beam_expected(reference):
    prompts = random_prompts(5, [c[0] for c in CASES])
    expected = []
    with torch.inference_mode():
        for prompt, (_, width, count, rounds) in zip(prompts, CASES):
            out = reference.model.generate(
                torch.tensor([prompt]), num_beams=width, num_return_sequences=count, max_new_tokens=rounds,
                do_sample=False, length_penalty=0.0, early_stopping=True, eos_token_id=None, pad_token_id=0,
                return_dict_in_generate=True, output_scores=True)
            sequences = out.sequences[:, len(prompt):].tolist()
            scores = out.sequences_scores.tolist() if width > 1 else [None]
            expected.append((sequences, scores))
    return prompts, expected


def beam_request(port: int, prompt, width: int, count: int, rounds: int, path="/v1/completions", **extra):
    body = {"beam_width": width, "num_return_sequences": count, "max_tokens": rounds, **extra}
    body.update({"messages": prompt} if path.endswith("chat/completions") else {"prompt": prompt})
    return post(port, path, body)


@pytest.mark.parametrize("config", ["fixed_steps-N2", "fixed_steps-N1"])
def test_concurrent_beam_searches_equal_transformers(servers, beam_expected, reference, config):
    server = servers(config)
    prompts, expected = beam_expected
    with ThreadPoolExecutor(len(CASES)) as pool:
        answers = list(pool.map(lambda pc: beam_request(server.port, pc[0], *pc[1][1:]), zip(prompts, CASES)))
    for (status, body, _), (sequences, scores), (length, width, count, rounds) in zip(answers, expected, CASES):
        assert status == 200, body
        choices = body["choices"]
        assert [c["token_ids"] for c in choices] == sequences
        assert [c["index"] for c in choices] == list(range(count))
        for choice, score in zip(choices, scores):
            assert choice["finish_reason"] == "length"
            assert choice["text"] == reference.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
            if score is not None:
                assert math.isclose(choice["cumulative_logprob"], score, abs_tol=1e-3)
        logprobs = [c["cumulative_logprob"] for c in choices]
        assert logprobs == sorted(logprobs, reverse=True)  # best first
        assert counts(body["usage"]) == {"prompt_tokens": length, "completion_tokens": count * rounds,
                                 "total_tokens": length + count * rounds}


def test_a_list_of_prompts_gets_choices_for_each_in_order(server, beam_expected):
    prompts, expected = beam_expected
    status, body, _ = beam_request(server.port, prompts[:2], 4, 2, 2)
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    single = [beam_request(server.port, p, 4, 2, 2)[1]["choices"] for p in prompts[:2]]
    assert [c["token_ids"] for c in body["choices"]] == [c["token_ids"] for s in single for c in s]


def test_chat_beam_search(server):
    status, body, _ = beam_request(server.port, [{"role": "user", "content": "recommend"}], 4, 2, 3,
                                   path="/v1/chat/completions")
    assert status == 200, body
    assert len(body["choices"]) == 2
    assert all(len(c["token_ids"]) == 3 and c["message"]["role"] == "assistant" for c in body["choices"])


def test_rounds_default_to_the_server_setting(server):
    status, body, _ = post(server.port, "/v1/completions", {"prompt": [5, 6, 7], "beam_width": 2})
    assert status == 200 and len(body["choices"]) == 1 and len(body["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("body,param", [
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": 100000}, "beam_width"),
    ({"beam_width": 4, "num_return_sequences": 5}, "num_return_sequences"),
    ({"beam_width": 4, "stream": True}, "stream"),
    ({"beam_width": 1, "stream": True}, "stream"),  # one beam still keeps to its rounds and table
    ({"beam_width": 4, "n": 2}, "n"),
    ({"beam_width": "wide"}, "beam_width"),
    # What would change a beam search is refused, not silently ignored.
    ({"beam_width": 4, "temperature": 0.7}, "temperature"),
    ({"beam_width": 4, "top_p": 0.9}, "top_p"),
    ({"beam_width": 4, "top_k": 5}, "top_k"),
    ({"beam_width": 4, "min_p": 0.1}, "min_p"),
    ({"beam_width": 4, "stop": ["a"]}, "stop"),
    ({"beam_width": 4, "stop_token_ids": [7]}, "stop_token_ids"),
    ({"beam_width": 4, "logprobs": 2}, "logprobs"),
    ({"beam_width": 128, "max_tokens": 65}, "max_tokens"),  # past XLLM_MAX_BEAM_ROUNDS (64)
])
def test_bad_beam_requests_get_400(server, body, param):
    status, answer, _ = post(server.port, "/v1/completions", {"prompt": [1, 2, 3], **body})
    assert status == 400 and answer["error"]["param"] == param


def test_beam_rounds_up_to_the_limit_are_served(server):
    status, body, _ = post(server.port, "/v1/completions", {"prompt": [1, 2, 3], "beam_width": 2, "max_tokens": 64})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 64, body


@pytest.fixture(scope="module")
def small_cache(tiny_model_dir):
    """One slot of 2,048 tokens of cache (1 MiB, 512 bytes a token of the tiny model in float32)."""
    server = ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny", "--kv-cache-bytes", "1M",
                            "--concurrent-execute-stream-num", "1"])
    yield server
    server.stop()


def test_a_beam_search_larger_than_the_cache_gets_400(small_cache):
    # 10 prompt tokens and 128 beams x 19 own tokens: 2,442 tokens, more than the slot's 2,048.
    status, body, _ = post(small_cache.port, "/v1/completions", {"prompt": [1] * 10, "beam_width": 128,
                                                                  "max_tokens": 20})
    assert status == 400 and body["error"]["param"] == "beam_width", body
    assert "2442" in body["error"]["message"] and "XLLM_KV_CACHE_BYTES" in body["error"]["message"]
    # 10 + 107 x 19 = 2,043 fits alone.
    status, body, _ = post(small_cache.port, "/v1/completions", {"prompt": [1] * 10, "beam_width": 107,
                                                                  "max_tokens": 20, "num_return_sequences": 2})
    assert status == 200, body


def test_beam_searches_that_fit_the_cache_only_one_at_a_time_take_turns(small_cache):
    """Two beam searches of 1,226 tokens of cache each (10 + 64 x 19) wait in line together: the
    second runs in a batch of its own after the first, not beside it in 2,452 tokens."""
    beams = {"prompt": [1] * 10, "beam_width": 64, "max_tokens": 20, "num_return_sequences": 2}
    alone = post(small_cache.port, "/v1/completions", beams)[1]["choices"]
    with ThreadPoolExecutor(3) as pool:
        with small_cache.hold("prefill"):  # a plain request holds the only slot while both queue
            blocker = pool.submit(post, small_cache.port, "/v1/completions", {"prompt": [3], "max_tokens": 2})
            small_cache.hold.wait_held("prefill")
            # (counted now: the only slot's thread finished every earlier batch before this one)
            batches = metric(small_cache, "xllm:slot_batches", "xllm:slot_batches_total", slot="0")
            answers = [pool.submit(post, small_cache.port, "/v1/completions", beams) for _ in range(2)]
            wait_until(lambda: metric(small_cache, "xllm:num_requests_waiting") == 2, what="both beam searches queued")
        assert blocker.result(120)[0] == 200
        for answer in answers:
            status, body, _ = answer.result(120)
            assert status == 200, body
            assert body["choices"] == alone
    wait_until(lambda: metric(small_cache, "xllm:slot_batches", "xllm:slot_batches_total", slot="0") >= batches + 3,
               timeout=60, what="the blocker's batch, then one for each beam search")


def test_neutral_sampling_fields_are_accepted_with_a_beam(server):
    for extra in ({"temperature": 0}, {"temperature": 1, "top_p": 1, "top_k": -1, "seed": 3, "ignore_eos": True}):
        status, answer, _ = post(server.port, "/v1/completions", {"prompt": [1, 2, 3], "beam_width": 2, **extra})
        assert status == 200, answer


def test_continuous_scheduler_refuses_beam_search_naming_fixed_steps(servers):
    status, answer, _ = post(servers("continuous-N1").port, "/v1/completions",
                             {"prompt": [1, 2, 3], "beam_width": 4})
    assert status == 400 and "fixed_steps" in answer["error"]["message"]


def semantic_ids(count: int, codebooks: int = 3, codes: int = 16, seed: int = 0) -> list[tuple[int, ...]]:
    """Item ids as residual quantisers make them: one code per codebook, each codebook its own tokens."""
    rng = torch.Generator().manual_seed(seed)
    ids = set()
    while len(ids) < count:
        picks = torch.randint(0, codes, (codebooks,), generator=rng).tolist()
        ids.add(tuple(1000 * (level + 1) + code for level, code in enumerate(picks)))
    return sorted(ids)


ITEMS = semantic_ids(300)


@pytest.fixture(scope="module")
def item_server(tiny_model_dir, tmp_path_factory):
    table = tmp_path_factory.mktemp("items") / "items.tsv"
    table.write_text("# item<TAB>token ids\n" + "".join(f"sku-{i}\t{' '.join(map(str, key))}\n"
                                                        for i, key in enumerate(ITEMS)))
    server = ServerProcess(["--model", tiny_model_dir, "--item-table", str(table)])
    yield server
    server.stop()


def constrained_reference(reference, prompt, width: int, count: int, items=ITEMS) -> tuple[list, list]:
    """transformers' beam search kept to the table's paths, log-probabilities renormalised over them."""
    def allowed(batch_id, sequence):
        prefix = tuple(sequence[len(prompt):].tolist())
        return sorted({key[len(prefix)] for key in items if key[:len(prefix)] == prefix})

    with torch.inference_mode():
        out = reference.model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=count, max_new_tokens=3,
            do_sample=False, length_penalty=0.0, early_stopping=True, eos_token_id=None, pad_token_id=0,
            prefix_allowed_tokens_fn=allowed, renormalize_logits=True, return_dict_in_generate=True,
            output_scores=True)
    return out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("width,count", [(8, 3), (16, 16), (4, 1)])
def test_item_table_search_returns_only_items_and_equals_transformers(item_server, beam_expected, reference,
                                                                      width, count):
    prompts, _ = beam_expected
    names = {key: f"sku-{i}" for i, key in enumerate(ITEMS)}
    for prompt in prompts[:3]:
        sequences, scores = constrained_reference(reference, prompt, width, count)
        status, body, _ = beam_request(item_server.port, prompt, width, count, 3)
        assert status == 200, body
        choices = body["choices"]
        assert len(choices) == count  # every asked item comes back
        assert [c["token_ids"] for c in choices] == sequences
        assert [c["item_id"] for c in choices] == [names[tuple(c["token_ids"])] for c in choices]
        for choice, score in zip(choices, scores):
            assert math.isclose(choice["cumulative_logprob"], score, abs_tol=1e-3)


SHARED = [  # (item id, tuple): several items spell some tuples; the server must keep every one
    ("p-1", (1001, 2002, 3003)), ("p-2", (1001, 2002, 3004)), ("p-3", (1001, 2002, 3003)),
    ("p-4", (1002, 2001, 3001)), ("p-5", (1001, 2002, 3003)), ("p-6", (1002, 2001, 3001)),
    ("p-7", (1003, 2003, 3002)),
]


@pytest.fixture(scope="module")
def shared_server(tiny_model_dir, tmp_path_factory):
    """A table of SHARED: 7 items, 4 distinct tuples (fewer than most searches ask for)."""
    table = tmp_path_factory.mktemp("shared") / "shared.tsv"
    table.write_text("".join(f"{item}\t{' '.join(map(str, key))}\n" for item, key in SHARED))
    server = ServerProcess(["--model", tiny_model_dir, "--item-table", str(table)])
    yield server
    server.stop()


def test_a_table_with_fewer_items_than_asked_returns_all_of_them(shared_server, beam_expected):
    status, body, _ = beam_request(shared_server.port, beam_expected[0][0], 8, 8, 3)
    assert status == 200, body
    assert len(body["choices"]) == len({key for _, key in SHARED})  # 4 of the 8 asked: every tuple there is
    assert sorted(i for c in body["choices"] for i in c["item_ids"]) == sorted(item for item, _ in SHARED)


@pytest.mark.parametrize("body,param", [
    ({"beam_width": 4, "max_tokens": 2}, "max_tokens"),
    ({"beam_width": 4, "max_tokens": 4}, "max_tokens"),
    ({"beam_width": 4, "num_return_sequences": 5, "max_tokens": 3}, "num_return_sequences"),
])
def test_bad_item_requests_get_400(item_server, body, param):
    status, answer, _ = post(item_server.port, "/v1/completions", {"prompt": [1, 2, 3], **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_beam_metrics_count_prompts_beams_and_items(item_server):
    from .test_observability import sample_value, scrape

    before = sample_value(scrape(item_server.port), "xllm:beam_requests", "xllm:beam_requests_total")
    status, body, _ = beam_request(item_server.port, [5, 6, 7], 4, 2, 3)
    assert status == 200
    families = scrape(item_server.port)
    assert sample_value(families, "xllm:beam_requests", "xllm:beam_requests_total") == before + 1
    assert sample_value(families, "xllm:beams_per_request", "xllm:beams_per_request_sum") >= 4
    assert sample_value(families, "xllm:items_returned_per_request", "xllm:items_returned_per_request_sum") >= 2


# --- catalogue features: shared tuples, checks, per-request filters, reload ---

def tiny_vocab_size(model_dir: str) -> int:
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def test_a_bad_item_table_stops_start_up_with_one_line(tiny_model_dir, tmp_path):
    """The real server on a table that fails a check: exit 2, one line naming the setting, the line
    and the value, no traceback. A token beyond the model's vocabulary: the check only the server
    can make (it knows the vocabulary), so this also proves the server hands the loader its model's.
    Every other check is the loader's, raised the same way: tested in-process below, no server each."""
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    table = tmp_path / "items.tsv"
    table.write_text("# header\na\t5 6\nb\t5 7\nd\t5 999999\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "server.py"), "--model", tiny_model_dir,
                           "--item-table", str(table)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "XLLM_ITEM_TABLE" in proc.stderr and ":4:" in proc.stderr and "999999" in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "999999" in line]) == 1, proc.stderr


@pytest.mark.parametrize("text,line,needle", [
    ("sku-1 1 2 3\n", 1, "<TAB>"),  # no tab
    ("a\t1 2 3\nb\t4 5\n", 2, "an item of 2 tokens"),  # mixed lengths
    ("# header\na\t5 6\nb\t5 7\nd\t5 -6\n", 4, "non-negative"),
    ("# header\na\t5 6\nb\t5 7\nd\t5 999999\n", 4, "999999"),  # beyond the tiny model's vocabulary
    ("# header\na\t5 6\nb\t5 7\na\t5 8\n", 4, "'a' appears again"),
])
def test_a_table_that_fails_a_check_is_refused_naming_line_and_value(tiny_model_dir, tmp_path, text, line, needle):
    """What the server's start-up (and a SIGHUP's reload) calls, in-process: the error the server
    prints as its one line (test_a_bad_item_table_stops_start_up_with_one_line)."""
    from xllm_async.api.items import ItemTable, ItemTableError

    table = tmp_path / "items.tsv"
    table.write_text(text)
    with pytest.raises(ItemTableError) as caught:
        ItemTable.load(str(table), tiny_vocab_size(tiny_model_dir))
    message = str(caught.value)
    assert f"{table}:{line}:" in message and needle in message and "\n" not in message, message


def test_items_sharing_a_tuple_are_all_returned_in_file_order(shared_server, beam_expected):
    server = shared_server
    status, body, _ = beam_request(server.port, beam_expected[0][0], 8, 8, 3)
    assert status == 200, body
    expected = {}
    for item, key in SHARED:
        expected.setdefault(key, []).append(item)
    assert len(body["choices"]) == len(expected)  # every distinct tuple comes back once
    for choice in body["choices"]:
        ids = expected[tuple(choice["token_ids"])]
        assert choice["item_ids"] == ids and choice["item_id"] == ids[0]
    assert "7 items, 4 distinct tuples of 3 tokens (2 shared by several items)" in server.log()
    status, body, _ = post(server.port, "/v1/completions", {"prompt": [5, 6], "beam_width": 8,
                                                            "num_return_sequences": 8,
                                                            "exclude_item_ids": ["p-1", "p-5", "p-7"]})
    assert status == 200, body
    by_tuple = {tuple(c["token_ids"]): c["item_ids"] for c in body["choices"]}
    # A shared tuple stays while one of its items does, and answers with the ones left.
    assert by_tuple == {(1001, 2002, 3003): ["p-3"], (1001, 2002, 3004): ["p-2"],
                        (1002, 2001, 3001): ["p-4", "p-6"]}


def test_excluded_items_never_come_back_and_the_answer_equals_a_table_without_them(item_server, beam_expected,
                                                                                   reference):
    names = {key: f"sku-{i}" for i, key in enumerate(ITEMS)}
    prompt = beam_expected[0][1]
    status, full, _ = beam_request(item_server.port, prompt, 16, 8, 3)
    assert status == 200, full
    excluded = [c["item_id"] for c in full["choices"][:4]] + ["sku-7"]
    status, body, _ = beam_request(item_server.port, prompt, 16, 8, 3, exclude_item_ids=excluded)
    assert status == 200, body
    assert len(body["choices"]) == 8  # the k answers are filled from other items
    assert not {c["item_id"] for c in body["choices"]} & set(excluded)
    left = [key for key in ITEMS if names[key] not in excluded]
    sequences, scores = constrained_reference(reference, prompt, 16, 8, left)
    assert [c["token_ids"] for c in body["choices"]] == sequences
    for choice, score in zip(body["choices"], scores):
        assert math.isclose(choice["cumulative_logprob"], score, abs_tol=1e-3)


def test_allowed_items_only_come_back_and_the_answer_equals_a_table_of_them(item_server, beam_expected, reference):
    prompt = beam_expected[0][2]
    allowed = ITEMS[::15]  # 20 items
    ids = [f"sku-{ITEMS.index(key)}" for key in allowed]
    status, body, _ = beam_request(item_server.port, prompt, 8, 8, 3, allowed_item_ids=ids,
                                   exclude_item_ids=ids[:2])
    assert status == 200, body
    sequences, scores = constrained_reference(reference, prompt, 8, 8, allowed[2:])
    assert [c["token_ids"] for c in body["choices"]] == sequences
    assert {c["item_id"] for c in body["choices"]} <= set(ids[2:])
    for choice, score in zip(body["choices"], scores):
        assert math.isclose(choice["cumulative_logprob"], score, abs_tol=1e-3)


@pytest.mark.parametrize("extra,param,needle", [
    ({"exclude_item_ids": ["sku-1", "nope", "gone"]}, "exclude_item_ids", "'nope', 'gone'"),
    ({"allowed_item_ids": ["sku-1", "x"]}, "allowed_item_ids", "'x'"),
    ({"allowed_item_ids": []}, "allowed_item_ids", "at least one"),
    ({"allowed_item_ids": "sku-1"}, "allowed_item_ids", "list"),
    ({"allowed_item_ids": ["sku-1"], "exclude_item_ids": ["sku-1"]}, "allowed_item_ids", "no item"),
])
def test_bad_item_filters_get_400_naming_them(item_server, extra, param, needle):
    status, answer, _ = post(item_server.port, "/v1/completions", {"prompt": [1, 2, 3], "beam_width": 4, **extra})
    assert status == 400 and answer["error"]["param"] == param and needle in answer["error"]["message"], answer


def test_item_filters_need_a_beam_search_and_a_table(item_server, server):
    status, answer, _ = post(item_server.port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2,
                                                                   "exclude_item_ids": ["sku-1"]})
    assert status == 400 and answer["error"]["param"] == "exclude_item_ids"
    status, answer, _ = post(server.port, "/v1/completions", {"prompt": [1, 2], "beam_width": 2,
                                                              "allowed_item_ids": ["sku-1"]})
    assert status == 400 and "XLLM_ITEM_TABLE" in answer["error"]["message"]


def write_table(path, items) -> None:
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(f"{name}\t{' '.join(map(str, key))}\n" for name, key in items)
    import os

    os.replace(tmp, path)  # as a deployment would: the server never reads half a file


FIRST = [(f"old-{i}", key) for i, key in enumerate(ITEMS[:100])]


@pytest.fixture(scope="module")
def reloading(tiny_model_dir, tmp_path_factory):
    """A server on a table file that the reload tests rewrite, then reload (SIGHUP); FIRST at start-up."""
    path = tmp_path_factory.mktemp("reload") / "items.tsv"
    write_table(path, FIRST)
    server = ServerProcess(["--model", tiny_model_dir, "--item-table", str(path)])
    yield server, path
    server.stop()


def sighup_reload(server, result: str) -> None:
    """SIGHUP, then until one more reload has ended in `result` ("ok" or "error")."""
    import os
    import signal

    from .test_observability import sample_value, scrape

    def loads() -> float:
        return sample_value(scrape(server.port), "xllm:item_table_loads", "xllm:item_table_loads_total", 0.0,
                            result=result)

    before = loads()
    os.kill(server.proc.pid, signal.SIGHUP)
    # (60 s at most: a reload of a few hundred items takes milliseconds)
    wait_until(lambda: loads() > before, timeout=60, what=f"a reload ending {result!r}")


def test_sighup_reloads_the_table_and_a_bad_file_keeps_the_old_one(reloading, beam_expected):
    import orjson

    from .client import get

    def server_info() -> dict:
        return orjson.loads(get(server.port, "/server_info")[1])

    server, path = reloading
    second = [(f"new-{i}", key) for i, key in enumerate(ITEMS[100:250])]
    prompt = beam_expected[0][0]
    if server_info()["item_count"] != len(FIRST):  # (the module's other reload test ran first)
        write_table(path, FIRST)
        sighup_reload(server, "ok")
    info = server_info()
    assert info["item_count"] == 100 and info["item_tuples"] == 100
    version = info["item_table_version"]
    write_table(path, second)
    sighup_reload(server, "ok")
    info = server_info()
    assert info["item_count"] == 150 and info["item_table_version"] != version
    status, body, _ = beam_request(server.port, prompt, 8, 8, 3)
    assert status == 200 and all(c["item_id"].startswith("new-") for c in body["choices"]), body
    logged = len(server.log())
    path.write_text("broken line without a tab\n")
    sighup_reload(server, "error")
    assert "the old table stays" in server.log()[logged:] and ":1:" in server.log()[logged:]
    status, body, _ = beam_request(server.port, prompt, 8, 8, 3)
    assert status == 200 and all(c["item_id"].startswith("new-") for c in body["choices"]), body
    info = server_info()
    assert info["item_count"] == 150


def test_reloads_under_load_fail_no_request(reloading, beam_expected):
    """8 clients keep beam searches running while the table changes 3 times (once to a bad
    file): every request is answered 200, with items of one of the tables it could have met."""
    import threading

    server, path = reloading
    tables = [[(f"t{t}-{i}", key) for i, key in enumerate(ITEMS[t * 50:t * 50 + 120])] for t in range(3)]
    valid = {name: key for table in tables for name, key in table}
    write_table(path, tables[0])
    sighup_reload(server, "ok")
    stop = threading.Event()
    answers = []

    def client(seed: int) -> None:
        prompts = beam_expected[0]
        i = seed
        while not stop.is_set():
            status, body, _ = beam_request(server.port, prompts[i % len(prompts)], 8, 4, 3)
            answers.append((status, body))
            i += 1

    try:
        threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for n, table in enumerate([tables[1], None, tables[2]]):
            while len(answers) < 8 * (n + 1):  # requests are in flight when the signal comes
                threading.Event().wait(0.05)
            if table is None:
                path.write_text("x\t1 -2 3\n")  # a negative id fails the checks
            else:
                write_table(path, table)
            sighup_reload(server, "error" if table is None else "ok")
        count = len(answers)
        while len(answers) < count + 8:
            threading.Event().wait(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert answers and all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:3]
    for _, body in answers:
        tables_seen = {c["item_id"].split("-")[0] for c in body["choices"]}
        assert len(tables_seen) == 1  # one table per answer
        for choice in body["choices"]:
            assert valid[choice["item_id"]] == tuple(choice["token_ids"])
