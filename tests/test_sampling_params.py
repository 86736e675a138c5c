"""Sampling and stopping parameters, end to end through the server."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from .client import post, stream_events
from .hold import wait_until
from .test_generation import complete, random_prompts
from .test_robustness import metric

PROMPT = random_prompts(11, [25])[0]


def test_stop_token_ids_end_generation(server, reference):
    tokens = reference(PROMPT, 8)
    stop_at = tokens[3]
    body = complete(server.port, PROMPT, 8, stop_token_ids=[stop_at])
    first = tokens.index(stop_at)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == first + 1
    assert body["choices"][0]["text"] == reference.tokenizer.decode(tokens[:first], skip_special_tokens=True)


def test_stop_string_cuts_text_and_is_not_returned(server, reference):
    text = reference.tokenizer.decode(reference(PROMPT, 10), skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop
    expected = text[: text.index(stop)]
    body = complete(server.port, PROMPT, 10, stop=[stop])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == expected
    events = stream_events(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "stop": stop,
                                                            "temperature": 0, "ignore_eos": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected


def test_include_stop_str_in_output_keeps_the_stop_string(server, reference):
    text = reference.tokenizer.decode(reference(PROMPT, 10), skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    expected = text[: text.index(stop) + len(stop)]
    body = complete(server.port, PROMPT, 10, stop=[stop], include_stop_str_in_output=True)
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["text"] == expected
    events = stream_events(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "stop": stop,
                                                            "temperature": 0, "ignore_eos": True,
                                                            "include_stop_str_in_output": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected


# A prompt whose greedy next token on the tiny model is its EOS, <|im_end|> (found by searching the
# model's next-token scores position by position; the test checks it still is).
EOS_PROMPT = [101189, 110450, 5953, 74478]
EOS = 151645


def test_eos_ends_generation_unless_ignored(server, reference):
    assert reference(EOS_PROMPT, 1) == [EOS]
    body = complete(server.port, EOS_PROMPT, 6, ignore_eos=False)
    choice = body["choices"][0]
    # Stopped by EOS, before max_tokens: the EOS counts as generated, and its text is not shown.
    assert choice["finish_reason"] == "stop" and choice["text"] == ""
    assert body["usage"]["completion_tokens"] == 1
    body = complete(server.port, EOS_PROMPT, 6, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 6
    expected = reference(EOS_PROMPT, 6)
    assert body["choices"][0]["text"] == reference.tokenizer.decode(expected, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_n_choices_differ(any_server):
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 1234, "n": 3, "ignore_eos": True}
    status, first, _ = post(any_server.port, "/v1/completions", request)
    assert status == 200, first
    status, second, _ = post(any_server.port, "/v1/completions", request)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in second["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert first["usage"]["completion_tokens"] == 24
    # The prompt is counted once, as OpenAI and vLLM count it, however many choices share it.
    single = post(any_server.port, "/v1/completions", {**request, "n": 1})[1]
    assert first["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("config", ["fixed_steps-N1", "continuous-N1"])
def test_the_largest_seed_fails_no_request_beside_it(servers, config):
    """A seed at the edge of 64 bits, its choices' seeds past it, joins another client's running
    generation: both are answered, and the seeded one the same as when it runs alone."""
    server = servers(config)
    other = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0.7, "ignore_eos": True}
    seeded = {"prompt": PROMPT[:5], "max_tokens": 5, "n": 2, "seed": 2**64 - 1, "temperature": 1.0,
              "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        with server.hold("prefill"):  # the other's batch holds the only slot; the seeded one joins it
            first = pool.submit(post, server.port, "/v1/completions", other)
            server.hold.wait_held("prefill")
            second = pool.submit(post, server.port, "/v1/completions", seeded)
            wait_until(lambda: metric(server, "xllm:num_requests_waiting") == 2, what="the seeded request queued")
        (status, body, _), (seeded_status, together, _) = first.result(120), second.result(120)
    assert status == 200, body
    assert seeded_status == 200, together
    assert body["usage"]["completion_tokens"] == 30
    status, alone, _ = post(server.port, "/v1/completions", seeded)
    assert status == 200, alone
    assert [c["text"] for c in alone["choices"]] == [c["text"] for c in together["choices"]]
    # -1 is the same seed to torch's generator as 2^64 - 1, which its choice 1 wraps past.
    status, wrapped, _ = post(server.port, "/v1/completions", {**seeded, "seed": -1})
    assert status == 200 and [c["text"] for c in wrapped["choices"]] == [c["text"] for c in alone["choices"]]


def test_top_k_one_is_greedy(server, reference):
    body = complete(server.port, PROMPT, 5, temperature=1.0, top_k=1)
    assert body["choices"][0]["text"] == reference.tokenizer.decode(reference(PROMPT, 5), skip_special_tokens=True)


def test_min_p_of_one_is_greedy(server, reference):
    # Only the likeliest token reaches min_p times its own probability.
    body = complete(server.port, PROMPT, 5, temperature=1.0, min_p=1.0, seed=3)
    assert body["choices"][0]["text"] == reference.tokenizer.decode(reference(PROMPT, 5), skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 1e-6])
def test_a_vanishing_temperature_is_greedy(server, reference, temperature):
    body = complete(server.port, PROMPT, 4, temperature=temperature, seed=3)
    assert body["choices"][0]["text"] == reference.tokenizer.decode(reference(PROMPT, 4), skip_special_tokens=True)


def test_tiny_top_p_is_greedy(server, reference):
    body = complete(server.port, PROMPT, 5, temperature=0.8, top_p=1e-6, seed=3)
    assert body["choices"][0]["text"] == reference.tokenizer.decode(reference(PROMPT, 5), skip_special_tokens=True)


def test_completion_logprobs_match_the_model(server, reference):
    body = complete(server.port, PROMPT, 3, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    with torch.inference_mode():
        logits = reference.model(torch.tensor([PROMPT])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    first = int(expected.argmax())
    assert math.isclose(lp["token_logprobs"][0], float(expected[first]), abs_tol=1e-3)
    assert len(lp["tokens"]) == 3 and len(lp["top_logprobs"]) == 3
    assert len(lp["top_logprobs"][0]) <= 3  # the 2 likeliest and the chosen token, as OpenAI answers
    assert all(top[t] == v for top, t, v in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"]))
    body = complete(server.port, PROMPT, 2, logprobs=0)  # logprobs 0: the chosen token alone
    lp = body["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    assert lp["text_offset"][0] == 0


def test_streamed_text_offsets_count_from_the_start_of_the_text(server):
    from .client import stream_events

    request = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 1, "temperature": 0, "ignore_eos": True, "n": 2}
    whole = post(server.port, "/v1/completions", request)[1]["choices"]
    events = [e for e in stream_events(server.port, "/v1/completions", {**request, "stream": True})[:-1]
              if e["choices"]]
    for index in (0, 1):
        offsets = [o for e in events for c in e["choices"] if c["index"] == index and c["logprobs"]
                   for o in c["logprobs"]["text_offset"]]
        assert offsets == whole[index]["logprobs"]["text_offset"] and offsets[-1] > 0


def test_chat_logprobs_shape(server):
    status, body, _ = post(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3,
        "ignore_eos": True})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 3
