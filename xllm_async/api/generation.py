"""One generation request, from its validated spec to its answer: engine requests built and
submitted, their deltas gathered into a whole response or streamed as server-sent events."""

from __future__ import annotations

import copy
import time

from ..engine.engine import CacheTooSmall, Engine, EngineFull, TooManySequences
from ..engine.output import OutputStream
from ..engine.request import BeamRequest, EngineRequest
from ..errors import ApiError
from ..http.request import HttpRequest
from ..http.response import Responder
from .access_log import AccessRecord
from .fields import shown
from .items import ItemFilter, ItemTable
from .model_info import ModelInfo
from .requests import GenerationSpec
from .responses import DONE, Choice, ResponseShape, token_id_text
from .structured import compiled_grammar
from .vllm_beams import ended_at_eos

# How a sequence that ended without finishing is answered.
FAILURES = {"error": 500, "timeout": 408, "shutdown": 503}


async def generate(engine: Engine, model: ModelInfo, items: ItemTable | None, request: HttpRequest,
                   spec: GenerationSpec, shape_class: type[ResponseShape], prefix: str, responder: Responder) -> None:
    """Run SPEC on the engine and answer it; `items` is the item table as the request found it
    (a reload replaces the table, not what a request already holds)."""
    # While draining, a request that reached us is still served: a balancer may have sent it
    # in the moment before its health check saw the 503. Its connection closes after it.
    num = len(spec.prompts) * spec.n
    stream = OutputStream(num)
    narrowed = None
    if spec.beam_width is not None:
        if items is not None:
            narrowed = narrow(items, spec)
        trie = None if items is None else items.trie
        leaves = None if narrowed is None else narrowed.leaves
        requests = [BeamRequest(i, prompt, spec.beam_width, spec.params.max_tokens, stream, trie, leaves)
                    for i, prompt in enumerate(spec.prompts)]
    else:
        # Compiled before anything is submitted: a grammar that fails answers 400 here, and one still
        # compiling holds no place in a batch.
        grammar = None if spec.grammar is None else await compiled_grammar(engine, spec.grammar)
        requests = [EngineRequest(i, spec.prompts[i // spec.n], spec.params, stream) for i in range(num)]
        for req in requests:
            req.grammar = grammar
        if spec.params.prompt_logprobs is not None and spec.n > 1:
            # A prompt is scored once: its first choice's scores serve its other choices.
            unscored = copy.copy(spec.params)
            unscored.prompt_logprobs = None
            for req in requests:
                if req.index % spec.n:
                    req.params = unscored
    # As OpenAI and vLLM count it: each prompt once, however many choices share it.
    prompt_tokens = sum(len(p) for p in spec.prompts)
    shape = shape_class(model.name, model.tokenizer, prefix, prompt_tokens, spec.top_logprobs is not None)
    if spec.tokens_as_ids:
        shape.token_text = token_id_text
    if engine.runner.caches_prefixes:
        shape.cached_from = [r for r in requests if r.index % spec.n == 0]  # (each prompt once, as prompt_tokens)
    record: AccessRecord = responder.record
    record.prompt_tokens = prompt_tokens
    try:
        engine.submit(requests)
    except TooManySequences as exc:
        raise ApiError(400, f"Request too large: {exc}", param="n" if spec.n > 1 else "prompt") from None
    except CacheTooSmall as exc:  # (only a beam search can: start-up fits the longest sequence)
        raise ApiError(400, f"Request too large: {exc}; ask for fewer beams or rounds",
                       param="beam_width" if spec.beam_width is not None else "prompt") from None
    except EngineFull as exc:
        raise ApiError(503, f"Server overloaded: {exc}; retry later", headers=b"retry-after: 1\r\n") from None
    choices = [Choice() for _ in range(num)]
    timer = LatencyTimer(engine.metrics, request.received, choices, requests, record)
    try:
        if spec.stream:
            await _stream(stream, shape, choices, timer, spec.include_usage, responder)
        else:
            while stream.unfinished:
                timer.arrived(await stream.next())
            error = failure(choices)
            if error is not None:
                raise error
            if spec.beam_width is not None:
                chosen = chosen_beams(engine.metrics, timer.beams, spec, items, narrowed)
                if spec.beams_stop_at_eos:
                    chosen = ended_at_eos(chosen, engine.runner.eos_token_ids, model.tokenizer)
                responder.send(200, shape.beam_response(chosen, items is not None))
            else:
                if spec.scoring is not None:
                    shape.score(spec.scoring, requests, choices)
                responder.send(200, shape.response(choices))
    finally:
        if stream.unfinished:  # the client went away (or we failed): stop spending compute
            engine.abort(requests)


def failure(choices: list[Choice]) -> ApiError | None:
    for choice in choices:
        if choice.error is not None:
            return ApiError(FAILURES.get(choice.finish_reason, 500), choice.error)
    return None


def narrow(items: ItemTable, spec: GenerationSpec) -> ItemFilter | None:
    """The request's item filters against this table: unknown ids get 400 naming them, and so
    does a filter that leaves no item."""
    if spec.params.max_tokens != items.item_length:  # the table was reloaded since the request was read
        raise ApiError(400, f"Items of this server's table are {items.item_length} tokens long: `max_tokens` "
                            f"must be {items.item_length} with `beam_width` (or absent)", param="max_tokens")
    if spec.allowed_items is None and spec.excluded_items is None:
        return None
    found = {}
    for name, ids in (("allowed_item_ids", spec.allowed_items), ("exclude_item_ids", spec.excluded_items)):
        if ids is None:
            continue
        numbers, missing = items.find(ids)
        if missing:
            listed = ", ".join(shown(m) for m in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise ApiError(400, f"`{name}` names {len(missing)} item(s) not in the item table: {listed}",
                           param=name)
        found[name] = numbers
    narrowed = items.narrow(found.get("allowed_item_ids"), found.get("exclude_item_ids"))
    if narrowed.leaves.count(items.trie.leaves) == 0:
        name = "allowed_item_ids" if spec.allowed_items is not None else "exclude_item_ids"
        raise ApiError(400, "The item filters leave no item to recommend", param=name)
    return narrowed


def chosen_beams(metrics, beams: list, spec: GenerationSpec, items: ItemTable | None,
                 narrowed: ItemFilter | None) -> list[list[tuple]]:
    """Per prompt, its best num_return_sequences beams, each with the ids of the items it spells."""
    count = spec.num_return_sequences
    if items is None:
        chosen = [[(b, None) for b in found[:count]] for found in beams]
    else:
        chosen = [[(b, items.items_of(b.leaf, narrowed)) for b in found[:count]] for found in beams]
    for answer in chosen:
        metrics.beam_requests.inc()
        metrics.beams.observe(spec.beam_width)
        metrics.items.observe(len(answer))
    return chosen


async def _stream(stream: OutputStream, shape: ResponseShape, choices: list[Choice], timer: LatencyTimer,
                  include_usage: bool, responder: Responder) -> None:
    responder.start_stream()
    first = [True] * len(choices)
    while stream.unfinished:
        events = []
        deltas = await stream.next()
        timer.arrived(deltas)
        for delta in deltas:
            if delta.error is not None:
                error = ApiError(FAILURES.get(delta.finish_reason, 500), delta.error)
                events.append(shape.error_event(error.as_dict()))
            elif delta.text or delta.finish_reason is not None or delta.logprobs is not None:
                events.append(shape.chunk(delta, first[delta.index]))
                first[delta.index] = False
        if stream.unfinished:
            responder.write(b"".join(events))
            await responder.drain()
        else:
            if include_usage:
                events.append(shape.usage_chunk(choices))
            events.append(DONE)
            responder.end(b"".join(events))  # the last token and [DONE] in one write


class LatencyTimer:
    """Adds arriving deltas to their choices; observes queue time, TTFT, inter-token
    and end-to-end latency; keeps the access record current (it is written the
    moment the response is)."""

    __slots__ = ("metrics", "received", "choices", "requests", "record", "last", "beams")

    def __init__(self, metrics, received: float, choices: list[Choice], requests: list[EngineRequest],
                 record: AccessRecord) -> None:
        self.metrics = metrics
        self.received = received
        self.choices = choices
        self.requests = requests
        self.record = record
        self.last = [0.0] * len(choices)
        self.beams: list[list] = [[] for _ in choices]  # a beam search's sequences, per prompt

    def arrived(self, deltas) -> None:
        now = time.monotonic()
        metrics = self.metrics
        record = self.record
        for delta in deltas:
            self.choices[delta.index].add(delta)
            if delta.token_id is not None:
                record.output_tokens += 1
            elif delta.beams is not None:
                self.beams[delta.index] = delta.beams
                record.output_tokens += sum(len(b.token_ids) for b in delta.beams)
            last = self.last[delta.index]
            if last:
                metrics.itl.observe(now - last)
            else:
                metrics.ttft.observe(now - self.received)
                if record.ttft is None:
                    record.ttft = now - self.received
                    req = self.requests[delta.index]
                    if req.started:
                        record.queue_time = req.started - req.arrival
                        metrics.queue.observe(record.queue_time)
            self.last[delta.index] = now
            if delta.finish_reason is not None:
                metrics.e2e.observe(now - self.received)
