"""Nothing silently ignored: every field of OpenAI's, vLLM's and SGLang's completion and chat
schemas that we do not implement gets 400 naming it (or is accepted at its neutral value),
through the real server; docs/API.md's table is the module's; vLLM's use_beam_search runs our
beam search; return_tokens_as_token_ids shows logprobs' tokens as vLLM does."""

from __future__ import annotations

import os

import pytest

from xllm_async.api.field_table import IMPLEMENTED, REFUSED, RULES, TABLE, Neutral, markdown_table
from xllm_async.api.vllm_beams import EndedBeam, ended_at_eos
from xllm_async.execution.beam import BeamResult

from .client import post, stream_events

ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}
BASE = {"/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
HI = [{"role": "user", "content": "Name a colour."}]


def behaviour(rule, chat: bool):
    return rule.chat if chat else rule.completions


def refused_value(rule_behaviour):
    """A value this behaviour refuses: another of the neutral value's kind, or anything at all."""
    if rule_behaviour is None or rule_behaviour is REFUSED:
        return "x"
    if rule_behaviour.kind is not None:
        return 5
    values = rule_behaviour.values
    if isinstance(values[0], bool):
        return "yes" if set(values) == {True, False} else not values[0]  # (every boolean neutral: another kind)
    others = {int: 7, float: 7.5, str: "required", dict: {"type": "json_object", "a": 1}, list: ["audio"]}
    return others[type(values[0])]

CASES = [(path, rule.name) for path, chat in ROUTES.items() for rule in RULES
         if behaviour(rule, chat) is not IMPLEMENTED]


@pytest.mark.parametrize("path,name", CASES)
def test_each_field_we_do_not_implement_gets_400_naming_it(server, path, name):
    value = refused_value(behaviour(TABLE[name], ROUTES[path]))
    status, answer, _ = post(server.port, path, {**BASE[path], name: value})
    assert status == 400, (name, value, answer)
    assert answer["error"]["param"] == name and f"`{name}`" in answer["error"]["message"], answer


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_neutral_value_together_is_served(server, path):
    body = dict(BASE[path])
    for rule in RULES:
        found = behaviour(rule, ROUTES[path])
        if isinstance(found, Neutral) and found.values:
            body[rule.name] = found.values[-1]
        elif isinstance(found, Neutral) and found.kind is not None:
            body[rule.name] = "abc" if found.kind is str else {}
        elif found is not IMPLEMENTED:
            body[rule.name] = None  # null is absent
    status, answer, _ = post(server.port, path, body)
    assert status == 200, answer


def test_fields_no_schema_knows_are_still_ignored(server):
    status, answer, _ = post(server.port, "/v1/completions", {**BASE["/v1/completions"], "whatever": {"a": 1}})
    assert status == 200, answer


@pytest.mark.parametrize("name,value", [("guided_decoding_backend", "xgrammar"), ("priority", 1),
                         ("lora_path", "adapter"), ("use_beam_search", "yes")])
def test_what_was_silently_ignored_on_completions_is_refused(server, name, value):
    status, answer, _ = post(server.port, "/v1/completions", {**BASE["/v1/completions"], name: value})
    assert status == 400 and answer["error"]["param"] == name, answer


def test_vllms_continuous_usage_stats_is_refused(server):
    body = {**BASE["/v1/completions"], "stream": True, "stream_options": {"continuous_usage_stats": True}}
    status, answer, _ = post(server.port, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "stream_options", answer


def test_the_table_in_docs_is_the_modules():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "API.md")) as f:
        page = f.read()
    assert markdown_table() in page, "docs/API.md's field table differs: paste field_table.markdown_table()"


def test_the_table_covers_vllms_and_sglangs_fields():
    # A sample from each schema (the table is checked against vllm/entrypoints/openai/protocol.py and
    # sglang's srt/entrypoints/openai/protocol.py by hand; these must never drop out).
    for name in ("use_beam_search", "length_penalty", "structured_outputs", "guided_json", "guided_choice",
                 "allowed_token_ids", "bad_words", "min_tokens", "repetition_penalty", "priority",
                 "return_tokens_as_token_ids", "truncate_prompt_tokens", "logits_processors", "cache_salt",
                 "regex", "ebnf", "json_schema", "lora_path", "stop_regex", "no_stop_trim", "session_params"):
        assert name in TABLE, name


# --- vLLM's use_beam_search ---

@pytest.mark.parametrize("path", list(ROUTES))
def test_use_beam_search_is_our_beam_search_of_width_n(server, path):
    prompt = {"prompt": "The colour of the sky is"} if path == "/v1/completions" else {"messages": HI}
    status, vllm, _ = post(server.port, path, {**prompt, "use_beam_search": True, "n": 3, "max_tokens": 4,
                                               "ignore_eos": True, "length_penalty": 0.5})
    assert status == 200, vllm
    status, ours, _ = post(server.port, path, {**prompt, "beam_width": 3, "num_return_sequences": 3,
                                               "max_tokens": 4})
    assert status == 200, ours
    assert [c["token_ids"] for c in vllm["choices"]] == [c["token_ids"] for c in ours["choices"]]
    scores = [c["cumulative_logprob"] for c in vllm["choices"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)  # best first
    assert [c["index"] for c in vllm["choices"]] == [0, 1, 2]
    for choice in vllm["choices"]:
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert isinstance(text, str) and choice["finish_reason"] == "length"


def test_use_beam_search_without_ignore_eos_answers_up_to_eos(server):
    status, answer, _ = post(server.port, "/v1/completions", {"prompt": ["Once upon a time", "Hello"],
                                                               "use_beam_search": True, "n": 2, "max_tokens": 3})
    assert status == 200, answer
    assert 2 <= len(answer["choices"]) <= 4  # per prompt, n unless beams agree up to their EOS
    assert answer["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in answer["choices"])


@pytest.mark.parametrize("extra,param", [
    ({"length_penalty": 2.0}, "length_penalty"),  # beams of different lengths would be ordered by it
    ({"early_stopping": True}, "early_stopping"),
    ({"beam_width": 2}, "beam_width"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"stream": True}, "stream"),
    ({"n": 1000}, "n"),
    ({"top_p": 0.5}, "top_p"),
    ({"echo": True}, "use_beam_search"),
])
def test_use_beam_search_refuses_what_it_cannot_honour(server, extra, param):
    body = {"prompt": "Hello", "use_beam_search": True, "n": 2, "max_tokens": 2, **extra}
    status, answer, _ = post(server.port, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_length_penalty_without_a_beam_search_is_refused(server):
    status, answer, _ = post(server.port, "/v1/completions", {**BASE["/v1/completions"], "length_penalty": 0.5})
    assert status == 400 and answer["error"]["param"] == "length_penalty", answer
    status, answer, _ = post(server.port, "/v1/completions", {**BASE["/v1/completions"], "length_penalty": 1})
    assert status == 200, answer


def test_use_beam_search_on_the_continuous_scheduler_is_refused_naming_it(servers):
    status, answer, _ = post(servers("continuous-N1").port, "/v1/completions",
                             {"prompt": "Hello", "use_beam_search": True, "n": 2})
    assert status == 400 and answer["error"]["param"] == "use_beam_search", answer
    assert "fixed_steps" in answer["error"]["message"]


class Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_beams_end_at_their_first_eos_and_equal_ones_answer_once():
    beams = [BeamResult([4, 9, 1], "x", -1.0), BeamResult([4, 9, 2], "y", -2.0), BeamResult([5, 6, 7], "z", -3.0)]
    [kept] = ended_at_eos([[(b, None) for b in beams]], frozenset({9}), Decoder())
    assert [(b.token_ids, b.text, getattr(b, "finish_reason", "length")) for b, _ in kept] == [
        ([4], "4", "stop"), ([5, 6, 7], "z", "length")]
    assert isinstance(kept[0][0], EndedBeam) and kept[0][0].cumulative_logprob == -1.0


# --- return_tokens_as_token_ids ---

def test_return_tokens_as_token_ids_on_both_routes(server):
    body = {**BASE["/v1/completions"], "logprobs": 2, "return_tokens_as_token_ids": True, "temperature": 0}
    status, answer, _ = post(server.port, "/v1/completions", body)
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 2 and all(t.startswith("token_id:") for t in logprobs["tokens"])
    assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"] for k in top)
    body = {**BASE["/v1/chat/completions"], "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    status, answer, _ = post(server.port, "/v1/chat/completions", body)
    assert status == 200, answer
    for entry in answer["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:") and int(entry["token"][9:]) >= 0
        assert entry["bytes"] == list(entry["token"].encode())


def test_return_tokens_as_token_ids_streamed(server):
    body = {**BASE["/v1/completions"], "logprobs": 1, "return_tokens_as_token_ids": True}
    events = stream_events(server.port, "/v1/completions", body)
    tokens = [t for e in events[:-1] if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 2 and all(t.startswith("token_id:") for t in tokens), events
