"""Every validation error is a 400 (or 404/503) with an OpenAI error body, and
the server keeps serving."""

from __future__ import annotations

import pytest

from .client import post
from .conftest import TINY_CONTEXT

GOOD = {"prompt": [5, 6, 7], "max_tokens": 2}

BAD_COMPLETIONS = [
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": "", "max_tokens": 2}, "prompt"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": "3"}, "max_tokens"),
    ({**GOOD, "max_tokens": True}, "max_tokens"),
    ({**GOOD, "max_tokens": 10**9}, "max_tokens"),
    ({**GOOD, "temperature": -0.5}, "temperature"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "top_p": 0}, "top_p"),
    ({**GOOD, "top_p": 1.5}, "top_p"),
    ({**GOOD, "top_k": -2}, "top_k"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "n": 100000}, "n"),
    ({**GOOD, "seed": 1.5}, "seed"),
    # Past every 64-bit integer (raw JSON: orjson writes none of them, and reads them as floats).
    (b'{"prompt": [5, 6, 7], "max_tokens": 2, "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": [5, 6, 7], "max_tokens": 2, "seed": -9223372036854775809}', "seed"),
    ({**GOOD, "stop": 5}, "stop"),
    ({**GOOD, "stop": [""]}, "stop"),
    ({**GOOD, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({**GOOD, "ignore_eos": "yes"}, "ignore_eos"),
    ({**GOOD, "stream": 1}, "stream"),
    ({**GOOD, "stream_options": []}, "stream_options"),
    ({**GOOD, "logprobs": 50}, "logprobs"),
    ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),  # only with stream
    ({**GOOD, "stream_options": {}}, "stream_options"),
    ({**GOOD, "model": 5}, "model"),
    ({**GOOD, "user": 5}, "user"),
    ({**GOOD, "echo": "yes"}, "echo"),
    ({**GOOD, "suffix": "end"}, "suffix"),
    ({**GOOD, "best_of": 3}, "best_of"),
    ({**GOOD, "best_of": True}, "best_of"),  # no number, though True == 1 in Python
    ({**GOOD, "repetition_penalty": 0}, "repetition_penalty"),
    ({**GOOD, "min_tokens": 4}, "min_tokens"),  # more than max_tokens
    ({**GOOD, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({**GOOD, "min_p": 1.5}, "min_p"),
    ({**GOOD, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({**GOOD, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**GOOD, "logit_bias": {"151669": 1}}, "logit_bias"),
    ({**GOOD, "presence_penalty": 2.5}, "presence_penalty"),
    ({**GOOD, "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({**GOOD, "bad_words": "x"}, "bad_words"),
    ({**GOOD, "frequency_penalty": "x"}, "frequency_penalty"),
    ({"prompt": list(range(1, TINY_CONTEXT + 1))}, "prompt"),
    ({"prompt": list(range(1, 200)), "max_tokens": 100}, "max_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests_get_400_naming_the_field(server, body, param):
    status, answer, _ = post(server.port, "/v1/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]


HI = {"role": "user", "content": "hi"}
BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [5]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [HI, {"role": "robot", "content": "hi"}]}, "messages[1].role"),
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "hi", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{**HI, "name": 5}]}, "messages[0].name"),
    ({"messages": [HI, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
    ({"messages": [{**HI, "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [HI], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [HI], "response_format": "json"}, "response_format"),
    ({"messages": [HI], "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [HI], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [HI], "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": [HI], "chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
    ({"messages": [HI], "add_generation_prompt": 1}, "add_generation_prompt"),
    ({"messages": [HI], "logprobs": 1}, "logprobs"),
    ({"messages": [HI], "n": "2"}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests_get_400_naming_the_field(server, body, param):
    status, answer, _ = post(server.port, "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b'"text"', b""])
def test_body_that_is_not_a_json_object_gets_400(server, raw):
    status, answer, _ = post(server.port, "/v1/completions", raw)
    assert status == 400
    assert answer["error"]["code"] == 400


GOOD_CHATS = [
    [{"role": "system", "content": "be brief"}, HI],
    [{"role": "developer", "content": "be brief"}, HI],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
    [{**HI, "name": "ann"}, {"role": "assistant", "content": None, "tool_calls": []},
     {"role": "tool", "content": "42", "tool_call_id": "call_1"}, HI],
    [HI, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}, HI],
]


@pytest.mark.parametrize("messages", GOOD_CHATS)
def test_every_openai_message_shape_we_accept_is_served(server, messages):
    body = {"messages": messages, "max_tokens": 2, "response_format": {"type": "text"}, "tools": [],
            "presence_penalty": 0, "user": "u-1", "stream_options": None, "repetition_penalty": 1,
            "min_tokens": 0, "best_of": 1}
    status, answer, _ = post(server.port, "/v1/chat/completions", body)
    assert status == 200, answer


def test_unknown_model_gets_404(server):
    status, answer, _ = post(server.port, "/v1/completions", {**GOOD, "model": "gpt-9"})
    assert status == 404 and "gpt-9" in answer["error"]["message"]


def test_unknown_fields_are_ignored(server):
    status, answer, _ = post(server.port, "/v1/completions", {**GOOD, "frequency_penalty": 0, "user": "x",
                                                              "whatever": {"a": 1}})
    assert status == 200, answer


def test_server_keeps_serving_after_errors(server):
    for body, _ in BAD_COMPLETIONS[:5]:
        post(server.port, "/v1/completions", body)
    status, answer, _ = post(server.port, "/v1/completions", GOOD)
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "word " * 100_000, "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["word " * 100_000, "short"], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 100_000}]}),
])
def test_long_text_prompts_get_the_context_error(server, path, body):
    # Tokenized off the event loop (test_long_text_is_tokenized_off_the_event_loop), then checked as any other.
    status, answer, _ = post(server.port, path, body)
    assert status == 400 and "maximum context length" in answer["error"]["message"], answer
    assert post(server.port, "/v1/completions", GOOD)[0] == 200


def test_long_text_is_tokenized_off_the_event_loop():
    import asyncio
    import threading
    from types import SimpleNamespace

    import orjson

    from xllm_async.api.app import OpenAIApp
    from xllm_async.api.model_info import LONG_TEXT, ModelInfo
    from xllm_async.api.requests import parse_completion
    from xllm_async.metrics import Metrics

    started, release = threading.Event(), threading.Event()

    class Backend:  # a tokenizer that works until the test lets it finish
        def encode(self, text, add_special_tokens):
            return SimpleNamespace(ids=[1])

        def encode_batch(self, texts, add_special_tokens):
            started.set()
            assert release.wait(60), "the loop never ran while the tokenizer worked"
            return [SimpleNamespace(ids=[1, 2, 3])]

    model = ModelInfo("m", SimpleNamespace(backend_tokenizer=Backend()), 1000, 100, 4)
    app = OpenAIApp(SimpleNamespace(metrics=Metrics()), model, {})

    async def parse(text: str):
        request = SimpleNamespace(body=orjson.dumps({"prompt": text, "max_tokens": 1}))
        return await app._parse(request, parse_completion, chat=False)

    async def main():
        assert (await parse("short")).prompts == [[1]]  # short text: encoded in place
        task = asyncio.ensure_future(parse("x" * LONG_TEXT))
        while not started.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the loop runs on while the tokenizer works
        assert not task.done()
        release.set()
        assert (await task).prompts == [[1, 2, 3]]

    asyncio.run(main())


DEEP = b"[" * 990 + b"]" * 990  # deeper than repr() goes: quoted whole, it made the 400 a 500


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", b'{"messages": ' + DEEP + b"}", "messages[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": ' + DEEP + b', "content": "hi"}]}', "messages[0].role"),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": ' + DEEP + b"}", "max_tokens"),
    ("/v1/completions", b'{"prompt": [1], "user": ' + DEEP + b"}", "user"),
    ("/v1/completions", b'{"prompt": [1], "model": ' + DEEP + b"}", "model"),
])
def test_a_deeply_nested_value_gets_400_with_a_short_message(server, path, body, param):
    status, answer, _ = post(server.port, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and len(answer["error"]["message"]) < 300
