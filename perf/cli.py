"""Command-line values the perf scripts share (perf/ is a folder of scripts that import each
other by name; see servers.py)."""

from __future__ import annotations

import argparse


def positive_ints(text: str) -> list[int]:
    """'1,2, 32' -> [1, 2, 32]: distinct positive integers separated by commas. An argparse
    `type`: a bad value is a usage error naming it, not a traceback."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers separated by commas, got {text!r}")
    return values


def positive_floats(text: str) -> list[float]:
    """'0.5,0.8' -> [0.5, 0.8]: positive numbers separated by commas (an argparse `type`)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return values
