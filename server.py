"""xllm_async server: reads the configuration, builds the parts, runs the loop.

    python server.py --help
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

import xllm_async  # noqa: F401  (sets the torch_npu autoload switch before torch is imported)
from xllm_async.config import ConfigError, Settings, load_settings

log = logging.getLogger("xllm_async.server")


async def serve(settings: Settings) -> None:
    # Heavy imports after the configuration is known to be valid: a typo fails in milliseconds.
    from xllm_async.api.app import OpenAIApp
    from xllm_async.api.requests import ModelInfo
    from xllm_async.engine.engine import Engine
    from xllm_async.http.server import start_http_server
    from xllm_async.metrics import Gauge, Metrics
    from xllm_async.runtime.default_model import default_model_dir
    from xllm_async.runtime.device import DeviceError, resolve_device
    from xllm_async.runtime.executor import start_slots
    from xllm_async.runtime.model_runner import ModelRunner

    try:
        device = resolve_device(settings.devices)
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None
    model_dir = settings.model or default_model_dir(settings.cache_dir)
    runner = ModelRunner(model_dir, device, settings.dtype)
    if settings.max_model_len is not None:
        if settings.max_model_len > runner.max_model_len:
            raise ConfigError(f"invalid XLLM_MAX_MODEL_LEN={settings.max_model_len}: "
                              f"expected at most the model's {runner.max_model_len}")
        runner.max_model_len = settings.max_model_len

    continuous = settings.scheduler == "continuous"
    if continuous and settings.concurrent_execute_stream_num != 1:
        log.info("continuous scheduler: one batch in flight on one slot (XLLM_CONCURRENT_EXECUTE_STREAM_NUM "
                 "applies to fixed_steps)")
    slots = start_slots(device, 1 if continuous else settings.concurrent_execute_stream_num)
    metrics = Metrics()
    metrics.add(Gauge("model_load_seconds", "Seconds the model took to load.", lambda: runner.load_seconds))
    engine = Engine(runner, slots, settings.scheduler, settings.max_seqs_per_batch,
                    settings.max_tokens_per_batch, settings.max_queued_requests, metrics)
    name = settings.served_model_name or os.path.basename(os.path.normpath(model_dir))
    model = ModelInfo(name, runner.tokenizer, runner.vocab_size, runner.max_model_len, settings.max_n)
    info = {
        "model": name, "model_path": model_dir, "device": str(device), "dtype": str(runner.dtype).removeprefix("torch."),
        "scheduler": settings.scheduler, "concurrent_execute_stream_num": len(slots),
        "max_tokens_per_batch": settings.max_tokens_per_batch, "max_seqs_per_batch": settings.max_seqs_per_batch,
        "max_model_len": runner.max_model_len, "max_queued_requests": settings.max_queued_requests,
    }
    app = OpenAIApp(engine, model, info, settings.access_log)
    connections: set = set()
    try:
        server = await start_http_server(app, settings.host, settings.port, settings.max_body_bytes, connections,
                                         app.on_response)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
    log.info("configuration: %s", ", ".join(f"{k}={v}" for k, v in vars(settings).items()))
    log.info("serving %s on http://%s:%d (%s scheduler, %d slot(s), device %s)", name, settings.host,
             settings.port, settings.scheduler, len(slots), device)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("shutting down: no new connections; finishing requests in flight")
    server.close()
    deadline = time.monotonic() + 30
    while any(c.busy for c in connections) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for conn in list(connections):
        conn.close()
    await engine.stop()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ConfigError as exc:
        print(f"xllm_async: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    try:
        uvloop.run(serve(settings))
    except ConfigError as exc:
        print(f"xllm_async: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
