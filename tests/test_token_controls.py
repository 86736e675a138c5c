"""Token controls (logit_bias, allowed_token_ids, bad_words, min_tokens, presence, frequency and
repetition penalties): the sampler's batch-wide step against a plain per-row reference, then end to
end through the real server against transformers with the same controls as a logits processor."""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from xllm_async.engine.params import SamplingParams, TokenControls
from xllm_async.engine.request import EngineRequest
from xllm_async.execution.sampling import make_generator, sample
from xllm_async.execution.token_controls import RowControls, apply_controls

from .client import post, stream_events
from .test_generation import complete, random_prompts

INF = float("inf")


# --- the reference: one row at a time, in plain Python, in vLLM's order ---

def reference_scores(logits: list[float], controls: TokenControls, prompt: list[int], output: list[int],
                     stop_ids: set[int]) -> list[float]:
    s = [float(v) for v in logits]
    if controls.allowed is not None:
        s = [v if t in controls.allowed else -INF for t, v in enumerate(s)]
    for word in controls.bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            s[word[-1]] = -INF
    if len(output) < controls.min_tokens:
        for t in stop_ids:
            s[t] = -INF
    for t, b in controls.logit_bias.items():
        s[t] += b
    p = controls.repetition_penalty
    for t in set(prompt) | set(output):
        s[t] = s[t] / p if s[t] > 0 else s[t] * p
    for t in set(output):
        s[t] -= controls.frequency_penalty * output.count(t) + controls.presence_penalty
    return s


def random_controls(rng: random.Random, vocab: int) -> TokenControls:
    pick = lambda k: tuple(rng.sample(range(vocab), k))  # noqa: E731
    kinds = rng.sample(["bias", "allowed", "bad", "min", "presence", "frequency", "repetition"], rng.randint(1, 7))
    return TokenControls(
        logit_bias={t: rng.uniform(-100, 100) for t in pick(5)} if "bias" in kinds else None,
        allowed=pick(rng.randint(1, vocab // 2)) if "allowed" in kinds else None,
        bad_words=(pick(1), pick(2), pick(3)) if "bad" in kinds else (),
        min_tokens=rng.randint(1, 8) if "min" in kinds else 0,
        presence_penalty=rng.uniform(-2, 2) if "presence" in kinds else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if "frequency" in kinds else 0.0,
        repetition_penalty=rng.uniform(0.5, 2) if "repetition" in kinds else 1.0)


@pytest.mark.parametrize("seed", range(8))
def test_the_batch_step_equals_the_per_row_reference(seed):
    rng = random.Random(seed)
    vocab, rows = 64, 7
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    states, expected = [], []
    for row in range(rows):
        if rng.random() < 0.3:
            states.append(None)
            expected.append(logits[row].tolist())
            continue
        controls = random_controls(rng, vocab)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        if controls.bad_words and output and rng.random() < 0.7:  # a longer bad word's prefix ends the output
            word = controls.bad_words[2]
            output += list(word[:-1])
        stop_ids = {rng.randrange(vocab), rng.randrange(vocab)}
        states.append(RowControls(controls, prompt, output, frozenset(stop_ids)))
        expected.append(reference_scores(logits[row].tolist(), controls, prompt, output, stop_ids))
    scores = apply_controls(logits.clone(), states)
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-4)
    assert torch.equal(scores[[r for r, s in enumerate(states) if s is None]],
                       logits[[r for r, s in enumerate(states) if s is None]])
    greedy = [SamplingParams(temperature=0.0)] * rows
    tokens, _ = sample(logits.clone(), greedy, [None] * rows, states)
    assert tokens == torch.tensor(expected).argmax(-1).tolist()


def test_a_longer_bad_word_is_masked_only_after_its_other_tokens():
    controls = TokenControls(bad_words=((3, 4, 5),))
    logits = torch.zeros(1, 8)
    for output, masked in (([], False), ([3], False), ([4], False), ([3, 4], True), ([1, 3, 4], True),
                           ([3, 4, 1], False)):
        scores = apply_controls(logits.clone(), [RowControls(controls, [0], output, frozenset())])
        assert bool(scores[0, 5] == -INF) is masked, output
        assert int((scores[0] == -INF).sum()) == int(masked)


def test_rows_without_controls_sample_as_in_a_batch_without_any():
    """A seeded row's tokens do not depend on its neighbours' controls (nor on their being there)."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=42)
    controlled = RowControls(TokenControls(logit_bias={7: 50.0}, repetition_penalty=1.5), [1, 2], [3], frozenset())
    for _ in range(5):
        plain = sample(logits.clone(), [params] * 3, [make_generator(params, torch.device("cpu")) for _ in range(3)])[0]
        mixed = sample(logits.clone(), [params] * 3, [make_generator(params, torch.device("cpu")) for _ in range(3)],
                       [None, controlled, None])[0]
        assert [plain[0], plain[2]] == [mixed[0], mixed[2]]
        assert mixed[1] == 7
    # Logprobs stay the model's own (vLLM's raw_logprobs): the bias does not show in them.
    logprobs_params = SamplingParams(temperature=0.0, logprobs=1)
    _, (lp,) = sample(logits[1:2].clone(), [logprobs_params], [None], [controlled])
    assert math.isclose(lp.logprob, float(torch.log_softmax(logits[1], -1)[7]), rel_tol=1e-5)


class _Detokenizer:
    """One character a token (token id -> chr(ord('a') + id))."""

    def push(self, token: int) -> str:
        return chr(ord("a") + token)

    def flush(self) -> str:
        return ""


def test_min_tokens_holds_off_stop_strings_until_reached():
    """A stop string that ends before the min_tokens-th token is not honoured (as vLLM); one
    that ends in it or later is."""
    def run(tokens, min_tokens):
        params = SamplingParams(max_tokens=20, stop=("b",), controls=TokenControls(min_tokens=min_tokens))
        req = EngineRequest(0, [0], params, None)
        req.bind(_Detokenizer(), frozenset({25}), 100)
        for t in tokens:
            req.append(t, None)
            if req.finish_reason:
                break
        return req.text, len(req.output_ids), req.finish_reason

    assert run([0, 1, 0, 1, 0], 0) == ("a", 2, "stop")
    assert run([0, 1, 0, 1, 0], 3) == ("aba", 4, "stop")  # the "b" of token 2 is held off
    assert run([0, 1, 0, 1, 0], 4) == ("aba", 4, "stop")  # the 4th token's "b" counts
    assert run([0, 1, 0, 0, 0], 3) == ("abaaa", 5, None)


# --- end to end ---

PROMPT = random_prompts(11, [25])[0]
EOS = 151645  # the Qwen3 tokenizer's <|im_end|>, the tiny model's EOS (test_sampling_params)


def single_tokens(tokenizer, words: list[str]) -> list[tuple[str, int]]:
    """(text, id) of the words that are one token each (with their leading space)."""
    found = []
    for word in words:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) == 1:
            found.append((word, ids[0]))
    assert len(found) >= 3, found
    return found


WORDS = [" cat", " dog", " the", " house", " red", " blue", " tree", " and"]


def reference_with(reference, prompt: list[int], max_new: int, controls: TokenControls,
                   stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """transformers' greedy generate() with the controls as a logits processor (the per-row reference)."""
    from transformers import LogitsProcessorList

    def process(input_ids, scores):
        output = input_ids[0, len(prompt):].tolist()
        row = reference_scores(scores[0].tolist(), controls, prompt, output, set(stop_ids))
        return torch.tensor([row], dtype=scores.dtype)

    with torch.inference_mode():
        out = reference.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                       dtype=torch.long), max_new_tokens=max_new, do_sample=False,
                                       eos_token_id=None, pad_token_id=0,
                                       logits_processor=LogitsProcessorList([process]))
    return out[0, len(prompt):].tolist()


def texts_of(reference, ids: list[int]) -> str:
    return reference.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("config", ["fixed_steps-N2", "continuous-N1"])
def test_logit_bias_forces_a_token_under_greedy(servers, config, reference):
    server = servers(config)
    (word, token), *_ = single_tokens(reference.tokenizer, WORDS)
    body = complete(server.port, PROMPT, 5, logit_bias={str(token): 100})
    assert body["choices"][0]["text"] == word * 5
    events = stream_events(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                            "ignore_eos": True, "logit_bias": {str(token): 100}})
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == word * 4
    status, chat, _ = post(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "logit_bias": {str(token): 100}})
    assert status == 200 and chat["choices"][0]["message"]["content"] == word * 3
    # -100 bans it: the greedy answer goes around it exactly as the reference does.
    greedy = reference(PROMPT, 4)
    banned = TokenControls(logit_bias={greedy[0]: -100.0})
    body = complete(server.port, PROMPT, 4, logit_bias={str(greedy[0]): -100})
    assert body["choices"][0]["text"] == texts_of(reference, reference_with(reference, PROMPT, 4, banned))


@pytest.mark.parametrize("config", ["fixed_steps-N2", "continuous-N1"])
def test_allowed_token_ids_restrict_every_sampled_token(servers, config, reference):
    server = servers(config)
    allowed = single_tokens(reference.tokenizer, WORDS)
    texts = {word for word, _ in allowed}
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "logprobs": 0,
               "ignore_eos": True, "allowed_token_ids": [t for _, t in allowed]}
    status, body, _ = post(server.port, "/v1/completions", request)
    assert status == 200, body
    for choice in body["choices"]:
        assert set(choice["logprobs"]["tokens"]) <= texts and len(choice["logprobs"]["tokens"]) == 8
    assert len({c["text"] for c in body["choices"]}) > 1  # sampled, not one answer three times
    status, again, _ = post(server.port, "/v1/completions", request)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]  # seeded
    events = stream_events(server.port, "/v1/completions", {**request, "n": 1})
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert streamed == body["choices"][0]["text"]


def test_bad_words_never_appear_and_greedy_goes_around_them(server, reference):
    greedy = reference(PROMPT, 6)
    tokenizer = reference.tokenizer
    # A token of the greedy answer that a bad word names (tokenized alone, with or without its space).
    word, token = next((tokenizer.decode([t]), t) for t in greedy
                       if [t] in (tokenizer.encode(tokenizer.decode([t]).lstrip(), add_special_tokens=False),
                                  tokenizer.encode(" " + tokenizer.decode([t]).lstrip(), add_special_tokens=False)))
    body = complete(server.port, PROMPT, 6, bad_words=[word], logprobs=0)
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert word not in tokens
    plain = tuple(reference.tokenizer.encode(word.lstrip(), add_special_tokens=False))
    spaced = tuple(reference.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
    words = (plain,) + ((spaced,) if spaced[0] != plain[0] and len(spaced) == len(plain) else ())
    expected = reference_with(reference, PROMPT, 6, TokenControls(bad_words=words))
    assert body["choices"][0]["text"] == texts_of(reference, expected)
    # Sampled, several choices, a two-token bad word as well: none of them appears.
    pair = texts_of(reference, greedy[1:3])
    status, sampled, _ = post(server.port, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "n": 4, "seed": 9, "ignore_eos": True,
        "logprobs": 0, "bad_words": [word, pair]})
    assert status == 200, sampled
    for choice in sampled["choices"]:
        assert word not in choice["logprobs"]["tokens"]


@pytest.mark.parametrize("config", ["fixed_steps-N2", "continuous-N1"])
def test_min_tokens_delays_eos_and_stop_tokens(servers, config, reference):
    server = servers(config)
    forced = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logit_bias": {str(EOS): 100}}
    status, body, _ = post(server.port, "/v1/completions", forced)
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "stop"
    status, body, _ = post(server.port, "/v1/completions", {**forced, "min_tokens": 4})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "stop"
    # The four before it are the greedy answer with EOS masked.
    expected = reference_with(reference, PROMPT, 4, TokenControls(min_tokens=4), frozenset({EOS}))
    assert body["choices"][0]["text"] == texts_of(reference, expected)
    events = stream_events(server.port, "/v1/completions", {**forced, "min_tokens": 4})
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == body["choices"][0]["text"]
    # A stop token id likewise.
    (_, token), *_ = single_tokens(reference.tokenizer, WORDS)
    stopping = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "logit_bias": {str(token): 100}, "stop_token_ids": [token], "min_tokens": 3}
    status, body, _ = post(server.port, "/v1/completions", stopping)
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    # A stop string is not honoured before min_tokens either.
    word, token = single_tokens(reference.tokenizer, WORDS)[0]
    body = complete(server.port, PROMPT, 10, logit_bias={str(token): 100}, stop=[word], min_tokens=3)
    assert body["choices"][0]["text"] == word * 2 and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3


# The tiny random model never repeats a token of its own: three words biased by +100 compete for
# every position, so that the penalties decide between them (all but the transformers check).
PENALTIES = [
    ({"repetition_penalty": 0.6}, False),
    ({"repetition_penalty": 1.8}, True),
    ({"repetition_penalty": 0.7}, True),
    ({"presence_penalty": 2.0}, True),
    ({"frequency_penalty": 0.4}, True),
    ({"presence_penalty": -1.0, "frequency_penalty": 0.7, "repetition_penalty": 1.3}, True),
]


@pytest.mark.parametrize("penalties,competing", PENALTIES)
def test_penalties_change_greedy_as_the_reference_says(server, reference, penalties, competing):
    prompt = PROMPT[:8] * 3  # repeated tokens, for the repetition penalty to act on
    bias = {t: 100.0 for _, t in single_tokens(reference.tokenizer, WORDS)[:3]} if competing else {}
    controls = TokenControls(logit_bias=bias, presence_penalty=penalties.get("presence_penalty", 0.0),
                             frequency_penalty=penalties.get("frequency_penalty", 0.0),
                             repetition_penalty=penalties.get("repetition_penalty", 1.0))
    expected = reference_with(reference, prompt, 16, controls)
    # (The penalties change the answer, so that the comparison below shows them at work.)
    assert expected != reference_with(reference, prompt, 16, TokenControls(logit_bias=bias))
    body = complete(server.port, prompt, 16, logprobs=1, logit_bias={str(t): b for t, b in bias.items()},
                    **penalties)
    assert body["choices"][0]["text"] == texts_of(reference, expected)
    if not competing:  # transformers' own processor agrees
        from transformers import RepetitionPenaltyLogitsProcessor
        with torch.inference_mode():
            out = reference.model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                logits_processor=[RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"])])
        assert out[0, len(prompt):].tolist() == expected
    # The log-probabilities reported are the model's own, before the controls (vLLM's raw_logprobs).
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt + expected[:2]])).logits[0, len(prompt) + 1]
    raw = torch.log_softmax(logits.float(), -1)[expected[2]]
    assert math.isclose(body["choices"][0]["logprobs"]["token_logprobs"][2], float(raw), abs_tol=1e-3)


def test_penalties_and_bias_apply_to_every_choice_and_keep_seeds(any_server, reference):
    """n choices each carry the controls, and a seeded controlled request answers the same alone and
    beside other requests."""
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 77, "n": 2, "ignore_eos": True,
               "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
               "logit_bias": {str(EOS): -100}}
    status, alone, _ = post(any_server.port, "/v1/completions", request)
    assert status == 200, alone
    others = [{"prompt": p, "max_tokens": 12, "temperature": 0.7, "ignore_eos": True}
              for p in random_prompts(3, [9, 30, 4])]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, any_server.port, "/v1/completions", body) for body in others]
        together = pool.submit(post, any_server.port, "/v1/completions", request).result(120)
        assert all(f.result(120)[0] == 200 for f in futures)
    assert together[0] == 200
    assert [c["text"] for c in together[1]["choices"]] == [c["text"] for c in alone["choices"]]


BAD = [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"151669": 1}}, "logit_bias"),
    ({"logit_bias": {"cat": 1}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [151669]}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, "6"]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"bad_words": "cat"}, "bad_words"),
    ({"bad_words": [5]}, "bad_words"),
    ({"bad_words": ["x"] * 129}, "bad_words"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,param", BAD)
def test_bad_values_get_400_naming_the_field(server, route, fields, param):
    body = {"max_tokens": 2, **fields}
    body.update({"prompt": [5, 6, 7]} if route == "/v1/completions" else {"messages": [{"role": "user",
                                                                                         "content": "hi"}]})
    status, answer, _ = post(server.port, route, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["code"] == 400


@pytest.mark.parametrize("fields,param", [({"logit_bias": {"5": 1}}, "logit_bias"),
                                          ({"allowed_token_ids": [5]}, "allowed_token_ids"),
                                          ({"bad_words": ["cat"]}, "bad_words"),
                                          ({"min_tokens": 1}, "min_tokens"),
                                          ({"presence_penalty": 0.5}, "presence_penalty"),
                                          ({"frequency_penalty": 0.5}, "frequency_penalty"),
                                          ({"repetition_penalty": 1.1}, "repetition_penalty")])
def test_a_beam_search_refuses_token_controls(server, fields, param):
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "beam_width": 2, **fields}
    status, answer, _ = post(server.port, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer
    # Neutral values are no control: the beam search runs.
    neutral = {"prompt": [5, 6, 7], "max_tokens": 2, "beam_width": 2, "logit_bias": {}, "min_tokens": 0,
               "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}
    status, answer, _ = post(server.port, "/v1/completions", neutral)
    assert status == 200, answer
