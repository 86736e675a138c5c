"""Listening socket: one HttpProtocol per accepted connection."""

from __future__ import annotations

import asyncio

from .protocol import Handler, HttpProtocol, ResponseListener
from .response import DateHeader


async def start_http_server(handler: Handler, host: str, port: int, max_body_bytes: int,
                            connections: set, on_response: ResponseListener | None = None) -> asyncio.AbstractServer:
    loop = asyncio.get_running_loop()
    DateHeader.start(loop)
    return await loop.create_server(
        lambda: HttpProtocol(handler, connections, max_body_bytes, on_response), host, port,
        backlog=4096, reuse_address=True,
    )
