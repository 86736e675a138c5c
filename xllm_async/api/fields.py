"""Typed reads of a JSON request body; each bad value becomes a 400 naming its field."""

from __future__ import annotations

import math
import reprlib

from ..errors import ApiError

# A client's value quoted in an error message: cut short, and only a few levels of its nesting
# (a plain repr of a list nested 1,000 deep raises RecursionError: a 500 instead of the 400).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 3, 4, 4
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlong = 40


def shown(value) -> str:
    return _SHOWN.repr(value)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


class Fields:
    """Reads one field at a time with its default; null counts as absent."""

    __slots__ = ("body",)

    def __init__(self, body: dict) -> None:
        self.body = body

    def raw(self, name: str):
        return self.body.get(name)

    def int(self, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(name, f"`{name}` must be an integer, got {shown(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise bad(name, f"`{name}` must be {_range(low, high)}, got {value}")
        return value

    def float(self, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(name, f"`{name}` must be a finite number, got {shown(value)}")
        if value < low or value > high or (low_open and value == low):
            opener = "(" if low_open else "["
            raise bad(name, f"`{name}` must be in {opener}{low}, {high}], got {value}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad(name, f"`{name}` must be a boolean, got {shown(value)}")
        return value

    def str_list(self, name: str, max_items: int) -> tuple[str, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if (not isinstance(items, list) or len(items) > max_items
                or not all(isinstance(s, str) and s for s in items)):
            raise bad(name, f"`{name}` must be a non-empty string or a list of at most {max_items} of them")
        return tuple(items)

    def int_list(self, name: str, low: int, high: int) -> list[int]:
        value = self.body.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(is_int(v) and low <= v <= high for v in value):
            raise bad(name, f"`{name}` must be a list of integers in [{low}, {high}]")
        return value

    def dict(self, name: str) -> dict:
        value = self.body.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad(name, f"`{name}` must be an object")
        return value


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(low, high) -> str:
    if high is None:
        return f">= {low}"
    if low is None:
        return f"<= {high}"
    return f"in [{low}, {high}]"
