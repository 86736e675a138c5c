"""The token controls of a request body, validated: OpenAI's logit_bias, presence_penalty and
frequency_penalty, vLLM's allowed_token_ids, bad_words, min_tokens and repetition_penalty. A value
out of range or a token id outside the vocabulary gets a 400 naming its field."""

from __future__ import annotations

import math

from ..engine.params import TokenControls
from .fields import Fields, bad, shown
from .model_info import ModelInfo

MAX_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0  # presence and frequency penalties: [-2, 2], as OpenAI and vLLM
MAX_BAD_WORDS = 128  # vLLM's limit of bad words a request
MAX_BAD_WORD_CHARS = 1000
FIELDS = ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "presence_penalty", "frequency_penalty",
          "repetition_penalty")
_FIELD_SET = frozenset(FIELDS)


def token_controls(fields: Fields, model: ModelInfo, max_tokens: int) -> TokenControls | None:
    """The request's controls, or None where none of them changes anything (the sampler's plain path)."""
    if _FIELD_SET.isdisjoint(fields.body):  # (nearly every request: none of them sent)
        return None
    controls = TokenControls(
        logit_bias=_logit_bias(fields, model),
        allowed=_allowed(fields, model),
        bad_words=_bad_words(fields, model),
        min_tokens=fields.int("min_tokens", 0, 0, max_tokens),
        presence_penalty=fields.float("presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=fields.float("frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=_repetition_penalty(fields),
    )
    return controls if controls.active else None


def used_controls(controls: TokenControls | None) -> list[str]:
    """The fields a request set to something other than neutral (for the refusals of a beam search)."""
    if controls is None:
        return []
    used = {"logit_bias": bool(controls.logit_bias), "allowed_token_ids": controls.allowed is not None,
            "bad_words": bool(controls.bad_words), "min_tokens": controls.min_tokens > 0,
            "presence_penalty": controls.presence_penalty != 0, "frequency_penalty": controls.frequency_penalty != 0,
            "repetition_penalty": controls.repetition_penalty != 1.0}
    return [name for name in FIELDS if used[name]]


def _logit_bias(fields: Fields, model: ModelInfo) -> dict[int, float]:
    """OpenAI's map of token id (as a JSON object's key, a string: "42") to a bias in [-100, 100]."""
    value = fields.dict("logit_bias")
    if len(value) > model.vocab_size:
        raise bad("logit_bias", f"`logit_bias` names {len(value)} tokens; the vocabulary has {model.vocab_size}")
    top = model.vocab_size - 1
    bias: dict[int, float] = {}
    for key, amount in value.items():
        token = _token_key(key)
        if token is None or not 0 <= token <= top:
            raise bad("logit_bias", f"`logit_bias` keys must be token ids in [0, {top}], got {shown(key)}")
        if (isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount)
                or not -MAX_BIAS <= amount <= MAX_BIAS):
            raise bad("logit_bias", f"`logit_bias` values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                    f"got {shown(amount)} for token {token}")
        if amount:
            bias[token] = float(amount)
    return bias


def _token_key(key: str) -> int | None:
    return int(key) if key.isascii() and key.isdigit() and len(key) < 20 else None


def _allowed(fields: Fields, model: ModelInfo) -> tuple[int, ...] | None:
    value = fields.raw("allowed_token_ids")
    if value is None:
        return None
    top = model.vocab_size - 1
    if not isinstance(value, list) or not value:
        raise bad("allowed_token_ids", "`allowed_token_ids` must be a non-empty list of token ids")
    ids = fields.int_list("allowed_token_ids", 0, top)
    return tuple(ids)


def _bad_words(fields: Fields, model: ModelInfo) -> tuple[tuple[int, ...], ...]:
    """Each bad word as vLLM tokenizes it: as written (leading spaces stripped), and with one space
    before it where that is another first token of the same length (the word inside a text)."""
    value = fields.raw("bad_words")
    if value is None:
        return ()
    if (not isinstance(value, list) or len(value) > MAX_BAD_WORDS
            or not all(isinstance(w, str) and len(w) <= MAX_BAD_WORD_CHARS for w in value)):
        raise bad("bad_words", f"`bad_words` must be a list of at most {MAX_BAD_WORDS} strings of at most "
                               f"{MAX_BAD_WORD_CHARS} characters")
    words: list[tuple[int, ...]] = []
    for word in value:
        plain = tuple(model.encode(word.lstrip(), False))
        if not plain:
            continue
        words.append(plain)
        spaced = tuple(model.encode(" " + word.lstrip(), False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            words.append(spaced)
    return tuple(dict.fromkeys(words))


def _repetition_penalty(fields: Fields) -> float:
    value = fields.raw("repetition_penalty")
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise bad("repetition_penalty", f"`repetition_penalty` must be a finite number > 0, got {shown(value)}")
    return float(value)
