"""OpenAI request bodies -> validated prompts and sampling parameters."""

from __future__ import annotations

import functools
import inspect

import orjson

from ..engine.sampling import MAX_SEED, MIN_SEED, SamplingParams
from ..errors import ApiError
from .fields import Fields, bad, is_int, shown

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 1024
# Text longer than this, in characters, is tokenized with the GIL released and off the event loop:
# tokenizing costs ~0.7 us a character (11 ms at this length), so a 16 MB prompt would stall every
# other client for 12 s.
LONG_TEXT = 16_384
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's, less the deprecated "function"
# OpenAI fields this server does not implement: accepted only at the value that changes nothing
# (a request relying on them must not get an answer that silently ignored them).
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "tools": [],
               "functions": [], "suffix": "", "best_of": 1,
               # vLLM's extensions we do not implement
               "repetition_penalty": 1.0, "min_tokens": 0}


class BeamLimits:
    """What beam (recommendation) requests may ask for on this server."""

    __slots__ = ("supported", "max_beam_width", "max_num_return_sequences", "default_rounds", "item_length",
                 "max_rounds")

    def __init__(self, supported: bool = True, max_beam_width: int = 128, max_num_return_sequences: int = 128,
                 default_rounds: int = 3, item_length: int = 0, max_rounds: int = 64) -> None:
        self.supported = supported  # the continuous scheduler runs no beam search
        self.max_beam_width = max_beam_width
        self.max_num_return_sequences = max_num_return_sequences
        self.default_rounds = item_length or default_rounds
        self.item_length = item_length  # with an item table: every item id's length in tokens (0: no table)
        self.max_rounds = max_rounds


class ModelInfo:
    """What validation needs to know about the served model and its limits."""

    __slots__ = ("name", "tokenizer", "vocab_size", "max_model_len", "max_n", "beam", "encode")

    def __init__(self, name: str, tokenizer, vocab_size: int, max_model_len: int, max_n: int,
                 beam: BeamLimits | None = None) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_n = max_n
        self.beam = beam or BeamLimits()
        # The Rust tokenizer directly: the Python wrapper costs more than the encoding itself.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            def encode(text: str, special: bool) -> list[int]:
                if len(text) < LONG_TEXT:
                    return backend.encode(text, add_special_tokens=special).ids
                # encode holds the GIL throughout; encode_batch lets the loop and the slots run meanwhile.
                return backend.encode_batch([text], add_special_tokens=special)[0].ids
            self.encode = encode
        else:
            self.encode = lambda text, special: tokenizer.encode(text, add_special_tokens=special)


class GenerationSpec:
    """One validated request: its prompts (token ids), parameters and output options."""

    __slots__ = ("prompts", "params", "n", "stream", "include_usage", "chat", "top_logprobs", "beam_width",
                 "num_return_sequences", "scoring", "allowed_items", "excluded_items")

    def __init__(self, prompts, params, n, stream, include_usage, chat, top_logprobs, beam_width=None,
                 num_return_sequences=1) -> None:
        self.prompts: list[list[int]] = prompts
        self.params: SamplingParams = params
        self.n: int = n
        self.stream: bool = stream
        self.include_usage: bool = include_usage
        self.chat: bool = chat
        self.top_logprobs = top_logprobs
        self.beam_width: int | None = beam_width  # set: a beam search (params.max_tokens = its rounds)
        self.num_return_sequences: int = num_return_sequences
        self.scoring: Scoring | None = None  # completions that echo or score their prompts
        # A beam search's filters of the item table (item ids as sent; the route resolves them).
        self.allowed_items: list[str] | None = None
        self.excluded_items: list[str] | None = None


class Scoring:
    """What a completion asks about its prompts (scoring, as lm-eval-harness does): `echo` puts
    each prompt before its completion (with `logprobs`, the prompt tokens' too); `prompt_logprobs`
    (vLLM's) adds every prompt token's log-probability, rank and alternatives; max_tokens 0 with
    echo answers with the prompt alone."""

    __slots__ = ("echo", "texts", "prompt_logprobs", "no_output")

    def __init__(self, echo: bool, texts: list[str | None], prompt_logprobs: int | None, no_output: bool) -> None:
        self.echo = echo
        self.texts = texts  # each prompt as sent, where it was text (token ids are decoded for echo)
        self.prompt_logprobs = prompt_logprobs
        self.no_output = no_output


def parse_json(body: bytes) -> dict:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "Request body must be a JSON object")
    return data


def holds_long_text(body: dict, size: int, chat: bool) -> bool:
    """Whether a request of `size` bytes may ask to tokenize LONG_TEXT characters or more
    (token-id prompts never do; a list of prompts is either all text or all ids)."""
    if size < LONG_TEXT:
        return False
    if chat:
        return True
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))


def parse_completion(body: dict, model: ModelInfo) -> GenerationSpec:
    fields = Fields(body)
    _check_model(fields, model)
    _check_unsupported(body)
    prompts = _completion_prompts(fields.raw("prompt"), model)
    logprobs = fields.int("logprobs", None, 0, MAX_LOGPROBS)
    echo = fields.bool("echo", False)
    prompt_logprobs = fields.int("prompt_logprobs", None, 0, MAX_LOGPROBS)
    max_tokens = fields.int("max_tokens", None, 0 if echo else 1)
    if max_tokens is None and fields.raw("beam_width") is None:
        max_tokens = 16  # OpenAI's default for completions
    no_output = max_tokens == 0  # (one token is generated and left out: every sequence makes one)
    spec = _spec(fields, model, prompts, 1 if no_output else max_tokens, "prompt", logprobs, chat=False)
    if echo or prompt_logprobs is not None:
        for name, value in (("stream", spec.stream), ("beam_width", spec.beam_width is not None)):
            if value:
                raise bad(name, f"`echo` and `prompt_logprobs` are not supported with `{name}`")
        raw = fields.raw("prompt")
        texts = [raw] if isinstance(raw, str) else [p if isinstance(p, str) else None for p in raw]
        if len(texts) != len(prompts):  # a list of token ids is one prompt
            texts = [None]
        # The prompt's scores: for echo with logprobs, and for prompt_logprobs, the wider of the two.
        wanted = [k for k in (logprobs if echo else None, prompt_logprobs) if k is not None]
        spec.params.prompt_logprobs = max(wanted) if wanted else None
        spec.scoring = Scoring(echo, texts, prompt_logprobs, no_output)
    return spec


def parse_chat(body: dict, model: ModelInfo) -> GenerationSpec:
    fields = Fields(body)
    _check_model(fields, model)
    _check_unsupported(body)
    if fields.dict("response_format").get("type", "text") != "text":
        raise bad("response_format", "Only `response_format: {\"type\": \"text\"}` is supported by this server")
    for name in ("echo", "prompt_logprobs"):
        if fields.raw(name) not in (None, False):
            raise bad(name, f"`{name}` is not supported on chat completions by this server; use /v1/completions")
    prompt = _chat_prompt(fields.raw("messages"), model, fields.bool("add_generation_prompt", True),
                          fields.dict("chat_template_kwargs"))
    logprobs = None
    if fields.bool("logprobs", False):
        logprobs = fields.int("top_logprobs", 0, 0, MAX_LOGPROBS)
    elif fields.raw("top_logprobs") is not None:
        raise bad("top_logprobs", "`top_logprobs` needs `logprobs: true`")
    max_tokens = fields.int("max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = fields.int("max_tokens", None, 1)
    return _spec(fields, model, [prompt], max_tokens, "messages", logprobs, chat=True)


def _spec(fields: Fields, model: ModelInfo, prompts: list[list[int]], max_tokens: int | None, prompt_param: str,
          logprobs: int | None, chat: bool) -> GenerationSpec:
    beam_width = _beam_width(fields, model)
    if beam_width is not None and max_tokens is None:
        max_tokens = model.beam.default_rounds  # an item id's length
    if beam_width is not None and model.beam.item_length and max_tokens != model.beam.item_length:
        raise bad("max_tokens", f"Items of this server's table are {model.beam.item_length} tokens long: "
                                f"`max_tokens` must be {model.beam.item_length} with `beam_width` (or absent)")
    if beam_width is not None and max_tokens > model.beam.max_rounds:
        raise bad("max_tokens", f"A beam search runs at most {model.beam.max_rounds} rounds on this server "
                                f"(XLLM_MAX_BEAM_ROUNDS): `max_tokens` must be at most that with `beam_width`")
    longest = max(len(p) for p in prompts)
    if longest >= model.max_model_len:
        raise bad(prompt_param, f"This model's maximum context length is {model.max_model_len} tokens, "
                                f"but the prompt has {longest} tokens")
    if max_tokens is None:  # chat without a limit: whatever room the context leaves
        max_tokens = model.max_model_len - longest
    elif longest + max_tokens > model.max_model_len:
        raise bad("max_tokens", f"This model's maximum context length is {model.max_model_len} tokens. "
                                f"However, you requested {longest + max_tokens} tokens ({longest} in the prompt, "
                                f"{max_tokens} for the completion)")
    top_k = fields.int("top_k", 0, -1)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=fields.float("temperature", 1.0, 0.0, 100.0),
        top_p=fields.float("top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k, 0),  # -1 and 0 both mean "off", as in vLLM
        min_p=fields.float("min_p", 0.0, 0.0, 1.0),
        seed=fields.int("seed", None, MIN_SEED, MAX_SEED),
        stop=fields.str_list("stop", MAX_STOP_STRINGS),
        stop_token_ids=frozenset(fields.int_list("stop_token_ids", 0, model.vocab_size - 1)),
        ignore_eos=fields.bool("ignore_eos", False),
        logprobs=logprobs,
        include_stop=fields.bool("include_stop_str_in_output", False),
    )
    stream = fields.bool("stream", False)
    options = Fields(fields.dict("stream_options"))
    if fields.raw("stream_options") is not None and not stream:  # (even {}: OpenAI refuses it too)
        raise bad("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
    user = fields.raw("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"`user` must be a string, got {shown(user)}")
    include_usage = stream and options.bool("include_usage", False)
    n = fields.int("n", 1, 1, model.max_n)
    if beam_width is None:
        for name in ITEM_FILTERS:
            if fields.raw(name) is not None:
                raise bad(name, f"`{name}` applies to a beam search over the item table: give `beam_width` too")
        return GenerationSpec(prompts, params, n, stream, include_usage, chat, logprobs)
    _check_beam_fields(fields, params)
    num_return = fields.int("num_return_sequences", 1, 1, min(beam_width, model.beam.max_num_return_sequences))
    if n != 1:
        raise bad("n", "`n` must be 1 with `beam_width`; ask for `num_return_sequences` instead")
    spec = GenerationSpec(prompts, params, 1, stream, include_usage, chat, logprobs, beam_width, num_return)
    spec.allowed_items, spec.excluded_items = (_item_ids(fields, name, model) for name in ITEM_FILTERS)
    return spec


ITEM_FILTERS = ("allowed_item_ids", "exclude_item_ids")


def _item_ids(fields: Fields, name: str, model: ModelInfo) -> list[str] | None:
    """An item filter's ids as strings (numbers are taken for the ids they spell), or None."""
    value = fields.raw(name)
    if value is None:
        return None
    if not model.beam.item_length:
        raise bad(name, f"`{name}` filters the item table, and this server has none (XLLM_ITEM_TABLE)")
    if not isinstance(value, list) or not all(isinstance(v, str) or is_int(v) for v in value):
        raise bad(name, f"`{name}` must be a list of item ids (strings or integers)")
    if name == "allowed_item_ids" and not value:
        raise bad(name, "`allowed_item_ids` must name at least one item")
    return [v if isinstance(v, str) else str(v) for v in value]


def _beam_width(fields: Fields, model: ModelInfo) -> int | None:
    """beam_width if this is a beam search; None for ordinary generation."""
    width = fields.int("beam_width", None, 1, model.beam.max_beam_width)
    if width is None:
        return None
    if fields.bool("stream", False):
        # Even one beam keeps to the item table and its rounds, and answers at the end: greedy
        # streaming instead would quietly ignore both.
        raise bad("stream", "A beam search returns its sequences at the end: `stream` must be false "
                            "with `beam_width`")
    if not model.beam.supported:
        raise bad("beam_width", "Beam search runs on the fixed_steps scheduler; this server runs continuous "
                                "(set XLLM_SCHEDULER=fixed_steps)")
    return width


def _check_model(fields: Fields, model: ModelInfo) -> None:
    name = fields.raw("model")
    if name is not None and name != model.name:
        if not isinstance(name, str):
            raise bad("model", f"`model` must be a string, got {shown(name)}")
        raise ApiError(404, f"The model `{name}` does not exist.", param="model")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is None:
            continue
        if neutral is None:
            raise bad(name, f"`{name}` is not supported by this server")
        # The type first: `true == 1` in Python, and best_of: true is no number.
        if not (_is_number(value) if _is_number(neutral) else type(value) is type(neutral)):
            kind = {int: "a number", float: "a number", bool: "a boolean", str: "a string", dict: "an object",
                    list: "a list"}[type(neutral)]
            raise bad(name, f"`{name}` must be {kind}, got {shown(value)}")
        if value != neutral:
            raise bad(name, f"`{name}` is not supported by this server (only {neutral!r} is accepted)")


def _check_beam_fields(fields: Fields, params: SamplingParams) -> None:
    """A beam search ranks by the model's log-probabilities and runs all its rounds: fields that
    would change that get a 400 rather than be silently ignored."""
    if params.temperature not in (0.0, 1.0):
        raise bad("temperature", "A beam search ranks by the model's log-probabilities: `temperature` must be "
                                 "0 or 1 (or absent) with `beam_width`")
    for name, used in (("top_p", params.top_p < 1.0), ("top_k", params.top_k > 0), ("min_p", params.min_p > 0),
                       ("stop", bool(params.stop)), ("stop_token_ids", bool(params.stop_token_ids)),
                       ("logprobs", params.logprobs is not None)):
        if used:
            raise bad(name, f"`{name}` does not apply to a beam search (`beam_width`); leave it out")


def _completion_prompts(prompt, model: ModelInfo) -> list[list[int]]:
    if isinstance(prompt, str):
        return [_encoded(model, prompt, "prompt", special=True)]
    if isinstance(prompt, list) and prompt:
        if _all_ints(prompt):
            return [_checked_ids(prompt, model)]
        if len(prompt) <= MAX_PROMPTS:
            if all(isinstance(p, str) for p in prompt):
                return [_encoded(model, p, "prompt", special=True) for p in prompt]
            if all(isinstance(p, list) and p and _all_ints(p) for p in prompt):
                return [_checked_ids(p, model) for p in prompt]
    raise bad("prompt", "`prompt` must be a non-empty string, a list of token ids, or a list of either "
                        f"(at most {MAX_PROMPTS})")


def _encoded(model: ModelInfo, text: str, param: str, special: bool) -> list[int]:
    ids = model.encode(text, special)
    if not ids:
        raise bad(param, f"`{param}` is empty after tokenisation")
    return ids


def _all_ints(values: list) -> bool:
    # set(map(type, ...)) runs in C: a 320-token prompt is checked in microseconds (and bools are refused).
    return set(map(type, values)) == {int}


def _checked_ids(ids: list[int], model: ModelInfo) -> list[int]:
    top = model.vocab_size - 1
    low, high = min(ids), max(ids)
    if low < 0 or high > top:
        raise bad("prompt", f"token id {low if low < 0 else high} is outside the vocabulary [0, {top}]")
    return ids


def _chat_prompt(messages, model: ModelInfo, add_generation_prompt: bool, template_kwargs: dict) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "`messages` must be a non-empty list")
    plain = [_chat_message(message, i) for i, message in enumerate(messages)]
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "This model has no chat template; use /v1/completions", param="messages")
    taken = _named_parameters(type(tokenizer).apply_chat_template).intersection(template_kwargs)
    if taken:  # only the template's own variables (enable_thinking, ...), never the call's arguments
        raise bad("chat_template_kwargs", f"`chat_template_kwargs` may not set {', '.join(sorted(taken))}")
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **template_kwargs)
    except Exception as exc:  # a template may raise on roles or orders it does not accept
        raise bad("messages", f"The chat template rejected these messages: {exc}") from None
    # The template already wrote the special tokens it wants.
    return _encoded(model, text, "messages", special=False)


@functools.cache
def _named_parameters(function) -> frozenset[str]:
    """A function's named parameters (apply_chat_template's: tokenize, conversation, ...)."""
    return frozenset(n for n, p in inspect.signature(function).parameters.items() if p.kind is not p.VAR_KEYWORD)


def _chat_message(message, i: int) -> dict:
    """One message checked as OpenAI checks it (the param names the field: messages[i].role);
    what the chat template gets: role, content as text, and name if given."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad(where, f"`{where}` must be an object, got {shown(message)}")
    role = message.get("role")
    if role is None:
        raise bad(f"{where}.role", f"Missing required parameter: '{where}.role'.")
    if role not in ROLES:  # (a non-string is not among them either)
        raise bad(f"{where}.role", f"Invalid value: {shown(role)}. Supported values are: "
                                   + ", ".join(f"'{r}'" for r in ROLES) + ".")
    content = message.get("content")
    if content is None:
        # Only an assistant's may be missing (it made tool calls instead).
        if role != "assistant":
            raise bad(f"{where}.content", f"Missing required parameter: '{where}.content'.")
        text = ""
    else:
        text = _message_text(content, f"{where}.content")
    # "developer" is OpenAI's newer name for "system"; chat templates know the older one.
    plain = {"role": "system" if role == "developer" else role, "content": text}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad(f"{where}.name", f"`{where}.name` must be a string, got {shown(name)}")
        plain["name"] = name
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise bad(f"{where}.tool_call_id", f"Missing required parameter: '{where}.tool_call_id' (a string).")
    calls = message.get("tool_calls")
    if calls is not None:
        if not (role == "assistant" and isinstance(calls, list)):
            raise bad(f"{where}.tool_calls", f"`{where}.tool_calls` must be a list, on an assistant message")
        plain["tool_calls"] = [_tool_call(call) for call in calls]
    if role == "tool":
        plain["tool_call_id"] = message["tool_call_id"]
    return plain


def _tool_call(call):
    """An assistant's tool call as chat templates expect it: OpenAI sends the arguments as a JSON
    string, templates (Llama's, Qwen's) want the object; as vLLM does, it is parsed. Whatever the
    template cannot render, it rejects (a 400)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = orjson.loads(function["arguments"])
    except orjson.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _message_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"`{where}` must be a string or a list of text parts, got {type(content).__name__}")
    if not content:
        raise bad(where, f"Invalid '{where}': empty array. Expected an array with minimum length 1.")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad(f"{where}[{j}]", f"`{where}[{j}]` must be an object")
        kind = part.get("type")
        if kind != "text":
            raise bad(f"{where}[{j}].type", f"Content parts of type {shown(kind)} are not supported by this server; "
                                            "send {\"type\": \"text\", \"text\": ...}")
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}].text", f"`{where}[{j}].text` must be a string")
        parts.append(part["text"])
    return "\n".join(parts)
