"""xllm_async server: reads the configuration, builds the parts, runs the loop.

    python server.py --help
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import xllm_async  # noqa: F401  (sets torch_npu autoloading and OpenMP spinning before torch loads)
from xllm_async.config import ConfigError, Settings, load_settings


async def serve(settings: Settings) -> None:
    # Heavy imports after the configuration is known to be valid: a typo fails in milliseconds.
    from xllm_async.service import Service

    service = Service(settings)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP re-reads the item table, as nginx and HAProxy reload their configuration.
    loop.add_signal_handler(signal.SIGHUP, service.reload_items_soon)
    await stop.wait()
    await service.shutdown()


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
