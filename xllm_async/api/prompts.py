"""Prompts to token ids: a completion's prompt (text or ids, one or many), a chat's messages
checked as OpenAI checks them and rendered by the model's chat template."""

from __future__ import annotations

import functools
import inspect

import orjson

from ..errors import ApiError
from .fields import bad, shown
from .model_info import ModelInfo

MAX_PROMPTS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's, less the deprecated "function"


def completion_prompts(prompt, model: ModelInfo) -> list[list[int]]:
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
    # set(map(type, ...)) runs in C, so a long prompt is checked cheaply (and bools are refused).
    return set(map(type, values)) == {int}


def _checked_ids(ids: list[int], model: ModelInfo) -> list[int]:
    top = model.vocab_size - 1
    low, high = min(ids), max(ids)
    if low < 0 or high > top:
        raise bad("prompt", f"token id {low if low < 0 else high} is outside the vocabulary [0, {top}]")
    return ids


def chat_prompt(messages, model: ModelInfo, add_generation_prompt: bool, template_kwargs: dict) -> list[int]:
    # The template already wrote the special tokens it wants.
    return _encoded(model, chat_text(messages, model, add_generation_prompt, template_kwargs), "messages",
                    special=False)


def chat_text(messages, model: ModelInfo, add_generation_prompt: bool, template_kwargs: dict) -> str:
    """A chat's messages, checked, rendered by the model's chat template (also /tokenize's path,
    so that its count is the chat's prompt_tokens)."""
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
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **template_kwargs)
    except Exception as exc:  # a template may raise on roles or orders it does not accept
        raise bad("messages", f"The chat template rejected these messages: {exc}") from None


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
