"""What the engine asks of a scheduler (engine/fixed_steps.py, engine/continuous.py): the declared
contract, so that a third scheduler knows what it owes and tests/test_contracts.py can check both."""

from __future__ import annotations

from abc import ABC, abstractmethod

from .request import QueuedRequest


class Scheduler(ABC):
    """Decides which waiting requests run together, and when, on which slot. Lives on the event
    loop; talks to slot threads only through engine/handoff.py."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Sequences admitted but not yet taken into a batch."""

    @property
    @abstractmethod
    def busy_slots(self) -> int:
        """Execution slots running a batch now."""

    @abstractmethod
    def start(self) -> None:
        """Begin scheduling (on the running loop)."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop taking new batches; running ones end on their own."""

    @abstractmethod
    def add(self, requests: list[QueuedRequest]) -> None:
        """Queue the admitted sequences of one API request."""

    @abstractmethod
    def drop_aborted(self) -> int:
        """Take requests answered while they waited off the queue now; returns how many live ones wait."""
