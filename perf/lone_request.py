"""Where a lone request's time goes under each scheduler, in one process, without HTTP (issue 50,
item 6: at low open-loop load fixed_steps N=2 answered later than continuous N=1).

Both engines run in this process over one runner (one copy of the weights), each with its own
slot threads, as the server builds them; requests arrive one at a time with Poisson gaps, the
engines taking turns request by request (A B, B A, ...), so both see the same host at the same
minute. Each request's time splits into:

    hop      Engine.submit on the loop   -> its batch starts on a slot's thread
    run      the batch on the slot        (prefill of one token: the forward, the pick)
    back     the batch's last delta       -> the request's coroutine has it, on the loop
    threads  torch's intra-op threads the prefill ran on

    .venv/bin/python perf/lone_request.py [--model PATH] [--requests 300] [--gap-ms 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch
import uvloop
from cli import cpu_model
from servers import ensure_random_model

from xllm_async.engine.engine import Engine
from xllm_async.engine.output import OutputStream
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import EngineRequest
from xllm_async.execution import steps
from xllm_async.execution.steps import Execution
from xllm_async.runtime.executor import start_slots
from xllm_async.runtime.model_runner import load_runner

CONFIGS = {"continuous-N1": ("continuous", 1), "fixed_steps-N2": ("fixed_steps", 2)}


class Timeline:
    """The slot side's stamps of the batch now running (one lone request at a time)."""

    def __init__(self) -> None:
        self.started = self.ended = 0.0
        self.threads = 0


def instrument(timeline: Timeline) -> None:
    """Stamp StepLoop.run's start and end on the slot's thread (perf_counter: one clock for both threads)."""
    run = steps.StepLoop.run

    def stamped(self, *args, **kwargs):
        timeline.started = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            timeline.threads = torch.get_num_threads()
            timeline.ended = time.perf_counter()

    steps.StepLoop.run = stamped


async def one(engine: Engine, timeline: Timeline, prompt: list[int]) -> tuple[float, float, float, float, int]:
    sink = OutputStream(1)
    request = EngineRequest(0, prompt, SamplingParams(max_tokens=1, temperature=0.0), sink)
    submitted = time.perf_counter()
    engine.submit([request])
    while sink.unfinished:
        await sink.next()
    answered = time.perf_counter()
    return (answered - submitted, timeline.started - submitted, timeline.ended - timeline.started,
            answered - timeline.ended, timeline.threads)


async def main(args: argparse.Namespace) -> None:
    model = args.model or ensure_random_model("small")
    runner = load_runner(model, torch.device("cpu"), args.dtype)
    runner.set_kv_cache(1 << 30, 2)
    timeline = Timeline()
    instrument(timeline)
    engines = {}
    for name, (scheduler, count) in CONFIGS.items():
        slots = start_slots(runner.device, count, 0, 5)
        runner.warm_up(8192, {n for s in slots for n in (s.binding.cpu_threads, s.binding.all_threads)})
        engines[name] = Engine(Execution(runner), slots, scheduler, 256, 8192, 4096)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)]
    names = list(engines)
    rows: dict[str, list[tuple]] = {name: [] for name in names}
    for i in range(args.warmup + args.requests):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            await asyncio.sleep(rng.expovariate(1000.0 / args.gap_ms))
            row = await one(engines[name], timeline, prompt)
            if i >= args.warmup:
                rows[name].append(row)
    print(f"{cpu_model()}; {model}; {args.prompt_tokens} tokens in, 1 out; {args.requests} requests each, "
          f"Poisson gaps of {args.gap_ms} ms mean, the engines in turn")
    print("| scheduler | E2E mean / median (ms) | hop (us, median) | run (ms, median) | back (us, median) | threads |")
    print("|---|---|---|---|---|---|")
    for name in names:
        e2e, hop, run, back, threads = zip(*rows[name])
        print(f"| {name} | {statistics.mean(e2e) * 1e3:.2f} / {statistics.median(e2e) * 1e3:.2f} "
              f"| {statistics.median(hop) * 1e6:.0f} | {statistics.median(run) * 1e3:.2f} "
              f"| {statistics.median(back) * 1e6:.0f} | {statistics.mode(threads)} |")
    base = statistics.mean(r[0] for r in rows[names[0]])
    print(f"fixed_steps / continuous mean E2E: {statistics.mean(r[0] for r in rows[names[1]]) / base:.3f}x")
    for engine in engines.values():
        await engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: the small random Qwen3 of perf/)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=320)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--gap-ms", type=float, default=30.0)
    uvloop.run(main(parser.parse_args()))
