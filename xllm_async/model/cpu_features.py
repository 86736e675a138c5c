"""What this CPU can do, as Linux's /proc/cpuinfo names it: read once, here and nowhere else in
the package. It feeds one decision, whether bfloat16 is native here (AMX or AVX512-BF16): that
picks the CPU's default dtype (runtime/device.py fast_cpu_dtype) and which of our kernels build
and run (cpu_kernels.py). Imports nothing, torch included."""

from __future__ import annotations

import functools
import platform

# The units that compute bfloat16 natively, best first, each as the flags name what it needs
# (AMX: its tiles and their bfloat16 products).
BFLOAT16_UNITS = {"amx": ("amx_tile", "amx_bf16"), "avx512_bf16": ("avx512_bf16",)}


@functools.cache
def _flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where there is no /proc/cpuinfo)."""
    return frozenset(_flags_line().split())


def bfloat16_units() -> list[str]:
    """The units that compute bfloat16 natively on this CPU, best first: "amx", "avx512_bf16"."""
    flags = cpu_flags()
    return [unit for unit, needs in BFLOAT16_UNITS.items() if all(flag in flags for flag in needs)]


def cpu_identity() -> str:
    """What a build for this CPU is keyed by (cpu_kernels.library_path): its flags as
    /proc/cpuinfo lists them, or the processor's name where there are none."""
    return _flags_line() or platform.processor()
