"""Command-line values the perf scripts share (perf/ is a folder of scripts that import each
other by name; see servers.py)."""

from __future__ import annotations

import argparse
import os
import platform


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


def cpu_model() -> str:
    """What every figure names: the CPU's model, the bfloat16 units it has (our kernels and the
    default dtype follow them) and the cores, e.g. "AMD EPYC (AVX512-BF16, no AMX), 2 cores"."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    units = ["AMX" if "amx_bf16" in flags else "no AMX"]
    if "avx512_bf16" in flags:
        units.insert(0, "AVX512-BF16")
    return f"{name or platform.processor() or 'unknown CPU'} ({', '.join(units)}), {os.cpu_count()} cores"
