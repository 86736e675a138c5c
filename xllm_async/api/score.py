"""POST /v1/score: candidates scored against one query (a user's history), SGLang's shapes.

Two answers:
- with `label_token_ids` (SGLang's /v1/score): per item, the labels' probabilities at the position
  after query + item (item + query with `item_first`), or their softmax over the labels alone
  with `apply_softmax`;
- without: per item, its tokens' summed log-probability given the query; `item_ids` names items
  of the item table, each scored as the constrained beam search scores it (normalised over the
  tokens the table allows at each depth).

The query is prefilled once and every item attends to that one copy (engine/score_request.py,
execution/score_batch.py); items beyond one prefill's token budget go in further requests of the
same query (_parts; the prefix cache, where on, serves their prefills).
"""

from __future__ import annotations

import math

import orjson

from ..engine.engine import CacheTooSmall, Engine, EngineFull, TooManySequences
from ..engine.output import OutputStream
from ..engine.score_request import ScoreRequest
from ..errors import ApiError
from ..http.response import Responder
from .fields import Fields, bad, is_int, shown
from .generation import FAILURES
from .items import ItemTable
from .model_info import ModelInfo
from .requests import _check_model
from .responses import new_id

MAX_ITEMS = 10_000
MAX_LABELS = 1024


class ScoreSpec:
    """One validated /v1/score request: its queries and their candidates, as token ids."""

    __slots__ = ("groups", "labels", "apply_softmax", "trie", "prompt_tokens")

    def __init__(self, groups: list[tuple[list[int], list[list[int]]]], labels: list[int] | None,
                 apply_softmax: bool, trie) -> None:
        self.groups = groups  # (prompt, its candidates' own tokens), the items in order across groups
        self.labels = labels
        self.apply_softmax = apply_softmax
        self.trie = trie  # set: the candidates are items of this table, normalised as the beam search does
        self.prompt_tokens = sum(len(p) + sum(len(c) for c in cands) for p, cands in groups)


def parse_score(body: dict, model: ModelInfo, items: ItemTable | None) -> ScoreSpec:
    fields = Fields(body)
    _check_model(fields, model)
    query = fields.raw("query")
    if isinstance(query, str):
        if not query:
            raise bad("query", "`query` must not be empty")
    elif not (isinstance(query, list) and query and all(is_int(t) for t in query)):
        raise bad("query", "`query` must be a non-empty string or a non-empty list of token ids")
    else:
        _check_ids(query, model, "query")
    labels = None
    if fields.raw("label_token_ids") is not None:
        labels = fields.raw("label_token_ids")
        if not (isinstance(labels, list) and 0 < len(labels) <= MAX_LABELS and all(is_int(t) for t in labels)):
            raise bad("label_token_ids", f"`label_token_ids` must be a list of 1 to {MAX_LABELS} token ids")
        _check_ids(labels, model, "label_token_ids")
    apply_softmax = fields.bool("apply_softmax", False)
    item_first = fields.bool("item_first", False)
    for name, value in (("apply_softmax", apply_softmax), ("item_first", item_first)):
        if value and labels is None:
            raise bad(name, f"`{name}` needs `label_token_ids` (without them each item's log-probability "
                            "given the query is its score)")
    if (fields.raw("items") is None) == (fields.raw("item_ids") is None):
        raise bad("items", "Send `items` (text or token ids) or `item_ids` (items of the item table), one of them")
    trie = None
    if fields.raw("item_ids") is not None:
        if item_first:
            raise bad("item_first", "`item_first` does not apply to `item_ids`")
        if isinstance(query, str):
            query = _encoded(model, query, "query")
        candidates = _table_items(fields.raw("item_ids"), items)
        trie = items.trie if labels is None else None
        sequences = None
    else:
        candidates, sequences = _items(fields.raw("items"), query, model, labels is not None, item_first)
        if isinstance(query, str):
            query = _encoded(model, query, "query")
    if sequences is None:
        groups = [(query, candidates)]
    elif item_first:
        groups = [(s, [[]]) for s in sequences]
    else:
        groups = _shared_prefix(sequences)
    longest = max(len(p) + max(len(c) for c in cands) for p, cands in groups)
    if longest > model.max_model_len:
        raise bad("items", f"query and item hold {longest} tokens, more than the model's "
                           f"{model.max_model_len}")
    return ScoreSpec(groups, labels, apply_softmax, trie)


def _check_ids(ids: list[int], model: ModelInfo, param: str) -> None:
    top = model.vocab_size - 1
    low, high = min(ids), max(ids)
    if low < 0 or high > top:
        raise bad(param, f"token id {low if low < 0 else high} is outside the vocabulary [0, {top}]")


def _encoded(model: ModelInfo, text: str, param: str, special: bool = True) -> list[int]:
    ids = model.encode(text, special)
    if not ids:
        raise bad(param, f"`{param}` is empty after tokenisation")
    return ids


def _items(raw, query, model: ModelInfo, labelled: bool, item_first: bool):
    """(candidates, None) where each item's tokens continue the query's; (None, whole sequences)
    where the sequences are tokenised whole (text with labels, as SGLang concatenates the texts) or
    the item comes first."""
    listed = [raw] if isinstance(raw, str) else raw
    if not (isinstance(listed, list) and 0 < len(listed) <= MAX_ITEMS):
        raise bad("items", f"`items` must be a string or a list of 1 to {MAX_ITEMS} strings or token-id lists")
    text = isinstance(query, str)
    if text:
        if not all(isinstance(i, str) and i for i in listed):
            raise bad("items", "With a text `query`, `items` must be non-empty strings")
        if labelled:
            return None, [_encoded(model, f"{i}{query}" if item_first else f"{query}{i}", "items")
                          for i in listed]
        return [_encoded(model, i, "items", special=False) for i in listed], None
    if not all(isinstance(i, list) and i and all(is_int(t) for t in i) for i in listed):
        raise bad("items", "With token ids as `query`, `items` must be non-empty lists of token ids")
    for item in listed:
        _check_ids(item, model, "items")
    if item_first:
        return None, [item + query for item in listed]
    return listed, None  # (with labels too: each item continues the query, its answer read after it)


def _table_items(raw, items: ItemTable | None) -> list[list[int]]:
    if items is None:
        raise bad("item_ids", "`item_ids` needs an item table (XLLM_ITEM_TABLE); send `items` as token ids")
    if not (isinstance(raw, list) and 0 < len(raw) <= MAX_ITEMS
            and all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in raw)):
        raise bad("item_ids", f"`item_ids` must be a list of 1 to {MAX_ITEMS} item ids")
    ids = [str(i) for i in raw]
    numbers, missing = items.find(ids)
    if missing:
        listed = ", ".join(shown(m) for m in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise bad("item_ids", f"`item_ids` names {len(missing)} item(s) not in the item table: {listed}")
    return items.tokens_of_items(numbers)


def _shared_prefix(sequences: list[list[int]]) -> list[tuple[list[int], list[list[int]]]]:
    """One prompt, the sequences' longest common prefix, and each sequence's rest; a prompt per
    sequence where they share no token."""
    # The prefix all share is the one the least and the greatest share (list order is lexicographic,
    # and min/max compare in C): one pair walked in Python, however many items.
    low, high = min(sequences), max(sequences)
    shared = 0
    while shared < len(low) and low[shared] == high[shared]:
        shared += 1
    first = sequences[0]
    if shared == 0:
        return [(s, [[]]) for s in sequences]
    return [(first[:shared], [s[shared:] for s in sequences])]


async def run_score(engine: Engine, model: ModelInfo, spec: ScoreSpec, responder: Responder) -> None:
    """Score the spec's candidates on the engine and answer."""
    stream = OutputStream(0)
    requests = []
    for prompt, candidates in spec.groups:
        for part in _parts(prompt, candidates, spec.labels is not None, engine.budget):
            requests.append(ScoreRequest(len(requests), prompt, part, stream, spec.labels, spec.trie))
    stream.unfinished = len(requests)
    responder.record.prompt_tokens = spec.prompt_tokens
    try:
        engine.submit(requests)
    except TooManySequences as exc:
        raise ApiError(400, f"Request too large: {exc}", param="items") from None
    except CacheTooSmall as exc:
        raise ApiError(400, f"Request too large: {exc}", param="query") from None
    except EngineFull as exc:
        raise ApiError(503, f"Server overloaded: {exc}; retry later", headers=b"retry-after: 1\r\n") from None
    try:
        while stream.unfinished:
            for delta in await stream.next():
                if delta.error is not None:
                    raise ApiError(FAILURES.get(delta.finish_reason, 500), delta.error)
    finally:
        if stream.unfinished:  # the client went away (or we failed): stop spending compute
            engine.abort(requests)
    results = [r for req in requests for r in req.results]
    if spec.labels is not None:
        results = [_probabilities(r, spec.apply_softmax) for r in results]
    tokens = spec.prompt_tokens
    responder.send(200, orjson.dumps({
        "id": new_id("score"), "object": "scoring", "model": model.name, "scores": results,
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}}))


def _parts(prompt: list[int], candidates: list[list[int]], labelled: bool, budget) -> list[list[list[int]]]:
    """The candidates in requests of one query each: as many as fit one prefill's token budget
    (the query once plus the tokens they feed, as admission counts them), and at least a batch's
    sequences each, so that a query longer than the budget still carries a batch of candidates.
    Most requests are one part: one prefill of the query, its candidates in its rounds."""
    parts, part, tokens = [], [], len(prompt)
    for candidate in candidates:
        fed = len(candidate) - (0 if labelled else 1)
        if part and tokens + fed > budget.max_tokens and len(part) >= budget.max_seqs:
            parts.append(part)
            part, tokens = [], len(prompt)
        part.append(candidate)
        tokens += fed
    parts.append(part)
    return parts


def _probabilities(logprobs: list[float], softmax: bool) -> list[float]:
    """SGLang's answer: the labels' probabilities, or their softmax over the labels alone."""
    if not softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)
    weights = [math.exp(x - top) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
