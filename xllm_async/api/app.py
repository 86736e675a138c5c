"""Routes: each request to its handler, with what every route shares (the API key, CORS, the
request id, errors rendered in one place), and the routes that tell about the server. Generation
itself is generation.py's."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote

import orjson

from .. import __version__
from ..engine.engine import Engine
from ..errors import ApiError
from ..http.request import HttpRequest
from ..http.response import TEXT, Responder
from . import tokenization
from .access_log import AccessLog, AccessRecord
from .generation import generate
from .items import ItemTable
from .model_info import LONG_TEXT, ModelInfo
from .requests import GenerationSpec, holds_long_text, parse_chat, parse_completion, parse_json
from .responses import DONE, ChatShape, CompletionShape, new_id
from .score import parse_score, run_score

log = logging.getLogger("xllm_async.api")

_REQUEST_ID = re.compile(r"^[\w.:@/+=-]{1,128}$")  # echoed into a header: nothing that could break it
_HEADER_LIST = re.compile(r"^[\w, -]{1,512}$")  # header names a preflight asks for, echoed likewise
CORS_ORIGIN = b"access-control-allow-origin: *\r\n"
# The routes anyone may call with XLLM_API_KEY set: a balancer's health check and a metrics scraper
# carry no key. Every other route needs it: they serve the model or tell about the deployment
# (/server_info names the model's and the item table's paths).
OPEN_ROUTES = frozenset(("/health", "/metrics"))


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
        self._tokenizer_info = orjson.dumps(tokenization.tokenizer_info(model))  # the tokenizer never changes
        self.routes = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/score": {"POST": self.score},
            "/v1/models": {"GET": self.models},
            "/v1/models/{id}": {"GET": self.model_card},  # any path below /v1/models/
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.prometheus},
            "/server_info": {"GET": self.info},
            "/get_server_info": {"GET": self.info},  # the name SGLang's benchmark asks for
            "/version": {"GET": self.version},
            # vLLM's tokenizer routes; SGLang serves /tokenize and /detokenize under /v1/ too.
            "/tokenize": {"POST": self.tokenize},
            "/v1/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize},
            "/v1/detokenize": {"POST": self.detokenize},
            "/tokenizer_info": {"GET": self.tokenizer_info},
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
        await generate(self.engine, self.model, self.items, request, spec, CompletionShape, "cmpl", responder)

    async def chat_completions(self, request: HttpRequest, responder: Responder) -> None:
        spec = await self._parse(request, parse_chat, chat=True)
        await generate(self.engine, self.model, self.items, request, spec, ChatShape, "chatcmpl", responder)

    async def tokenize(self, request: HttpRequest, responder: Responder) -> None:
        body = parse_json(request.body)
        long = holds_long_text(body, len(request.body), body.get("messages") is not None)
        responder.send(200, orjson.dumps(await self._tokenizing(long, tokenization.tokenize, body)))

    async def detokenize(self, request: HttpRequest, responder: Responder) -> None:
        body = parse_json(request.body)
        long = len(request.body) >= LONG_TEXT  # thousands of ids: their text is decoded off the loop too
        responder.send(200, orjson.dumps(await self._tokenizing(long, tokenization.detokenize, body)))

    async def tokenizer_info(self, request: HttpRequest, responder: Responder) -> None:
        responder.send(200, self._tokenizer_info)

    async def score(self, request: HttpRequest, responder: Responder) -> None:
        if not self.model.beam.supported:
            raise ApiError(400, "Scoring runs on the fixed_steps scheduler; this server runs continuous "
                                "(XLLM_SCHEDULER)", param="items")
        body = parse_json(request.body)
        items = self.items  # (the table as the request found it: a reload does not change its answer)
        if len(request.body) < LONG_TEXT:
            spec = parse_score(body, self.model, items)
        else:  # long text is tokenized off the loop, as the generation routes do (_parse)
            spec = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, parse_score, body,
                                                                    self.model, items)
        await run_score(self.engine, self.model, spec, responder)

    async def _parse(self, request: HttpRequest, parser, chat: bool) -> GenerationSpec:
        body = parse_json(request.body)
        if not holds_long_text(body, len(request.body), chat):  # (as _tokenizing, without its coroutine)
            return parser(body, self.model)
        return await self._tokenizing(True, parser, body)

    async def _tokenizing(self, long: bool, work, body: dict):
        """work(body, model): on the loop where it takes microseconds (a thread hop would cost
        more); for long text on a thread of its own, while the loop serves everyone else (one at a
        time, so that a flood of them cannot take every core)."""
        if not long:
            return work(body, self.model)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, work, body, self.model)
