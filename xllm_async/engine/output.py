"""Where an API request waits for its sequences' deltas."""

from __future__ import annotations

import asyncio

from .request import Delta


class OutputStream:
    """Deltas of one API request's sequences (its n choices), pushed by the
    engine on the event loop and read by one coroutine in batches: whatever
    arrived since the last read comes back at once, so a consumer wakes at
    most once per engine step."""

    __slots__ = ("_items", "_waiter", "unfinished")

    def __init__(self, num_sequences: int) -> None:
        self._items: list[Delta] = []
        self._waiter: asyncio.Future | None = None
        self.unfinished = num_sequences

    def push(self, delta: Delta) -> None:
        self._items.append(delta)
        if delta.finish_reason is not None:
            self.unfinished -= 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self) -> list[Delta]:
        """The deltas that arrived since the last call; waits while there are none."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        items, self._items = self._items, []
        return items
