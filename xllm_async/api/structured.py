"""Structured outputs as clients ask for them: OpenAI's `response_format`, vLLM's
`structured_outputs` object and its older `guided_*` fields, read into one GrammarSpec; and that
spec compiled before the request is submitted (Engine.compile_grammar, off the loop), a grammar the
library cannot compile answered with a 400 naming the field."""

from __future__ import annotations

import asyncio

import orjson

from ..execution.grammar import GrammarError
from .fields import Fields, bad, shown

# The longest schema, regex or grammar a request may bring, in characters: compiling is bounded
# by what the library does with it, and this bounds that.
MAX_GRAMMAR_CHARS = 65_536
# A grammar still compiling after this long gets its 400; its thread finishes (the library cannot be
# interrupted) and the result is cached, so a retry of the same spec is answered at once.
COMPILE_SECONDS = 30.0
MAX_CHOICES = 1024

# vLLM's structured_outputs keys, and the older top-level fields, -> our kind of grammar.
STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_FIELDS = frozenset(("response_format", "structured_outputs", *GUIDED_FIELDS))
KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
              "choice": "choice list", "grammar": "grammar"}


class GrammarSpec:
    """What one request constrains its answers to: a kind (execution/grammar.py's), the text the
    library compiles (also the cache's key) and the field it came from (named in errors)."""

    __slots__ = ("kind", "text", "param")

    def __init__(self, kind: str, text: str, param: str) -> None:
        self.kind = kind
        self.text = text
        self.param = param


def structured_output(fields: Fields) -> GrammarSpec | None:
    """The request's one structured output, or None; two at once get 400."""
    if _FIELDS.isdisjoint(fields.body):  # (nearly every request: none of them sent)
        return None
    found = [spec for spec in (_response_format(fields), _structured_outputs(fields)) if spec is not None]
    for name, kind in GUIDED_FIELDS.items():
        value = fields.raw(name)
        if value is not None:
            found.append(_spec(kind, value, name))
    if len(found) > 1:
        raise bad(found[1].param, f"One structured output per request: `{found[0].param}` and "
                                  f"`{found[1].param}` were both given")
    return found[0] if found else None


def _response_format(fields: Fields) -> GrammarSpec | None:
    form = Fields(fields.dict("response_format"))
    kind = form.raw("type")
    if kind is None and not form.body:
        return None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind != "json_schema":
        raise bad("response_format", "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\", "
                                     f"got {shown(kind)}")
    schema = Fields(form.dict("json_schema"))
    if form.raw("json_schema") is None:
        raise bad("response_format", "`response_format.json_schema` is required with type \"json_schema\"")
    for name, types in (("name", str), ("description", str), ("strict", bool)):
        value = schema.raw(name)
        if value is not None and not isinstance(value, types):
            raise bad("response_format", f"`response_format.json_schema.{name}` must be a "
                                         f"{'string' if types is str else 'boolean'}, got {shown(value)}")
    if schema.raw("schema") is None:  # (OpenAI's schema is optional: then any JSON object)
        return GrammarSpec("json_object", "", "response_format")
    return _spec("json", schema.raw("schema"), "response_format")


def _structured_outputs(fields: Fields) -> GrammarSpec | None:
    if fields.raw("structured_outputs") is None:
        return None
    given = {k: v for k, v in fields.dict("structured_outputs").items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_KEYS))
    if unknown:
        raise bad("structured_outputs", f"`structured_outputs.{unknown[0]}` is not supported by this server "
                                        f"(it takes one of: {', '.join(STRUCTURED_KEYS)})")
    if len(given) != 1:
        raise bad("structured_outputs", "`structured_outputs` must give exactly one of: "
                                        + ", ".join(STRUCTURED_KEYS))
    (key, value), = given.items()
    if key == "json_object":
        if value is not True:
            raise bad("structured_outputs", f"`structured_outputs.json_object` must be true, got {shown(value)}")
        return GrammarSpec("json_object", "", "structured_outputs")
    return _spec(STRUCTURED_KEYS[key], value, "structured_outputs")


def _spec(kind: str, value, param: str) -> GrammarSpec:
    """A checked spec of one kind from its field's value: a schema as an object or its JSON text,
    a regex or a grammar as a string, choices as a list of strings."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise bad(param, f"The JSON schema in `{param}` is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise bad(param, f"The JSON schema in `{param}` must be an object, got {shown(value)}")
        text = orjson.dumps(value).decode()  # (its keys in the order sent: properties come out in it)
    elif kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise bad(param, f"The choices in `{param}` must be a list of 1 to {MAX_CHOICES} non-empty strings")
        text = orjson.dumps(value).decode()
    else:
        if not isinstance(value, str) or not value:
            raise bad(param, f"The {KIND_NAMES[kind]} in `{param}` must be a non-empty string, got {shown(value)}")
        text = value
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad(param, f"The {KIND_NAMES[kind]} in `{param}` is {len(text)} characters long; "
                         f"this server compiles at most {MAX_GRAMMAR_CHARS}")
    return GrammarSpec(kind, text, param)


async def compiled_grammar(engine, spec: GrammarSpec):
    """The spec compiled on the engine's compile threads (the loop serves everyone meanwhile)."""
    try:
        return await asyncio.wait_for(engine.compile_grammar(spec.kind, spec.text), COMPILE_SECONDS)
    except GrammarError as exc:
        raise bad(spec.param, f"The {KIND_NAMES[spec.kind]} in `{spec.param}` cannot be compiled: {exc}") from None
    except asyncio.TimeoutError:  # (an alias of TimeoutError from Python 3.11)
        raise bad(spec.param, f"The {KIND_NAMES[spec.kind]} in `{spec.param}` did not compile within "
                              f"{COMPILE_SECONDS:g} s; simplify it") from None
