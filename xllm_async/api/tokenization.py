"""The tokenizer routes, shaped as vLLM's: /tokenize (a prompt or a chat's messages -> token ids,
through the very path a completion's or a chat's prompt takes, so that `count` is its
prompt_tokens), /detokenize (token ids -> text) and /tokenizer_info (the tokenizer's settings and
chat template, what lm-eval's remote tokenizer reads)."""

from __future__ import annotations

from .fields import Fields, bad, is_int, shown
from .model_info import ModelInfo
from .prompts import chat_text, completion_prompts
from .requests import _check_model as check_model

# Fields of vLLM's chat /tokenize this server does not implement, with the value that changes
# nothing (the chat route does not implement them either: a count with them would not be its count).
_CHAT_UNSUPPORTED = {"continue_final_message": False, "chat_template": None, "tools": [],
                     "mm_processor_kwargs": {}}
_CHAT_ONLY = ("add_generation_prompt", "chat_template_kwargs", *_CHAT_UNSUPPORTED)
_SHOWN_IDS = 10  # unknown token ids named in a 400, at most


def tokenize(body: dict, model: ModelInfo) -> dict:
    """A /tokenize body -> {"tokens", "count", "max_model_len"} (and "token_strs" when asked)."""
    fields = Fields(body)
    check_model(fields, model)
    prompt, messages = fields.raw("prompt"), fields.raw("messages")
    if (prompt is None) == (messages is None):
        raise bad("prompt", "Give either `prompt` (text or token ids) or `messages` (a chat), not "
                            + ("both" if prompt is not None else "neither"))
    if messages is not None:
        for name, neutral in _CHAT_UNSUPPORTED.items():
            value = fields.raw(name)
            if value is not None and not (type(value) is type(neutral) and value == neutral):
                raise bad(name, f"`{name}` is not supported by this server (nor by its chat completions)")
        text = chat_text(messages, model, fields.bool("add_generation_prompt", True),
                         fields.dict("chat_template_kwargs"))
        # As vLLM: the template writes the special tokens it wants, so none are added by default.
        tokens = model.encode(text, fields.bool("add_special_tokens", False))
    else:
        for name in _CHAT_ONLY:
            if fields.raw(name) is not None:
                raise bad(name, f"`{name}` applies to `messages`, not to `prompt`")
        special = fields.bool("add_special_tokens", True)  # as a completion's prompt is encoded
        if isinstance(prompt, str):
            tokens = model.encode(prompt, special)
        elif isinstance(prompt, list) and prompt and all(map(is_int, prompt)):
            tokens = completion_prompts(prompt, model)[0]  # checked against the vocabulary, as a completion's
        else:
            raise bad("prompt", f"`prompt` must be a string or a non-empty list of token ids, got {shown(prompt)}")
    answer = {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}
    if fields.bool("return_token_strs", False):
        answer["token_strs"] = model.tokenizer.convert_ids_to_tokens(tokens)
    return answer


def detokenize(body: dict, model: ModelInfo) -> dict:
    """A /detokenize body -> {"prompt": text}; ids the tokenizer does not know get a 400 naming them."""
    fields = Fields(body)
    check_model(fields, model)
    tokens = fields.raw("tokens")
    if tokens is None:
        raise bad("tokens", "Missing required parameter: 'tokens'.")
    if not isinstance(tokens, list) or not all(map(is_int, tokens)):
        raise bad("tokens", f"`tokens` must be a list of integer token ids, got {shown(tokens)}")
    unknown = unknown_ids(tokens, model.tokenizer)
    if unknown:
        named = ", ".join(map(str, unknown[:_SHOWN_IDS])) + (" ..." if len(unknown) > _SHOWN_IDS else "")
        raise bad("tokens", f"`tokens` holds {len(unknown)} id(s) this model's tokenizer does not know: {named} "
                            f"(its vocabulary is [0, {len(model.tokenizer) - 1}])")
    # Special tokens are kept, as vLLM's /detokenize keeps them.
    return {"prompt": model.tokenizer.decode(tokens)}


def unknown_ids(tokens: list[int], tokenizer) -> list[int]:
    """The ids of `tokens` (in order, once each) that name no token of this tokenizer."""
    size = len(tokenizer)  # ids below it are its vocabulary and added tokens, as transformers counts them
    if not tokens or (min(tokens) >= 0 and max(tokens) < size):
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    unknown = {}
    for token in tokens:
        if token < 0 or (token >= size and (backend is None or token >= 2**32 or backend.id_to_token(token) is None)):
            unknown[token] = None
    return list(unknown)


def tokenizer_info(model: ModelInfo) -> dict:
    """What vLLM's /tokenizer_info answers: the tokenizer's settings (less its files' paths), its
    class and chat template; with the special tokens and lengths always present, since lm-eval's
    remote tokenizer reads eos_token, bos_token, pad_token and chat_template from it."""
    tokenizer = model.tokenizer
    settings = {name: value for name, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                if name not in ("vocab_file", "merges_file", "tokenizer_file")}
    info = _plain(settings)
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[name] = _plain(getattr(tokenizer, name, None))
    info["model_max_length"] = _plain(getattr(tokenizer, "model_max_length", None))
    info["max_model_len"] = model.max_model_len  # what this server accepts, prompt and completion together
    info["vocab_size"] = len(tokenizer) if hasattr(tokenizer, "__len__") else model.vocab_size  # with added tokens
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    return info


def _plain(value):
    """A tokenizer setting as JSON can carry it: an AddedToken as its text, maps with text keys."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not -2**63 <= value < 2**64:
        # transformers' "no limit" model_max_length is 10**30: JSON's number, not a 64-bit integer.
        return float(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
