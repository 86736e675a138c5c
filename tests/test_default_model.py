"""The default model (SmolLM2-135M-Instruct, converted once from its GGUF)
answers a real question through the real server."""

from __future__ import annotations

import pytest

from .client import post
from .conftest import ServerProcess


@pytest.fixture(scope="module")
def default_server():
    server = ServerProcess([], timeout=300)  # no --model: the default one
    yield server
    server.stop()


def test_capital_of_france_is_paris(default_server):
    status, body, _ = post(default_server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 30, "temperature": 0})
    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"  # it ends with <|im_end|>
    assert body["model"] == "SmolLM2-135M-Instruct"
