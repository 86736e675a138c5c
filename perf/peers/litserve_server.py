"""Peer server: LitServe with its dynamic batching, serving OpenAI `/v1/completions`.

    perf/peers/.venv/bin/python perf/peers/litserve_server.py --model perf/results/models/qwen3-tiny --port 8101

LitServe's OpenAISpec serves only /v1/chat/completions, so the completions route is a plain
LitAPI at api_path="/v1/completions" whose request body is validated by FastAPI (pydantic).
LitServe collects up to --max-batch-size requests, waiting at most --batch-timeout seconds,
and hands them to one inference worker process, which runs the batch to completion before it
takes the next (LitServe's BatchedStreamingLoop).

Streaming: real. The LitAPI is a streaming one (stream=True), so `predict` yields each decoding
step's token for every row as `model.generate` makes it (generate runs in a helper thread and
hands the steps over through a queue). Requests with `"stream": false` are served by the same
loop: their `encode_response` yields nothing until the row is done, then the whole JSON body.
LitServe sends every response of a streaming API as a chunked body without a content type; the
benchmark client does not mind. `/health` is LitServe's own; `/v1/models` is added to its app.
"""

import os
import queue
import signal
import threading
from collections.abc import Iterator

import litserve as ls
from completions import CausalLM, Completion, CompletionRequest, models_list, server_parser


class CompletionsAPI(ls.LitAPI):
    """Batched greedy completions; one Completion per request carries its state from decode to encode."""

    def __init__(self, model_dir: str, name: str | None, **kwargs) -> None:
        super().__init__(api_path="/v1/completions", stream=True, **kwargs)
        self.model_dir = model_dir
        self.name = name

    def setup(self, device: str) -> None:
        self.lm = CausalLM(self.model_dir, self.name)

    # The annotation is read at run time: LitServe makes it the route's request body (validated by FastAPI),
    # which is why this file has no `from __future__ import annotations`.
    def decode_request(self, request: CompletionRequest, context: dict) -> Completion:
        context["completion"] = self.lm.completion(request)
        return context["completion"]

    def batch(self, inputs: list[Completion]) -> list[Completion]:
        return inputs

    def predict(self, rows: list[Completion]) -> Iterator[list[int]]:
        steps: queue.SimpleQueue = queue.SimpleQueue()

        def run() -> None:
            try:
                self.lm.generate(rows, steps.put)
                steps.put(None)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the loop's thread below)
                steps.put(exc)

        threading.Thread(target=run, name="generate", daemon=True).start()
        while (step := steps.get()) is not None:
            if isinstance(step, BaseException):
                raise step
            yield step

    def unbatch(self, output: Iterator[list[int]]) -> Iterator[list[int]]:
        yield from output  # each step is already one token per request

    # No annotation on the return: LitServe would make it the route's FastAPI response model.
    def encode_response(self, output: Iterator[list[int]], context: list[dict]):
        completions = [ctx["completion"] for ctx in context]
        for tokens in output:
            yield [completion.push(token) for completion, token in zip(completions, tokens)]
        yield [completion.close() for completion in completions]  # '' for those already closed


def main() -> None:
    parser = server_parser(__doc__, port=8101)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-timeout", type=float, default=0.005, help="seconds to wait for a batch to fill")
    parser.add_argument("--fast-queue", action="store_true", help="LitServe's ZeroMQ response transport")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()

    api = CompletionsAPI(args.model, args.served_model_name, max_batch_size=args.max_batch_size,
                         batch_timeout=args.batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", fast_queue=args.fast_queue)
    models = models_list(args.model, args.served_model_name, owned_by="litserve")
    server.app.add_api_route("/v1/models", lambda: models, methods=["GET"])

    main_pid = os.getpid()

    def stop(signum, frame):
        if os.getpid() != main_pid:  # a forked uvicorn process re-raising SIGTERM after its own shutdown
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt  # LitServe stops its worker processes on KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # generate_client_file=False: LitServe would otherwise write client.py into the working directory
    server.run(host=args.host, port=args.port, log_level=args.log_level, generate_client_file=False)


if __name__ == "__main__":
    main()
