"""Greedy outputs through the real server equal per-request transformers
generate(), for mixed prompt lengths and max_tokens, batched and concurrent,
in both schedulers and with N = 1 and 2; streaming matches non-streaming."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from .client import counts, post, stream_events

LENGTHS = [3, 40, 7, 120, 1, 65, 18, 90, 33, 5]
MAX_TOKENS = [1, 9, 4, 1, 12, 2, 7, 1, 16, 3]


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 150000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def expected(reference):
    prompts = random_prompts(7, LENGTHS)
    texts = [reference.tokenizer.decode(reference(p, m), skip_special_tokens=True)
             for p, m in zip(prompts, MAX_TOKENS)]
    return prompts, texts


def complete(port: int, prompt, max_tokens: int, **extra) -> dict:
    status, body, _ = post(port, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True, **extra})
    assert status == 200, body
    return body


def test_concurrent_greedy_outputs_equal_generate(any_server, expected):
    prompts, texts = expected
    with ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda pm: complete(any_server.port, *pm), zip(prompts, MAX_TOKENS)))
    for body, prompt, max_tokens, text in zip(bodies, prompts, MAX_TOKENS, texts):
        choice = body["choices"][0]
        assert choice["text"] == text
        assert choice["finish_reason"] == "length"
        assert counts(body["usage"]) == {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                                 "total_tokens": len(prompt) + max_tokens}


def test_batched_prompt_list_equals_generate(any_server, expected, reference):
    prompts, _ = expected
    body = complete(any_server.port, prompts[:6], 4)
    # One max_tokens for all the prompts of a request: each choice is its prompt's first 4 tokens alone.
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for choice, prompt in zip(body["choices"], prompts):
        assert choice["text"] == reference.tokenizer.decode(reference(prompt, 4), skip_special_tokens=True)


def test_streamed_deltas_concatenate_to_the_whole_text(any_server, expected):
    prompts, texts = expected
    for prompt, max_tokens, text in list(zip(prompts, MAX_TOKENS, texts))[:4]:
        events = stream_events(any_server.port, "/v1/completions",
                               {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert all(c["object"] == "text_completion" for c in chunks)


def test_streaming_sends_the_first_token_before_the_last_is_computed(any_server):
    prompt = random_prompts(3, [20])[0]
    import http.client

    import orjson

    conn = http.client.HTTPConnection("127.0.0.1", any_server.port, timeout=60)
    # (40 tokens: the hold, not the length, keeps the last token from being computed before the first is read)
    conn.request("POST", "/v1/completions", orjson.dumps({"prompt": prompt, "max_tokens": 40, "stream": True,
                                                         "temperature": 0, "ignore_eos": True}))
    # No decode step runs until the first token is in: it cannot have waited for the last.
    with any_server.hold("decode"):
        resp = conn.getresponse()
        while not (line := resp.readline()).startswith(b"data: {"):
            assert line, "the stream ended before its first token"
    count = 1 + sum(line.startswith(b"data: {") for line in resp)
    assert count >= 20  # one event per token (a few may be merged if the client lags)


def test_usage_chunk_only_when_asked(server):
    prompt = random_prompts(4, [10])[0]
    plain = stream_events(server.port, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert all("usage" not in e for e in plain[:-1])
    with_usage = stream_events(server.port, "/v1/completions",
                               {"prompt": prompt, "max_tokens": 3, "ignore_eos": True,
                                "stream_options": {"include_usage": True}})
    usage_chunk = with_usage[-2]
    assert usage_chunk["choices"] == []
    assert counts(usage_chunk["usage"]) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


def test_chat_stream_matches_chat_whole(any_server):
    body = {"messages": [{"role": "user", "content": "Tell me about batching."}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    status, whole, _ = post(any_server.port, "/v1/chat/completions", body)
    assert status == 200, whole
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant"
    events = stream_events(any_server.port, "/v1/chat/completions", body)
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_prompt_is_the_models_chat_template(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_ids = reference.tokenizer.encode(ids, add_special_tokens=False)
    status, body, _ = post(server.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 5,
                                                                 "temperature": 0, "ignore_eos": True})
    assert status == 200
    assert body["usage"]["prompt_tokens"] == len(expected_ids)
    text = reference.tokenizer.decode(reference(expected_ids, 5), skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("extra,template_args", [
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
])
def test_chat_template_arguments_reach_the_template(server, reference, extra, template_args):
    messages = [{"role": "user", "content": "Hi"}]
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False,
                                                   **{"add_generation_prompt": True, **template_args})
    status, body, _ = post(server.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(reference.tokenizer.encode(text, add_special_tokens=False))


def test_assistant_tool_calls_are_rendered_by_the_template(server, reference):
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    parsed = {**call, "function": {"name": "lookup", "arguments": {"city": "Oslo"}}}
    text = reference.tokenizer.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "", "tool_calls": [parsed]}, messages[2]],
        add_generation_prompt=True, tokenize=False)
    assert '"city": "Oslo"' in text
    status, body, _ = post(server.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(reference.tokenizer.encode(text, add_special_tokens=False))


def test_string_prompt_is_tokenised_like_the_tokenizer(server, reference):
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = reference.tokenizer.encode(prompt)
    body = complete(server.port, prompt, 6)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == reference.tokenizer.decode(reference(ids, 6), skip_special_tokens=True)
