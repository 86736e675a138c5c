"""Scoring prompts through /v1/completions, as lm-eval-harness and vLLM's users do: `echo`
with `logprobs` (and max_tokens 0), and vLLM's `prompt_logprobs`, against transformers."""

from __future__ import annotations

import pytest
import torch

from .client import counts, post
from .test_generation import random_prompts

PROMPT = random_prompts(31, [14])[0]


def prompt_logprobs(reference, prompt: list[int]) -> torch.Tensor:
    """log P(prompt[i + 1] | prompt[:i + 1]) for every i, by plain transformers."""
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(any_server, reference):
    status, body, _ = post(any_server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                                "logprobs": 2, "temperature": 0})
    assert status == 200, body
    choice, = body["choices"]
    assert choice["text"] == reference.tokenizer.decode(PROMPT) and choice["finish_reason"] == "length"
    assert counts(body["usage"]) == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT)}
    lp = choice["logprobs"]
    assert lp["tokens"] == [reference.tokenizer.decode([t]) for t in PROMPT]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(prompt_logprobs(reference, PROMPT).tolist(), abs=2e-4)
    # The 2 likeliest and the token itself ("up to logprobs + 1 elements", as OpenAI answers).
    assert all(2 <= len(top) <= 3 and top[t] == v for top, t, v in zip(lp["top_logprobs"][1:], lp["tokens"][1:],
                                                                         lp["token_logprobs"][1:]))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(PROMPT))]


def test_echo_puts_the_prompt_before_the_completion(server, reference):
    text = "The quick brown fox"
    ids = reference.tokenizer.encode(text)
    status, body, _ = post(server.port, "/v1/completions", {"prompt": text, "max_tokens": 3, "echo": True,
                                                            "logprobs": 0, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    choice = body["choices"][0]
    completion = reference.tokenizer.decode(reference(ids, 3), skip_special_tokens=True)
    assert choice["text"] == text + completion
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(prompt_logprobs(reference, ids).tolist(), abs=2e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][len(ids)] == len(text)
    assert body["usage"]["completion_tokens"] == 3


def test_vllm_prompt_logprobs_give_each_token_its_logprob_and_rank(any_server, reference):
    prompts = [PROMPT, random_prompts(32, [5])[0]]
    status, body, _ = post(any_server.port, "/v1/completions", {"prompt": prompts, "max_tokens": 2, "n": 2,
                                                                "prompt_logprobs": 3, "temperature": 0})
    assert status == 200, body
    for index, choice in enumerate(body["choices"]):
        prompt = prompts[index // 2]
        scores = choice["prompt_logprobs"]
        assert len(scores) == len(prompt) and scores[0] is None
        expected = prompt_logprobs(reference, prompt).tolist()
        for position, (token, entry) in enumerate(zip(prompt[1:], scores[1:])):
            own = entry[str(token)]
            assert own["logprob"] == pytest.approx(expected[position], abs=2e-4) and own["rank"] >= 1
            assert own["decoded_token"] == reference.tokenizer.decode([token])
            assert 3 <= len(entry) <= 4 and {e["rank"] for e in entry.values()} >= {1, 2, 3}
        assert choice["text"] and choice["logprobs"] is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),  # no tokens: only with echo
    ("/v1/completions", {"prompt": [1, 2], "echo": True, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": [1, 2], "prompt_logprobs": 1, "beam_width": 2}, "beam_width"),
    ("/v1/completions", {"prompt": [1, 2], "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1},
     "prompt_logprobs"),
])
def test_scoring_requests_it_cannot_serve_get_400(server, path, body, param):
    status, answer, _ = post(server.port, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
