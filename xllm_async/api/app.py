"""Routes: HTTP requests in, engine calls, OpenAI responses out."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from ..engine.engine import Engine, EngineFull
from ..engine.output import OutputStream
from ..engine.request import EngineRequest
from ..errors import ApiError
from ..http.protocol import HttpRequest
from ..http.response import Responder
from .requests import GenerationSpec, ModelInfo, parse_chat, parse_completion, parse_json
from .responses import DONE, ChatShape, Choice, CompletionShape

log = logging.getLogger("xllm_async.api")


class OpenAIApp:
    """The request handler the HTTP layer calls: one coroutine per request."""

    def __init__(self, engine: Engine, model: ModelInfo, model_root: str) -> None:
        self.engine = engine
        self.model = model
        self.model_root = model_root
        self.created = int(time.time())
        self.routes = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.models},
            "/health": {"GET": self.health},
        }

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        try:
            methods = self.routes.get(request.path)
            if methods is None:
                raise ApiError(404, f"Route {request.path} not found")
            handler = methods.get(request.method)
            if handler is None:
                allowed = ", ".join(methods)
                raise ApiError(405, f"Method {request.method} not allowed on {request.path}; use {allowed}",
                               headers=f"allow: {allowed}\r\n".encode())
            await handler(request, responder)
        except ApiError as error:
            self._send_error(responder, error)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            self._send_error(responder, ApiError(500, "Internal server error"))

    @staticmethod
    def _send_error(responder: Responder, error: ApiError) -> None:
        if not responder.started:
            responder.send(error.status, error.body(), headers=error.headers)
        elif not responder.finished:  # mid-stream: an error event, then the end
            responder.end(ChatShape.error_event(error.as_dict()) + DONE)

    # --- routes ---

    async def health(self, request: HttpRequest, responder: Responder) -> None:
        responder.send(200, b"")

    async def models(self, request: HttpRequest, responder: Responder) -> None:
        responder.send(200, orjson.dumps({"object": "list", "data": [{
            "id": self.model.name, "object": "model", "created": self.created, "owned_by": "xllm_async",
            "root": self.model_root, "max_model_len": self.model.max_model_len,
        }]}))

    async def completions(self, request: HttpRequest, responder: Responder) -> None:
        spec = parse_completion(parse_json(request.body), self.model)
        await self._generate(spec, CompletionShape, "cmpl", responder)

    async def chat_completions(self, request: HttpRequest, responder: Responder) -> None:
        spec = parse_chat(parse_json(request.body), self.model)
        await self._generate(spec, ChatShape, "chatcmpl", responder)

    # --- generation ---

    async def _generate(self, spec: GenerationSpec, shape_class, prefix: str, responder: Responder) -> None:
        num = len(spec.prompts) * spec.n
        stream = OutputStream(num)
        requests = [EngineRequest(i, spec.prompts[i // spec.n], spec.params, stream) for i in range(num)]
        shape = shape_class(self.model.name, self.model.tokenizer, prefix,
                            sum(len(p) for p in spec.prompts) * spec.n, spec.top_logprobs is not None)
        try:
            self.engine.submit(requests)
        except EngineFull as exc:
            raise ApiError(503, f"Server overloaded: {exc}; retry later", headers=b"retry-after: 1\r\n") from None
        choices = [Choice() for _ in range(num)]
        try:
            if spec.stream:
                await self._stream(stream, shape, choices, spec.include_usage, responder)
            else:
                while stream.unfinished:
                    for delta in await stream.next():
                        choices[delta.index].add(delta)
                failed = [c.error for c in choices if c.error]
                if failed:
                    raise ApiError(500, f"Generation failed: {failed[0]}")
                responder.send(200, shape.response(choices))
        finally:
            if stream.unfinished:  # the client went away (or we failed): stop spending compute
                self.engine.abort(requests)

    @staticmethod
    async def _stream(stream: OutputStream, shape, choices: list[Choice], include_usage: bool,
                      responder: Responder) -> None:
        responder.start_stream()
        first = [True] * len(choices)
        while stream.unfinished:
            events = []
            for delta in await stream.next():
                choices[delta.index].add(delta)
                if delta.error is not None:
                    events.append(shape.error_event(ApiError(500, f"Generation failed: {delta.error}").as_dict()))
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
