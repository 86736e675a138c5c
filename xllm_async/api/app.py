"""Routes: HTTP requests in, engine calls, OpenAI responses out."""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote

import orjson

from .. import __version__
from ..engine.beam import BeamRequest
from ..engine.engine import CacheTooSmall, Engine, EngineFull, TooManySequences
from ..engine.output import OutputStream
from ..engine.request import EngineRequest
from ..errors import ApiError
from ..http.request import HttpRequest
from ..http.response import TEXT, Responder
from .access_log import AccessLog, AccessRecord
from .fields import shown
from .items import ItemFilter, ItemTable
from .requests import GenerationSpec, ModelInfo, holds_long_text, parse_chat, parse_completion, parse_json
from .responses import DONE, ChatShape, Choice, CompletionShape, new_id

log = logging.getLogger("xllm_async.api")

_REQUEST_ID = re.compile(r"^[\w.:@/+=-]{1,128}$")  # echoed into a header: nothing that could break it
_HEADER_LIST = re.compile(r"^[\w, -]{1,512}$")  # header names a preflight asks for, echoed likewise
CORS_ORIGIN = b"access-control-allow-origin: *\r\n"
# The routes anyone may call with XLLM_API_KEY set: a balancer's health check and a metrics scraper
# carry no key. Every other route needs it: they serve the model or tell about the deployment
# (/server_info names the model's and the item table's paths).
OPEN_ROUTES = frozenset(("/health", "/metrics"))
# How a sequence that ended without finishing is answered.
_FAILURES = {"error": 500, "timeout": 408, "shutdown": 503}


def failure(choices: list[Choice]) -> ApiError | None:
    for choice in choices:
        if choice.error is not None:
            return ApiError(_FAILURES.get(choice.finish_reason, 500), choice.error)
    return None


class OpenAIApp:
    """The request handler the HTTP layer calls: one coroutine per request."""

    def __init__(self, engine: Engine, model: ModelInfo, server_info: dict, access_log: str = "plain",
                 api_key: str | None = None, items: ItemTable | None = None) -> None:
        self.engine = engine
        # The item table; a reload (SIGHUP) replaces it whole. A request reads it once, when it
        # arrives, and keeps that table to its answer.
        self.items = items
        self.api_key = api_key.encode() if api_key else None
        self.draining = False  # shutting down: /health says 503 so that balancers stop sending
        self.metrics = engine.metrics
        self.model = model
        self.server_info = server_info
        self.access_log = AccessLog(access_log)
        self.started = time.time()
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="xllm-tokenize")
        self.routes = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.models},
            "/v1/models/{id}": {"GET": self.model_card},  # any path below /v1/models/
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.prometheus},
            "/server_info": {"GET": self.info},
            "/get_server_info": {"GET": self.info},  # the name SGLang's benchmark asks for
            "/version": {"GET": self.version},
        }
        for methods in self.routes.values():  # HEAD wherever GET (RFC 9110 §9.1); the HTTP layer drops the content
            if "GET" in methods:
                methods["HEAD"] = methods["GET"]

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        request_id = request.headers.get("x-request-id")
        if request_id is not None and _REQUEST_ID.match(request_id):
            responder.headers = f"x-request-id: {request_id}\r\n".encode()
        else:
            request_id = None
        responder.record = AccessRecord(request_id or new_id("req"))
        if "origin" in request.headers:  # a browser's page may read our answers, as vLLM's default allows
            responder.headers += CORS_ORIGIN
        try:
            methods = self.routes.get(request.path)
            if methods is None and request.path.startswith("/v1/models/"):
                methods = self.routes["/v1/models/{id}"]
            if methods is None:
                raise ApiError(404, f"Route {request.path} not found")
            handler = methods.get(request.method)
            if handler is None and request.method == "OPTIONS":
                self._preflight(request, responder, methods)
                return
            if handler is None:
                allowed = ", ".join(methods)
                raise ApiError(405, f"Method {request.method} not allowed on {request.path}; use {allowed}",
                               headers=f"allow: {allowed}\r\n".encode())
            if self.api_key is not None and request.path not in OPEN_ROUTES:
                self._authorize(request)
            await handler(request, responder)
        except ApiError as error:
            self._send_error(responder, error)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            self._send_error(responder, ApiError(500, "Internal server error"))

    def on_response(self, request: HttpRequest | None, responder: Responder) -> None:
        """Told by the HTTP layer after every response: count it, log it."""
        self.metrics.http.inc(1, str(responder.status))
        self.access_log.write(request, responder)

    def _authorize(self, request: HttpRequest) -> None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # compare_digest takes the same time wherever the first difference is.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
            raise ApiError(401, "Missing or invalid API key (Authorization: Bearer <key>)",
                           headers=b"www-authenticate: Bearer\r\n")

    @staticmethod
    def _send_error(responder: Responder, error: ApiError) -> None:
        if not responder.started:
            responder.send(error.status, error.body(), headers=error.headers)
        elif not responder.finished:  # mid-stream: an error event, then the end
            responder.end(ChatShape.error_event(error.as_dict()) + DONE)

    # --- routes ---

    async def health(self, request: HttpRequest, responder: Responder) -> None:
        if self.draining:
            responder.send(503, ApiError(503, "Shutting down").body())
        else:
            responder.send(200, b"")

    def _card(self) -> dict:
        return {"id": self.model.name, "object": "model", "created": int(self.started), "owned_by": "xllm_async",
                "root": self.server_info.get("model_path"), "max_model_len": self.model.max_model_len}

    async def models(self, request: HttpRequest, responder: Responder) -> None:
        responder.send(200, orjson.dumps({"object": "list", "data": [self._card()]}))

    async def model_card(self, request: HttpRequest, responder: Responder) -> None:
        name = unquote(request.path[len("/v1/models/"):])
        if name != self.model.name:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model")
        responder.send(200, orjson.dumps(self._card()))

    @staticmethod
    def _preflight(request: HttpRequest, responder: Responder, methods: dict) -> None:
        """A browser's CORS preflight: any origin, the route's methods, the headers it asks for."""
        asked = request.headers.get("access-control-request-headers", "")
        allowed = "authorization, content-type, x-request-id"
        if asked and _HEADER_LIST.match(asked):
            allowed = asked
        responder.send(200, b"", content_type=TEXT, headers=(
            f"access-control-allow-methods: {', '.join(methods)}\r\naccess-control-allow-headers: {allowed}\r\n"
            "access-control-max-age: 600\r\n").encode("latin-1"))

    async def prometheus(self, request: HttpRequest, responder: Responder) -> None:
        if not self.metrics.enabled:
            raise ApiError(404, "Metrics are turned off (XLLM_METRICS=off)")
        responder.send(200, self.metrics.render(), content_type=TEXT)

    async def info(self, request: HttpRequest, responder: Responder) -> None:
        table = self.items
        items = {} if table is None else {
            "item_table": table.path, "item_count": table.count, "item_tuples": table.trie.leaves,
            "item_table_version": table.version, "item_table_loaded_at": round(table.loaded_at, 3)}
        responder.send(200, orjson.dumps({**self.server_info, **items, "version": __version__,
                                          "uptime_seconds": round(time.time() - self.started, 3)}))

    async def version(self, request: HttpRequest, responder: Responder) -> None:
        responder.send(200, orjson.dumps({"version": __version__}))

    async def completions(self, request: HttpRequest, responder: Responder) -> None:
        spec = await self._parse(request, parse_completion, chat=False)
        await self._generate(request, spec, CompletionShape, "cmpl", responder)

    async def chat_completions(self, request: HttpRequest, responder: Responder) -> None:
        spec = await self._parse(request, parse_chat, chat=True)
        await self._generate(request, spec, ChatShape, "chatcmpl", responder)

    async def _parse(self, request: HttpRequest, parser, chat: bool) -> GenerationSpec:
        body = parse_json(request.body)
        if not holds_long_text(body, len(request.body), chat):
            return parser(body, self.model)  # microseconds: a thread hop would cost more
        # Long text is tokenized (and a chat template rendered) on a thread of its own while the
        # loop serves everyone else; one at a time, so that a flood of them cannot take every core.
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, parser, body, self.model)

    # --- generation ---

    async def _generate(self, request: HttpRequest, spec: GenerationSpec, shape_class, prefix: str,
                        responder: Responder) -> None:
        # While draining, a request that reached us is still served: a balancer may have sent it
        # in the moment before its health check saw the 503. Its connection closes after it.
        num = len(spec.prompts) * spec.n
        stream = OutputStream(num)
        items = narrowed = None
        if spec.beam_width is not None:
            items = self.items
            if items is not None:
                narrowed = self._narrow(items, spec)
            trie = None if items is None else items.trie
            leaves = None if narrowed is None else narrowed.leaves
            requests = [BeamRequest(i, prompt, spec.beam_width, spec.params.max_tokens, stream, trie, leaves)
                        for i, prompt in enumerate(spec.prompts)]
        else:
            requests = [EngineRequest(i, spec.prompts[i // spec.n], spec.params, stream) for i in range(num)]
            if spec.params.prompt_logprobs is not None and spec.n > 1:
                # A prompt is scored once: its first choice's scores serve its other choices.
                unscored = copy.copy(spec.params)
                unscored.prompt_logprobs = None
                for req in requests:
                    if req.index % spec.n:
                        req.params = unscored
        # As OpenAI and vLLM count it: each prompt once, however many choices share it.
        prompt_tokens = sum(len(p) for p in spec.prompts)
        shape = shape_class(self.model.name, self.model.tokenizer, prefix, prompt_tokens,
                            spec.top_logprobs is not None)
        record: AccessRecord = responder.record
        record.prompt_tokens = prompt_tokens
        try:
            self.engine.submit(requests)
        except TooManySequences as exc:
            raise ApiError(400, f"Request too large: {exc}", param="n" if spec.n > 1 else "prompt") from None
        except CacheTooSmall as exc:  # (only a beam search can: start-up fits the longest sequence)
            raise ApiError(400, f"Request too large: {exc}; ask for fewer beams or rounds",
                           param="beam_width" if spec.beam_width is not None else "prompt") from None
        except EngineFull as exc:
            raise ApiError(503, f"Server overloaded: {exc}; retry later", headers=b"retry-after: 1\r\n") from None
        choices = [Choice() for _ in range(num)]
        timer = _LatencyTimer(self.metrics, request.received, choices, requests, record)
        try:
            if spec.stream:
                await self._stream(stream, shape, choices, timer, spec.include_usage, responder)
            else:
                while stream.unfinished:
                    timer.arrived(await stream.next())
                error = failure(choices)
                if error is not None:
                    raise error
                if spec.beam_width is not None:
                    responder.send(200, shape.beam_response(self._chosen_beams(timer.beams, spec, items, narrowed),
                                                            items is not None))
                else:
                    if spec.scoring is not None:
                        shape.score(spec.scoring, requests, choices)
                    responder.send(200, shape.response(choices))
        finally:
            if stream.unfinished:  # the client went away (or we failed): stop spending compute
                self.engine.abort(requests)

    @staticmethod
    def _narrow(items: ItemTable, spec: GenerationSpec) -> ItemFilter | None:
        """The request's item filters against this table: unknown ids get 400 naming them, and
        so does a filter that leaves no item."""
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

    def _chosen_beams(self, beams: list, spec: GenerationSpec, items: ItemTable | None,
                      narrowed: ItemFilter | None) -> list[list[tuple]]:
        """Per prompt, its best num_return_sequences beams, each with the ids of the items it spells."""
        count = spec.num_return_sequences
        if items is None:
            chosen = [[(b, None) for b in found[:count]] for found in beams]
        else:
            chosen = [[(b, items.items_of(b.leaf, narrowed)) for b in found[:count]] for found in beams]
        for answer in chosen:
            self.metrics.beam_requests.inc()
            self.metrics.beams.observe(spec.beam_width)
            self.metrics.items.observe(len(answer))
        return chosen

    @staticmethod
    async def _stream(stream: OutputStream, shape, choices: list[Choice], timer: _LatencyTimer,
                      include_usage: bool, responder: Responder) -> None:
        responder.start_stream()
        first = [True] * len(choices)
        while stream.unfinished:
            events = []
            deltas = await stream.next()
            timer.arrived(deltas)
            for delta in deltas:
                if delta.error is not None:
                    error = ApiError(_FAILURES.get(delta.finish_reason, 500), delta.error)
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


class _LatencyTimer:
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
