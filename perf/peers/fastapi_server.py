"""Peer server: the naive one many people write — FastAPI on uvicorn, one transformers model,
each request's `model.generate` run on a thread pool with `loop.run_in_executor`.

    perf/peers/.venv/bin/python perf/peers/fastapi_server.py --model perf/results/models/qwen3-tiny --port 8102

No batching: every request is its own generate call (a batch of one), and up to --threads of
them run at once on the shared model, their torch ops competing for the same cores (torch's
default intra-op threads; nothing is tuned).

Streaming: real. generate's streamer hook hands each new token from the pool thread to the
event loop (`call_soon_threadsafe` into an asyncio.Queue), and a StreamingResponse sends it as
an SSE event at once — the pattern of TextIteratorStreamer, per token instead of per word.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from completions import CausalLM, Completion, CompletionRequest, models_list, server_parser
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response, StreamingResponse


def build_app(lm: CausalLM, pool: ThreadPoolExecutor) -> FastAPI:
    app = FastAPI()
    models = models_list(lm.model_dir, lm.name, owned_by="fastapi")

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def list_models() -> dict:
        return models

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        completion = lm.completion(request)
        loop = asyncio.get_running_loop()
        if not request.stream:  # push returns the whole JSON body when the request is done
            pieces: list[str] = []
            await loop.run_in_executor(pool, lm.generate, [completion],
                                       lambda step: pieces.append(completion.push(step[0])))
            return Response("".join(pieces) + completion.close(), media_type="application/json")
        tokens: asyncio.Queue = asyncio.Queue()
        generating = loop.run_in_executor(
            pool, lm.generate, [completion], lambda step: loop.call_soon_threadsafe(tokens.put_nowait, step[0]))
        # the future's end is handed to the loop the same way, after the last token
        generating.add_done_callback(lambda _: tokens.put_nowait(None))
        return StreamingResponse(sse_events(completion, tokens, generating), media_type="text/event-stream")

    return app


async def sse_events(completion: Completion, tokens: asyncio.Queue, generating: asyncio.Future):
    while (token := await tokens.get()) is not None:
        if piece := completion.push(token):
            yield piece
    await generating  # a failed generate raises here: the stream ends without [DONE]
    if tail := completion.close():
        yield tail


def main() -> None:
    parser = server_parser(__doc__, port=8102)
    parser.add_argument("--threads", type=int, default=None,
                        help="generate calls at once (default: ThreadPoolExecutor's, min(32, cores + 4))")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()

    lm = CausalLM(args.model, args.served_model_name)
    pool = ThreadPoolExecutor(max_workers=args.threads, thread_name_prefix="generate")
    uvicorn.run(build_app(lm, pool), host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
