"""A decode step whose rows share a system prompt, reading one copy of it (SlabCache.sharing, issue 48)
against each row reading its own, in one process: SmolLM2 in bfloat16 with the prefix cache on, 8
prompts of one 1,024-token system prompt and a 64-token question each, prefilled as a batch (the
shared prefix computed once and found by the rest), then greedy decode steps alternating the two ways
in blocks of 10 (ABBA). The tokens are the same either way (the copies are equal); what differs is
the keys read from memory: 8 copies of the prefix a layer, or one.

    .venv/bin/python perf/experiments/shared_decode.py
"""

from __future__ import annotations

import os
import random
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
from cli import cpu_model

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.execution.sampling import argmax_rows
from xllm_async.runtime.model_runner import ModelRunner

MODEL = os.path.expanduser("~/.cache/xllm_async/SmolLM2-135M-Instruct")


def main() -> None:
    runner = ModelRunner(MODEL, torch.device("cpu"), "bfloat16")
    runner.set_kv_cache(None, 1, None)
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(1024)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(64)] for _ in range(8)]
    seconds: dict[str, list[float]] = {"one copy": [], "own copies": []}
    with torch.inference_mode():
        prefilled = runner.prefill(prompts, 1088 + 170)
        kv, tokens = prefilled.cache, argmax_rows(prefilled.logits)
        sharing = kv.sharing
        for block in range(16):
            for way in ("one copy", "own copies") if block % 2 else ("own copies", "one copy"):
                kv.sharing = sharing if way == "one copy" else None
                for _ in range(10):
                    began = time.perf_counter()
                    tokens = runner.decode_greedy(kv, tokens)
                    seconds[way].append(time.perf_counter() - began)
    print(f"CPU: {cpu_model()}; {torch.get_num_threads()} threads; 8 rows, 1,024 shared + 64 own keys and growing")
    for way, times in seconds.items():
        print(f"  {way:10s}  median {statistics.median(times) * 1e3:6.2f} ms  lower quartile "
              f"{sorted(times)[len(times) // 4] * 1e3:6.2f} ms  ({len(times)} steps)")


if __name__ == "__main__":
    main()
