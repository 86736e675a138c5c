"""OpenAI request bodies -> validated generation specs: prompts as token ids, sampling
parameters, output options, and a beam search's fields."""

from __future__ import annotations

import orjson

from ..engine.params import MAX_SEED, MIN_SEED, SamplingParams
from ..errors import ApiError
from .field_table import check_fields
from .fields import Fields, bad, is_int, shown
from .model_info import LONG_TEXT, ModelInfo
from .prompts import chat_prompt, completion_prompts
from .structured import GrammarSpec, structured_output
from .token_controls import token_controls, used_controls
from .vllm_beams import read_use_beam_search

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


class GenerationSpec:
    """One validated request: its prompts (token ids), parameters and output options."""

    __slots__ = ("prompts", "params", "n", "stream", "include_usage", "chat", "top_logprobs", "beam_width",
                 "num_return_sequences", "scoring", "allowed_items", "excluded_items", "beams_stop_at_eos",
                 "tokens_as_ids", "grammar")

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
        self.beams_stop_at_eos = False  # vLLM's use_beam_search without ignore_eos: answers end at EOS
        self.tokens_as_ids = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:N"
        self.grammar: GrammarSpec | None = None  # a structured output (api/structured.py)


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
    check_fields(body, chat=False)
    prompts = completion_prompts(fields.raw("prompt"), model)
    logprobs = fields.int("logprobs", None, 0, MAX_LOGPROBS)
    echo = fields.bool("echo", False)
    prompt_logprobs = fields.int("prompt_logprobs", None, 0, MAX_LOGPROBS)
    max_tokens = fields.int("max_tokens", None, 0 if echo else 1)
    if max_tokens is None and fields.raw("beam_width") is None:  # (use_beam_search takes it too, as vLLM)
        max_tokens = 16  # OpenAI's default for completions
    no_output = max_tokens == 0  # (one token is generated and left out: every sequence makes one)
    spec = _spec(fields, model, prompts, 1 if no_output else max_tokens, "prompt", logprobs, chat=False)
    if echo or prompt_logprobs is not None:
        beams = "use_beam_search" if fields.raw("use_beam_search") else "beam_width"
        for name, value in (("stream", spec.stream), (beams, spec.beam_width is not None)):
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
    check_fields(body, chat=True)
    prompt = chat_prompt(fields.raw("messages"), model, fields.bool("add_generation_prompt", True),
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
    vllm_beams = read_use_beam_search(fields, model)
    beam_width = _beam_width(fields, model, vllm_beams)
    longest = max(len(p) for p in prompts)
    if beam_width is not None and max_tokens is None:
        if vllm_beams is not None and not model.beam.item_length:  # (chat: as many rounds as allowed)
            max_tokens = max(1, min(model.beam.max_rounds, model.max_model_len - longest))
        else:
            max_tokens = model.beam.default_rounds  # an item id's length
    if beam_width is not None and model.beam.item_length and max_tokens != model.beam.item_length:
        raise bad("max_tokens", f"Items of this server's table are {model.beam.item_length} tokens long: "
                                f"`max_tokens` must be {model.beam.item_length} with `beam_width` (or absent)")
    if beam_width is not None and max_tokens > model.beam.max_rounds:
        raise bad("max_tokens", f"A beam search runs at most {model.beam.max_rounds} rounds on this server "
                                f"(XLLM_MAX_BEAM_ROUNDS): `max_tokens` must be at most that with `beam_width`")
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
        controls=token_controls(fields, model, max_tokens),
    )
    stream = fields.bool("stream", False)
    options = Fields(fields.dict("stream_options"))
    if fields.raw("stream_options") is not None and not stream:  # (even {}: OpenAI refuses it too)
        raise bad("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
    user = fields.raw("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"`user` must be a string, got {shown(user)}")
    include_usage = stream and options.bool("include_usage", False)
    if options.bool("continuous_usage_stats", False):  # (vLLM's: usage in every chunk)
        raise bad("stream_options", "`stream_options.continuous_usage_stats` is not supported by this server")
    tokens_as_ids = fields.bool("return_tokens_as_token_ids", False)
    grammar = structured_output(fields)
    if beam_width is None:
        for name in ITEM_FILTERS:
            if fields.raw(name) is not None:
                raise bad(name, f"`{name}` applies to a beam search over the item table: give `beam_width` too")
        spec = GenerationSpec(prompts, params, fields.int("n", 1, 1, model.max_n), stream, include_usage, chat,
                              logprobs)
        spec.tokens_as_ids = tokens_as_ids
        spec.grammar = grammar
        return spec
    if grammar is not None:
        raise bad(grammar.param, f"A structured output (`{grammar.param}`) does not apply to a beam search "
                                 "(`beam_width`); leave one of them out")
    _check_beam_fields(fields, params)
    if vllm_beams is not None:
        num_return = beam_width  # n sequences of n beams, best first
    else:
        num_return = fields.int("num_return_sequences", 1, 1, min(beam_width, model.beam.max_num_return_sequences))
        if fields.int("n", 1, 1, model.max_n) != 1:
            raise bad("n", "`n` must be 1 with `beam_width`; ask for `num_return_sequences` instead")
    spec = GenerationSpec(prompts, params, 1, stream, include_usage, chat, logprobs, beam_width, num_return)
    spec.beams_stop_at_eos = vllm_beams is not None and vllm_beams.stops_at_eos
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


def _beam_width(fields: Fields, model: ModelInfo, vllm_beams) -> int | None:
    """The beams of this beam search (ours, `beam_width`, or vLLM's, `use_beam_search` with `n`);
    None for ordinary generation."""
    if vllm_beams is not None:
        width, name = vllm_beams.width, "use_beam_search"
    else:
        width, name = fields.int("beam_width", None, 1, model.beam.max_beam_width), "beam_width"
    if width is None:
        return None
    if fields.bool("stream", False):
        # Even one beam keeps to the item table and its rounds, and answers at the end: greedy
        # streaming instead would quietly ignore both.
        raise bad("stream", "A beam search returns its sequences at the end: `stream` must be false "
                            f"with `{name}`")
    if not model.beam.supported:
        raise bad(name, "Beam search runs on the fixed_steps scheduler; this server runs continuous "
                        "(set XLLM_SCHEDULER=fixed_steps)")
    return width


def _check_model(fields: Fields, model: ModelInfo) -> None:
    name = fields.raw("model")
    if name is not None and name != model.name:
        if not isinstance(name, str):
            raise bad("model", f"`model` must be a string, got {shown(name)}")
        raise ApiError(404, f"The model `{name}` does not exist.", param="model")


def _check_beam_fields(fields: Fields, params: SamplingParams) -> None:
    """A beam search ranks by the model's log-probabilities and runs all its rounds: fields that
    would change that get a 400 rather than be silently ignored."""
    if params.temperature not in (0.0, 1.0):
        raise bad("temperature", "A beam search ranks by the model's log-probabilities: `temperature` must be "
                                 "0 or 1 (or absent) in a beam search")
    for name, used in (("top_p", params.top_p < 1.0), ("top_k", params.top_k > 0), ("min_p", params.min_p > 0),
                       ("stop", bool(params.stop)), ("stop_token_ids", bool(params.stop_token_ids)),
                       ("logprobs", params.logprobs is not None)):
        if used:
            raise bad(name, f"`{name}` does not apply to a beam search; leave it out")
    controls = used_controls(params.controls)
    if controls:  # (a beam ranks by the model's log-probabilities, as temperature 1 does)
        raise bad(controls[0], f"`{controls[0]}` is not supported with a beam search (`beam_width`) on this "
                               "server; leave it out")
