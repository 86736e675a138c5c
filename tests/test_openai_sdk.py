"""The official openai SDK works against the server unchanged."""

from __future__ import annotations

import openai
import pytest

from .test_generation import random_prompts


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_completion(client, reference):
    prompt = random_prompts(21, [12])[0]
    result = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.choices[0].text == reference.tokenizer.decode(reference(prompt, 5), skip_special_tokens=True)
    assert result.usage.completion_tokens == 5


def test_completion_stream(client):
    prompt = random_prompts(22, [12])[0]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    parts = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(parts)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_and_chat_stream(client):
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == whole.choices[0].message.content


def test_sdk_raises_bad_request_with_the_message(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=-1)
    assert "temperature" in str(info.value)
