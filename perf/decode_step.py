"""One client's decode step offline, as a slot runs it (ModelRunner.decode, then the greedy pick):
its wall and thread-CPU medians, and what the host does for it, counted (Python calls and
nn.Module calls a step, under cProfile). Counts hold on a shared machine where milliseconds do not.

    python perf/decode_step.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --threads 2 --compare-generic

--compare-generic alternates rounds with the native step as operator calls (csrc/small_step.cpp
without its one OpenMP team, csrc/team_step.cpp), the Python small step (llama.SmallStep's loop
where the native one would run) and the generic forward (every layer through its modules, as
prefills run), in this process, and checks that all pick the same tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

import servers

import xllm_async  # noqa: F401  (OpenMP spinning and the malloc arena, set before torch loads)
from xllm_async.execution.sampling import argmax_rows
from xllm_async.model import llama
from xllm_async.runtime.device import StreamBinding, resolve_device
from xllm_async.runtime.model_runner import ModelRunner, load_runner

SMALL_ROWS = llama.EXACT_ROWS  # the most rows a step runs as a small step (llama.SmallStep)


def use(way: str) -> None:
    """native: as served (the native loop where it runs, as one team where that runs); operators: the
    native loop as operator calls; small: llama.SmallStep's Python loop; generic: every layer
    through its modules."""
    llama.EXACT_ROWS = 0 if way == "generic" else SMALL_ROWS
    llama.NATIVE_STEP = way in ("native", "operators")
    llama.TEAM_STEP = way == "native"


def steps(runner: ModelRunner, prompt: list[int], count: int) -> tuple[list[tuple[float, float]], list[int]]:
    """The prompt's prefill, then `count` decode steps: (wall, thread CPU) seconds each, and the tokens."""
    prefilled = runner.prefill([prompt], len(prompt) + count + 1)
    logits, kv = prefilled.logits, prefilled.cache
    token = argmax_rows(logits)
    seconds, tokens = [], []
    for _ in range(count):
        wall, cpu = time.perf_counter(), time.thread_time()
        token = argmax_rows(runner.decode(kv, token))
        seconds.append((time.perf_counter() - wall, time.thread_time() - cpu))
        tokens.append(token[0])
    return seconds, tokens


def host_counts(runner: ModelRunner, prompt: list[int], count: int = 10) -> tuple[float, float]:
    """Python calls and nn.Module calls per decode step, under cProfile."""
    prefilled = runner.prefill([prompt], len(prompt) + count + 1)
    logits, kv = prefilled.logits, prefilled.cache
    token = argmax_rows(logits)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(count):
        token = argmax_rows(runner.decode(kv, token))
    profile.disable()
    stats = pstats.Stats(profile)
    modules = sum(calls for (path, _, name), (_, calls, *_) in stats.stats.items()
                  if name == "_call_impl" and path.endswith("module.py"))
    return stats.total_calls / count, modules / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL, help="model folder (default: the tiny Qwen3)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", help="none, int8 or gguf (XLLM_QUANTIZATION)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (a lone slot's)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=127, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--compare-generic", action="store_true", help="alternate with the generic forward")
    args = parser.parse_args(argv)
    runner = load_runner(servers.ensure_model(args.model), resolve_device("cpu"), args.dtype,
                         quantization=args.quantization)
    runner.set_kv_cache(None, 1)
    binding = StreamBinding(runner.device, args.threads)
    binding.enter()  # this thread runs the steps, as a lone slot's would
    rng = random.Random(0)
    prompt = [rng.randrange(1000, min(runner.vocab_size, 40000)) for _ in range(args.input_len)]
    ways = ("native", "operators", "small", "generic") if args.compare_generic else ("native",)
    wall: dict[str, list[float]] = {way: [] for way in ways}
    cpu: dict[str, list[float]] = {way: [] for way in ways}
    picked: dict[str, list[int]] = {}
    try:
        steps(runner, prompt, 20)  # unmeasured: first shapes allocate
        for round_ in range(args.rounds):
            for way in ways if round_ % 2 == 0 else ways[::-1]:
                use(way)
                seconds, tokens = steps(runner, prompt, args.steps)
                wall[way].append(statistics.median(s for s, _ in seconds) * 1e3)
                cpu[way].append(statistics.median(c for _, c in seconds) * 1e3)
                if picked.setdefault(way, tokens) != tokens:
                    raise SystemExit(f"decode_step: the {way} steps picked other tokens in round {round_ + 1}")
        print(f"{runner.config.model_type}, {runner.dtype}, {binding.describe()}, a {args.input_len}-token prompt, "
              f"{args.steps} steps a round, {args.rounds} rounds (medians of each round)")
        for way in ways:
            use(way)
            calls, modules = host_counts(runner, prompt)
            print(f"{way:8s} wall ms {' '.join(f'{m:.2f}' for m in wall[way])} | thread CPU ms "
                  f"{' '.join(f'{m:.2f}' for m in cpu[way])} | Python calls {calls:.0f}, "
                  f"module calls {modules:.0f} a step")
        if args.compare_generic:
            same = picked["native"] == picked["operators"] == picked["small"] == picked["generic"]
            for way in ("operators", "small", "generic"):
                print(f"native / {way}, round by round: wall "
                      + " ".join(f"{s / g:.3f}" for s, g in zip(wall["native"], wall[way]))
                      + " | CPU " + " ".join(f"{s / g:.3f}" for s, g in zip(cpu["native"], cpu[way])))
            print(f"same tokens: {same}")
    finally:
        use("native")
        binding.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
