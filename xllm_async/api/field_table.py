"""Every field of OpenAI's, vLLM's and SGLang's completion and chat request schemas, with what
this server does with it: reads it (IMPLEMENTED), accepts it only at values that change nothing
(Neutral), or refuses it with a 400 naming it (REFUSED; also a field of the other route only).
A request relying on a field must never get an answer that silently ignored it. Fields that none
of those schemas know are ignored, as vLLM ignores them.

The parsers (api/requests.py) call check_fields first; docs/API.md's table is markdown_table()
(tests/test_field_table.py keeps the two equal). Implementing a field is flipping its row to
IMPLEMENTED and reading it in the parser."""

from __future__ import annotations

import orjson

from .fields import bad, shown

IMPLEMENTED = "implemented"


class Neutral:
    """Not implemented: accepted absent, null, or at one of `values` (of the same JSON type), or,
    with `kind`, at any value of that type (a hint that changes nothing here)."""

    __slots__ = ("values", "kind")

    def __init__(self, *values, kind: type | None = None) -> None:
        self.values = values
        self.kind = kind

    def allows(self, value) -> bool:
        if self.kind is not None:
            return _json_type(value) is self.kind
        # The JSON type first: `true == 1` in Python, and best_of: true is no number.
        return any(_json_type(value) == _json_type(v) and value == v for v in self.values)

    def shown(self) -> str:
        if self.kind is not None:
            return f"any {_KIND_NAMES[self.kind]} (changes nothing here)"
        if not self.values:
            return "400"
        return "only " + " or ".join(f"`{_json(v)}`" for v in self.values)


REFUSED = Neutral()  # no value but null is accepted
SAME = object()  # the chat route behaves as the completions route


class FieldRule:
    """One field: our behaviour on each route (None: not a field of that route), theirs in words,
    and a hint added to our 400."""

    __slots__ = ("name", "completions", "chat", "theirs", "hint")

    def __init__(self, name: str, completions, chat=SAME, theirs: str = "", hint: str = "") -> None:
        self.name = name
        self.completions = completions
        self.chat = completions if chat is SAME else chat
        self.theirs = theirs
        self.hint = hint


R = FieldRule
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GUIDED = "vLLM: structured outputs (xgrammar/guidance)"
RULES = [
    # --- OpenAI's fields ---
    R("model", IMPLEMENTED, theirs="the served model's name (vLLM/SGLang: or a LoRA adapter's; 404 here)"),
    R("prompt", IMPLEMENTED, None, theirs="text or token ids, one or many"),
    R("messages", None, IMPLEMENTED, theirs="the conversation"),
    R("max_tokens", IMPLEMENTED, theirs="completions: 16 by default; chat: the room left"),
    R("max_completion_tokens", None, IMPLEMENTED, theirs="chat's newer name for max_tokens"),
    R("temperature", IMPLEMENTED), R("top_p", IMPLEMENTED), R("n", IMPLEMENTED), R("seed", IMPLEMENTED),
    R("stop", IMPLEMENTED), R("stream", IMPLEMENTED), R("stream_options", IMPLEMENTED),
    R("user", IMPLEMENTED, theirs="an end user's id: accepted, used for nothing"),
    R("logprobs", IMPLEMENTED, theirs="completions: an integer k; chat: a boolean"),
    R("top_logprobs", None, IMPLEMENTED, theirs="chat: k with logprobs: true"),
    R("echo", IMPLEMENTED, Neutral(False), theirs="completions: the prompt before the answer; vLLM chat: "
      "prepends the last message", hint="; it is served on /v1/completions"),
    R("suffix", Neutral(""), theirs="vLLM refuses it"),
    R("best_of", Neutral(1), theirs="vLLM V0: n best of best_of samples"),
    R("frequency_penalty", IMPLEMENTED, theirs="vLLM/SGLang: penalty by count in the output"),
    R("presence_penalty", IMPLEMENTED, theirs="vLLM/SGLang: penalty once present in the output"),
    R("logit_bias", IMPLEMENTED, theirs="vLLM/SGLang: token id -> bias added to its logit"),
    R("response_format", IMPLEMENTED, theirs="json_object / json_schema / structural_tag: "
      "constrained decoding"),
    R("tools", Neutral([]), theirs="chat: tool definitions for the template and tool-call parsing"),
    R("tool_choice", Neutral("none", "auto"), theirs="chat: which tool must be called"),
    R("functions", Neutral([]), theirs="OpenAI's deprecated tools"),
    R("function_call", Neutral("none", "auto"), theirs="OpenAI's deprecated tool_choice"),
    R("parallel_tool_calls", Neutral(True, False), theirs="vLLM: ignored; with no tools it changes nothing"),
    R("reasoning_effort", None, REFUSED, theirs="vLLM/SGLang: passed to reasoning models' templates"),
    R("metadata", None, Neutral(kind=dict), theirs="OpenAI: tags for stored completions"),
    R("store", None, Neutral(False), theirs="OpenAI: keep the completion"),
    R("service_tier", None, Neutral("auto", "default"), theirs="OpenAI: processing tier"),
    R("modalities", None, Neutral(["text"]), theirs="OpenAI: text and audio output"),
    R("audio", None, REFUSED, theirs="OpenAI: audio output"),
    R("prediction", None, REFUSED, theirs="OpenAI: predicted output"),
    R("web_search_options", None, REFUSED, theirs="OpenAI: web search"),
    R("verbosity", None, REFUSED, theirs="OpenAI: answer length for reasoning models"),
    R("prompt_cache_key", None, Neutral(kind=str), theirs="OpenAI: cache routing hint (our prefix cache "
      "matches by content)"),
    R("safety_identifier", None, Neutral(kind=str), theirs="OpenAI: user's id for abuse detection"),
    # --- vLLM's sampling and extra fields ---
    R("use_beam_search", IMPLEMENTED, theirs="vLLM: beam search of width n, n sequences best first"),
    R("length_penalty", IMPLEMENTED, theirs="vLLM: beam score = logprob / length^penalty"),
    R("early_stopping", Neutral(False), theirs="vLLM V0 beam search: stop once n beams finished"),
    R("top_k", IMPLEMENTED), R("min_p", IMPLEMENTED), R("stop_token_ids", IMPLEMENTED),
    R("include_stop_str_in_output", IMPLEMENTED), R("ignore_eos", IMPLEMENTED),
    R("prompt_logprobs", IMPLEMENTED, REFUSED, theirs="each prompt token's logprob, rank, alternatives",
      hint="; it is served on /v1/completions"),
    R("repetition_penalty", IMPLEMENTED, theirs="vLLM/SGLang: penalty over prompt and output tokens"),
    R("min_tokens", IMPLEMENTED, theirs="vLLM/SGLang: EOS and stop tokens masked until reached"),
    R("skip_special_tokens", Neutral(True), theirs="vLLM/SGLang: special tokens left out of text"),
    R("spaces_between_special_tokens", Neutral(True), theirs="vLLM: detokenizer spacing"),
    R("truncate_prompt_tokens", REFUSED, theirs="vLLM: keep only the prompt's last k tokens"),
    R("allowed_token_ids", IMPLEMENTED, theirs="vLLM: sample only among these tokens"),
    R("bad_words", IMPLEMENTED, theirs="vLLM: words never generated"),
    R("add_special_tokens", Neutral(True), Neutral(False), theirs="vLLM: BOS etc. added to the prompt"),
    R("add_generation_prompt", None, IMPLEMENTED, theirs="chat template's assistant header"),
    R("continue_final_message", None, Neutral(False), theirs="vLLM/SGLang: continue the last message"),
    R("documents", None, REFUSED, theirs="vLLM: RAG documents for the template"),
    R("chat_template", None, REFUSED, theirs="vLLM: a template of the request's own"),
    R("chat_template_kwargs", None, IMPLEMENTED, theirs="the template's own variables"),
    R("mm_processor_kwargs", None, REFUSED, theirs="vLLM: multimodal processor options"),
    R("structured_outputs", IMPLEMENTED, theirs=GUIDED + ": json, regex, choice, grammar"),
    R("guided_json", IMPLEMENTED, theirs=GUIDED), R("guided_regex", IMPLEMENTED, theirs=GUIDED),
    R("guided_choice", IMPLEMENTED, theirs=GUIDED), R("guided_grammar", IMPLEMENTED, theirs=GUIDED),
    R("guided_decoding_backend", REFUSED, theirs=GUIDED + ": which library"),
    R("guided_whitespace_pattern", REFUSED, theirs=GUIDED + ": JSON whitespace"),
    R("structural_tag", REFUSED, theirs=GUIDED + ": tagged regions"),
    R("priority", Neutral(0), theirs="vLLM/SGLang: scheduling priority (with priority scheduling)"),
    R("request_id", Neutral(kind=str), theirs="vLLM: the request's id in its logs and answer"),
    R("logits_processors", REFUSED, theirs="vLLM: logits processors by qualified name"),
    R("return_tokens_as_token_ids", IMPLEMENTED, theirs="vLLM: logprobs tokens as \"token_id:N\""),
    R("return_token_ids", Neutral(False), theirs="vLLM/SGLang: token ids in each choice"),
    R("cache_salt", REFUSED, theirs="vLLM/SGLang: prefix cache kept apart per salt"),
    R("kv_transfer_params", REFUSED, theirs="vLLM: disaggregated prefill"),
    R("vllm_xargs", REFUSED, theirs="vLLM: custom extensions' arguments"),
    R("prompt_embeds", REFUSED, None, theirs="vLLM: prompt as embeddings"),
    R("include_reasoning", None, Neutral(True), theirs="vLLM: reasoning content in the answer"),
    R("lora_request", REFUSED, theirs="vLLM offline API only: a LoRA adapter (served: by `model` name)"),
    # --- SGLang's extra fields ---
    R("json_schema", REFUSED, theirs="SGLang: constrained to a JSON schema"),
    R("regex", REFUSED, theirs="SGLang: constrained to a regex"),
    R("ebnf", REFUSED, theirs="SGLang: constrained to an EBNF grammar"),
    R("stop_regex", REFUSED, theirs="SGLang: stop at a regex match"),
    R("no_stop_trim", Neutral(False), theirs="SGLang: keep the stop string"),
    R("lora_path", REFUSED, theirs="SGLang: a LoRA adapter"),
    R("session_id", REFUSED, theirs="SGLang: session continuation"),
    R("session_params", REFUSED, theirs="SGLang: session continuation"),
    R("custom_params", REFUSED, theirs="SGLang: custom logit processor's arguments"),
    R("custom_logit_processor", REFUSED, theirs="SGLang: a serialized logit processor"),
    R("return_hidden_states", Neutral(False), theirs="SGLang: hidden states in the answer"),
    R("return_routed_experts", Neutral(False), theirs="SGLang: MoE routing in the answer"),
    R("routed_experts_start_len", Neutral(0), theirs="SGLang: with return_routed_experts"),
    R("return_cached_tokens_details", Neutral(False), theirs="SGLang: cache tiers in usage"),
    R("return_prompt_token_ids", None, Neutral(False), theirs="SGLang: prompt ids in each choice"),
    R("return_meta_info", None, Neutral(False), theirs="SGLang: scheduler details in each choice"),
    R("separate_reasoning", None, Neutral(True, False), theirs="SGLang: with a reasoning parser (none here)"),
    R("stream_reasoning", None, Neutral(True, False), theirs="SGLang: with a reasoning parser (none here)"),
    R("images_config", REFUSED, theirs="SGLang: image preprocessing"),
    R("max_dynamic_patch", None, REFUSED, theirs="SGLang: image tiling"),
    R("min_dynamic_patch", None, REFUSED, theirs="SGLang: image tiling"),
    R("use_audio_in_video", None, Neutral(False), theirs="SGLang: video's audio track"),
    R("input_ids", None, REFUSED, theirs="SGLang: the chat prompt as token ids"),
    R("rid", Neutral(kind=str), theirs="SGLang: the request's id"),
    R("extra_key", REFUSED, theirs="SGLang: cache kept apart per key"),
    R("ngram_corpus_id", REFUSED, theirs="SGLang: n-gram speculative corpus"),
    R("custom_labels", REFUSED, theirs="SGLang: metric labels"),
    R("bootstrap_host", REFUSED, theirs="SGLang: disaggregated prefill"),
    R("bootstrap_port", REFUSED, theirs="SGLang: disaggregated prefill"),
    R("bootstrap_room", REFUSED, theirs="SGLang: disaggregated prefill"),
    R("routed_dp_rank", REFUSED, theirs="SGLang: data-parallel routing"),
    R("disagg_prefill_dp_rank", REFUSED, theirs="SGLang: data-parallel routing"),
    R("data_parallel_rank", REFUSED, theirs="SGLang: data-parallel routing (deprecated)"),
    R("task", None, REFUSED, theirs="SGLang: DeepSeek-V4 quick instruction"),
    R("reasoning", None, REFUSED, theirs="SGLang: reasoning effort and switch"),
    # --- ours (xLLM's recommendation fields: docs/RECOMMENDATION.md) ---
    R("beam_width", IMPLEMENTED, theirs="ours"), R("num_return_sequences", IMPLEMENTED, theirs="ours"),
    R("allowed_item_ids", IMPLEMENTED, theirs="ours"), R("exclude_item_ids", IMPLEMENTED, theirs="ours"),
]
TABLE: dict[str, FieldRule] = {rule.name: rule for rule in RULES}
assert len(TABLE) == len(RULES), "a field listed twice"


# Per route, the fields it does not simply read: a body with none of them (nearly every request)
# is checked by one set operation in C instead of a table look-up per field.
_CHECKED = {chat: frozenset(rule.name for rule in RULES
                            if (rule.chat if chat else rule.completions) is not IMPLEMENTED)
            for chat in (False, True)}


def check_fields(body: dict, chat: bool) -> None:
    """400 naming the first field of BODY that this route refuses, or that it sets to a value
    we would ignore. Null counts as absent; fields no schema knows are left alone."""
    if _CHECKED[chat].isdisjoint(body):
        return
    for name, value in body.items():
        rule = TABLE.get(name)
        if rule is None or value is None:
            continue
        behaviour = rule.chat if chat else rule.completions
        if behaviour is IMPLEMENTED:
            continue
        if behaviour is None:
            route, other = (CHAT, COMPLETIONS) if chat else (COMPLETIONS, CHAT)
            raise bad(name, f"`{name}` is not a field of {route} (it is one of {other})")
        if behaviour.allows(value):
            continue
        kinds = [behaviour.kind] if behaviour.kind else [_json_type(v) for v in behaviour.values]
        if kinds and _json_type(value) not in kinds:
            raise bad(name, f"`{name}` must be {_KIND_NAMES[kinds[0]]}, got {shown(value)}")
        accepted = f" ({behaviour.shown()} is accepted)" if behaviour.values else ""
        route = CHAT if chat else COMPLETIONS
        raise bad(name, f"`{name}` is not supported on {route} by this server{accepted}{rule.hint}")


def neutral_values(chat: bool) -> dict[str, Neutral | None]:
    """The fields this route does not implement, with what it accepts of each (None: nothing but
    null, being the other route's field): the fuzzer draws them."""
    out = {}
    for rule in RULES:
        behaviour = rule.chat if chat else rule.completions
        if behaviour is not IMPLEMENTED:
            out[rule.name] = behaviour
    return out


def markdown_table() -> str:
    """docs/API.md's table of fields (tests/test_field_table.py checks the page holds it)."""
    lines = ["| field | `/v1/completions` | `/v1/chat/completions` | OpenAI / vLLM / SGLang |",
             "| --- | --- | --- | --- |"]
    for rule in RULES:
        theirs = rule.theirs or "the same"
        lines.append(f"| `{rule.name}` | {_cell(rule.completions)} | {_cell(rule.chat)} | {theirs} |")
    return "\n".join(lines) + "\n"


def _cell(behaviour) -> str:
    if behaviour is IMPLEMENTED:
        return "yes"
    if behaviour is None:
        return "400 (the other route's)"
    return behaviour.shown()


def _json_type(value) -> type:
    if isinstance(value, bool):
        return bool
    if isinstance(value, (int, float)):
        return float  # JSON has one kind of number: 1 and 1.0 are the same value
    return type(value)


def _json(value) -> str:
    return orjson.dumps(value).decode()


_KIND_NAMES = {float: "a number", bool: "a boolean", str: "a string", dict: "an object", list: "a list"}
