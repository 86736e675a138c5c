"""/tokenize, /detokenize and /tokenizer_info as vLLM shapes them, over the real server: counts
that are the generation routes' prompt_tokens, errors that name their field, the API key, and
lm-eval's `local-completions` taking its tokenizer from the server alone."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xllm_async.api.app import OpenAIApp
from xllm_async.api.model_info import LONG_TEXT

from .client import get, post
from .conftest import ServerProcess

SYSTEM_CHAT = [{"role": "system", "content": "You answer in one word."},
               {"role": "user", "content": "Name a colour."}]
PROMPTS = ["Hello world", "<|im_start|>user\nspecial tokens are read as such<|im_end|>", " leading space, ünïcödé ✓",
           "x"]


def tokenize(server, body, path="/tokenize", headers=None):
    return post(server.port, path, body, headers=headers)


def error_of(status_body, status=400):
    status_, body = status_body[:2]
    assert status_ == status, body
    return body["error"]


# --- /tokenize ---

@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokenize_counts_what_a_completion_counts(server, reference, prompt):
    status, body, _ = tokenize(server, {"prompt": prompt})
    assert status == 200, body
    assert body["tokens"] == reference.tokenizer.encode(prompt, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert "token_strs" not in body
    status, done, _ = post(server.port, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert status == 200, done
    assert done["usage"]["prompt_tokens"] == body["count"]


@pytest.mark.parametrize("messages", [SYSTEM_CHAT, SYSTEM_CHAT[1:],
                                      [*SYSTEM_CHAT, {"role": "assistant", "content": "Red."},
                                       {"role": "user", "content": [{"type": "text", "text": "Another?"}]}]],
                         ids=["system", "user", "turns"])
def test_tokenize_messages_counts_what_a_chat_counts(server, reference, messages):
    status, body, _ = tokenize(server, {"messages": messages})
    assert status == 200, body
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
             for m in messages]
    text = reference.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] == reference.tokenizer.encode(text, add_special_tokens=False)
    status, done, _ = post(server.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200, done
    assert done["usage"]["prompt_tokens"] == body["count"]
    # Without the generation prompt the assistant's header is left off.
    status, bare, _ = tokenize(server, {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < body["count"] and body["tokens"][:bare["count"]] == bare["tokens"]


def test_tokenize_chat_template_kwargs_reach_the_template(server):
    plain = tokenize(server, {"messages": SYSTEM_CHAT[1:]})[1]
    thinking = tokenize(server, {"messages": SYSTEM_CHAT[1:], "chat_template_kwargs": {"enable_thinking": False}})[1]
    assert thinking["count"] > plain["count"]  # Qwen3's template writes an empty think block
    status, done, _ = post(server.port, "/v1/chat/completions", {
        "messages": SYSTEM_CHAT[1:], "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert done["usage"]["prompt_tokens"] == thinking["count"]


def test_tokenize_token_ids_and_token_strs(server, reference):
    ids = reference.tokenizer.encode("Hello world")
    status, body, _ = tokenize(server, {"prompt": ids, "return_token_strs": True})
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == reference.tokenizer.convert_ids_to_tokens(ids) == ["Hello", "Ġworld"]
    status, done, _ = post(server.port, "/v1/completions", {"prompt": ids, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_special_tokens_and_empty_prompt(server):
    assert tokenize(server, {"prompt": ""})[1] == {"count": 0, "max_model_len": 256, "tokens": []}
    # lm-eval's probe and its encode() send exactly this.
    status, body, _ = tokenize(server, {"prompt": "test", "add_special_tokens": False})
    assert status == 200 and body["count"] == 1
    status, body, _ = tokenize(server, {"prompt": "<|im_end|>", "add_special_tokens": False})
    assert body["tokens"] == [151645]


def test_tokenize_long_text_is_tokenized_whole(server, reference):
    text = "The quick brown fox jumps over the lazy dog. " * (2 * LONG_TEXT // 45)
    status, body, _ = tokenize(server, {"prompt": text})
    assert status == 200 and body["tokens"] == reference.tokenizer.encode(text)
    # Longer than the model's context: counted all the same, max_model_len beside it to compare.
    assert body["count"] > body["max_model_len"]
    status, chat, _ = tokenize(server, {"messages": [{"role": "user", "content": text}]})
    assert status == 200 and chat["count"] > body["count"]


def test_long_input_is_tokenized_off_the_event_loop():
    """The work of a long body runs on the tokenizer thread, a short one's on the loop."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="xllm-tokenize")
    app = types.SimpleNamespace(_tokenizer_thread=pool, model=None)

    def where(body, model):
        return threading.current_thread().name

    async def both():
        return (await OpenAIApp._tokenizing(app, True, where, {}), await OpenAIApp._tokenizing(app, False, where, {}))

    try:
        long, short = asyncio.run(both())
    finally:
        pool.shutdown()
    assert long.startswith("xllm-tokenize") and short == threading.current_thread().name


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "either"),
    ({"prompt": "a", "messages": SYSTEM_CHAT}, "prompt", "both"),
    ({"prompt": 5}, "prompt", "string"),
    ({"prompt": []}, "prompt", "string"),
    ({"prompt": [1, "a"]}, "prompt", "token ids"),
    ({"prompt": [1, True]}, "prompt", "token ids"),
    ({"prompt": [1, 10**9]}, "prompt", "1000000000"),
    ({"prompt": [-1]}, "prompt", "-1"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
    ({"prompt": "a", "return_token_strs": 1}, "return_token_strs", "boolean"),
    ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "messages"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "wizard"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "content"),
    ({"messages": SYSTEM_CHAT, "add_generation_prompt": 1}, "add_generation_prompt", "boolean"),
    ({"messages": SYSTEM_CHAT, "continue_final_message": True}, "continue_final_message", "not supported"),
    ({"messages": SYSTEM_CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": SYSTEM_CHAT, "chat_template": "{{ messages }}"}, "chat_template", "not supported"),
    ({"messages": SYSTEM_CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ({"messages": SYSTEM_CHAT, "chat_template_kwargs": []}, "chat_template_kwargs", "object"),
    ({"prompt": "a", "model": 3}, "model", "string"),
])
def test_tokenize_bad_bodies_get_400_naming_the_field(server, body, param, words):
    error = error_of(tokenize(server, body))
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_tokenize_refuses_what_is_not_json_and_other_models(server):
    status, body, _ = post(server.port, "/tokenize", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    assert error_of(tokenize(server, {"prompt": "a", "model": "other"}), 404)["param"] == "model"
    assert tokenize(server, {"prompt": "a", "model": "tiny"})[0] == 200


# --- /detokenize ---

def test_detokenize_round_trips_and_keeps_special_tokens(server, reference):
    text = "<|im_start|>user\nHello, wörld ✓<|im_end|>"
    ids = tokenize(server, {"prompt": text})[1]["tokens"]
    status, body, _ = post(server.port, "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": text}
    assert post(server.port, "/detokenize", {"tokens": []})[1] == {"prompt": ""}
    # What the server generates, it spells as the completion did (its greedy tokens are transformers').
    done = post(server.port, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True})[1]
    generated = reference(ids, 4)
    assert post(server.port, "/detokenize", {"tokens": generated})[1]["prompt"] == done["choices"][0]["text"]


def test_detokenize_long_list(server, reference):
    ids = reference.tokenizer.encode("Lorem ipsum dolor sit amet. " * 2000)
    status, body, _ = post(server.port, "/detokenize", {"tokens": ids})
    assert status == 200 and body["prompt"] == "Lorem ipsum dolor sit amet. " * 2000


@pytest.mark.parametrize("tokens, named", [
    ([9707, 151669], ["151669"]),
    ([-1, 5, 10**12, -1], ["-1", "1000000000000"]),
    ([2**40], ["1099511627776"]),
])
def test_detokenize_names_unknown_ids(server, tokens, named):
    error = error_of(post(server.port, "/detokenize", {"tokens": tokens}))
    assert error["param"] == "tokens" and "151668" in error["message"]
    for n in named:
        assert n in error["message"]
    assert f"holds {len(named)} id" in error["message"]


@pytest.mark.parametrize("body", [{}, {"tokens": "abc"}, {"tokens": [1, 2.0]}, {"tokens": [[1]]},
                                  {"tokens": [True]}, {"tokens": None}])
def test_detokenize_bad_bodies_get_400_naming_tokens(server, body):
    assert error_of(post(server.port, "/detokenize", body))["param"] == "tokens"


# Any value of any kind in each field these routes read: 200 or a 400/404 in OpenAI's shape, never a 500.
ANY = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_subnormal=False)
                   | st.text(max_size=6), lambda inner: st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=10)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]) | ANY,
                                 "content": st.text(max_size=12) | ANY})
IDS = st.lists(st.integers(-3, 151700) | ANY, max_size=6)
TOKENIZE_FIELDS = {"prompt": st.text(max_size=20) | IDS | ANY, "messages": st.lists(MESSAGE, max_size=3) | ANY,
                   "add_special_tokens": st.booleans() | ANY, "add_generation_prompt": st.booleans() | ANY,
                   "return_token_strs": st.booleans() | ANY, "chat_template_kwargs": ANY,
                   "continue_final_message": ANY, "tools": ANY, "model": st.just("tiny") | ANY}


@pytest.mark.parametrize("path, fields", [("/tokenize", TOKENIZE_FIELDS),
                                          ("/detokenize", {"tokens": IDS | ANY, "model": st.just("tiny") | ANY})])
def test_any_body_gets_an_answer_or_a_4xx(server, path, fields):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=st.fixed_dictionaries({}, optional=fields))
    def run(body):
        status, answer, _ = post(server.port, path, body)
        if status == 200:
            assert set(answer) >= ({"tokens", "count", "max_model_len"} if path == "/tokenize" else {"prompt"})
        else:
            assert status in (400, 404) and set(answer["error"]) == {"message", "type", "param", "code"}, answer

    run()
    assert server.proc.poll() is None


# --- /tokenizer_info ---

def test_tokenizer_info_has_what_vllm_and_lm_eval_read(server, reference):
    status, raw, headers = get(server.port, "/tokenizer_info")
    assert status == 200 and headers["content-type"].startswith("application/json")
    info = orjson.loads(raw)
    tok = reference.tokenizer
    assert info["eos_token"] == tok.eos_token == "<|im_end|>"
    assert info["bos_token"] is None and info["pad_token"] == tok.pad_token
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == tok.model_max_length and info["max_model_len"] == 256
    assert info["tokenizer_class"] == type(tok).__name__ and info["vocab_size"] == len(tok)
    assert info["added_tokens_decoder"]["151645"] == "<|im_end|>"
    assert "vocab_file" not in info and "merges_file" not in info


# --- routing and access ---

@pytest.mark.parametrize("path", ["/v1/tokenize", "/v1/detokenize"])
def test_v1_aliases(server, path):
    body = {"prompt": "Hello"} if path.endswith("/tokenize") else {"tokens": [9707]}
    status, answer, _ = post(server.port, path, body)
    assert status == 200 and answer == post(server.port, path.removeprefix("/v1"), body)[1]


def test_methods(server):
    status, raw, headers = get(server.port, "/tokenize")
    assert status == 405 and "POST" in headers["allow"]
    assert post(server.port, "/tokenizer_info", {})[0] == 405


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    server = ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny", "--api-key", "sesame"])
    yield server
    server.stop()


@pytest.mark.parametrize("method, path, body", [("POST", "/tokenize", {"prompt": "a"}),
                                                ("POST", "/v1/tokenize", {"prompt": "a"}),
                                                ("POST", "/detokenize", {"tokens": [1]}),
                                                ("POST", "/v1/detokenize", {"tokens": [1]}),
                                                ("GET", "/tokenizer_info", None)])
def test_api_key_covers_the_tokenizer_routes(keyed, method, path, body):
    def call(headers=None):
        if method == "GET":
            conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=30)
            conn.request("GET", path, headers=headers or {})
            resp = conn.getresponse()
            resp.read()
            conn.close()
            return resp.status
        return post(keyed.port, path, body, headers=headers)[0]

    assert call() == 401
    assert call({"authorization": "Bearer wrong"}) == 401
    assert call({"authorization": "Bearer sesame"}) == 200


# --- lm-eval ---

CHOICE_DOCS = [{"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
               {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
               {"question": "", "choices": [" Yes", " No"], "answer": 1}]  # empty context: lm-eval adds the EOS id
GENERATION_DOCS = [{"question": "Q: What colour is the sky?\nA:", "answer": " blue"},
                   {"question": "Q: Say hello.\nA:", "answer": " hello"}]
CHOICE_TASK = """task: xllm_choice
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GENERATION_TASK = """task: xllm_generation
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""


def _write_tasks(folder) -> None:
    for name, docs, template in (("choice", CHOICE_DOCS, CHOICE_TASK), ("generation", GENERATION_DOCS,
                                                                        GENERATION_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(template.format(data=data, cache=folder / "cache"))


@pytest.mark.parametrize("scheduler", ["fixed_steps-N2", "continuous-N1"])
def test_lm_eval_local_completions_with_the_servers_tokenizer(servers, scheduler, reference, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    server = servers(scheduler)
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # (nothing here may reach the internet)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path)
    # Nothing but the URL and the model's name (as `lm_eval --model local-completions --model_args ...`
    # builds it): the tokenizer must come from the server.
    lm = get_model("local-completions").create_from_arg_string(
        f"base_url=http://127.0.0.1:{server.port}/v1/completions,model=tiny")
    assert lm.tokenizer_backend == "remote"
    assert lm.eot_token_id == reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert lm.prefix_token_id == lm.eot_token_id  # (Qwen3 has no BOS)
    assert lm.tok_encode("Hello world") == reference.tokenizer.encode("Hello world")

    results = simple_evaluate(model=lm, tasks=["xllm_choice", "xllm_generation"], bootstrap_iters=0,
                              task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    choice, generation = results["results"]["xllm_choice"], results["results"]["xllm_generation"]
    assert 0 <= choice["acc,none"] <= 1 and 0 <= generation["exact_match,none"] <= 1
    samples = results["samples"]
    assert len(samples["xllm_choice"]) == len(CHOICE_DOCS)
    for sample in samples["xllm_choice"]:
        scores = [resp[0][0] for resp in sample["resps"]]
        assert len(scores) == len(sample["doc"]["choices"])
        assert all(math.isfinite(s) and s < 0 for s in scores)
        assert sample["acc"] == float(max(range(len(scores)), key=scores.__getitem__) == sample["doc"]["answer"])
    # Each choice's score is the server's own log-probability of its tokens after the context.
    first = samples["xllm_choice"][0]
    context = reference.tokenizer.encode(first["doc"]["question"])
    whole = reference.tokenizer.encode(first["doc"]["question"] + first["doc"]["choices"][0])  # (as lm-eval splits)
    status, scored, _ = post(server.port, "/v1/completions", {"prompt": whole, "max_tokens": 0, "echo": True,
                                                              "logprobs": 0})
    assert status == 200, scored
    expected = sum(scored["choices"][0]["logprobs"]["token_logprobs"][len(context):])
    assert first["resps"][0][0][0] == pytest.approx(expected, abs=1e-3)
    # Each generation is what the server answers greedily to the same prompt.
    for sample in samples["xllm_generation"]:
        status, done, _ = post(server.port, "/v1/completions", {
            "prompt": sample["doc"]["question"], "max_tokens": 6, "temperature": 0, "stop": ["\n", "<|im_end|>"]})
        assert status == 200 and sample["resps"][0][0] == done["choices"][0]["text"]


def test_lm_eval_local_chat_completions_with_the_servers_tokenizer(server, tmp_path, monkeypatch):
    """The chat model reads nothing of /tokenizer_info by default; told `tokenizer_backend=remote`,
    it takes the EOS (its stop string) from there and sends the messages to the chat route."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path)
    lm = get_model("local-chat-completions").create_from_arg_string(
        f"base_url=http://127.0.0.1:{server.port}/v1/chat/completions,model=tiny,tokenizer_backend=remote")
    assert lm.eos_string == "<|im_end|>"
    results = simple_evaluate(model=lm, tasks=["xllm_generation"], bootstrap_iters=0, apply_chat_template=True,
                              task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    for sample in results["samples"]["xllm_generation"]:
        messages = [{"role": "user", "content": sample["doc"]["question"]}]
        status, done, _ = post(server.port, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 6, "temperature": 0, "stop": ["\n", "<|im_end|>"]})
        assert status == 200 and sample["resps"][0][0] == done["choices"][0]["message"]["content"]
