"""What the LM head's fused greedy pick (csrc/head_pick.cpp, issue 49) saves a decode step: the step
as a slot runs an all-greedy batch (ModelRunner.decode_greedy: no logits made) against the step
before it (ModelRunner.decode's float32 [rows, vocab] logits, then sampling.argmax_rows), in one
process, many short rounds interleaved (the order alternating), each round a fresh prefill and
`--steps` steps of each way; the figure is the median of the rounds' ratios (and of their
differences in ms), since this machine's memory bandwidth moves by a third in phases of seconds.
It also times the head alone over the same rows (the linear, .float() and argmax_rows against
linear_argmax), and checks that both ways pick the same tokens.

    .venv/bin/python perf/experiments/head_pick.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --threads 2

Measured (session 31, EPYC Zen 4, 2 vCPUs shared by four sessions, load 6-9; SmolLM2-135M bf16):
with 1 torch thread, 30 rounds, the head alone 0.96x (1 row: 2.20 -> 2.11 ms), 0.93x (8 rows), 0.94x
(16); a whole step's median per-round ratio, wall / thread CPU, 1 row 0.98 / 1.01 (within the
noise), 8 rows 0.91 / 0.98 (0.4 ms of CPU saved), 16 rows 0.97 / 0.97 (1.1-1.3 ms). With 2 threads
on that crowded machine a 1-row step took 40-340 ms (OpenMP's barrier with its cores taken): no
figure; rerun it on a quiet one. What the pick saves is what the logits path does after the
weights are read: the bfloat16 [rows, vocab] store, the float32 copy and numpy's argmax over it,
about 50 us a row here, beside a head that reads 56 MB of weights.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import _perf_path  # noqa: F401  (perf/ on sys.path)
import servers
import torch  # noqa: E402

import xllm_async  # noqa: F401  (OpenMP spinning and the malloc arena, set before torch loads)
from xllm_async.execution.sampling import argmax_rows  # noqa: E402
from xllm_async.runtime.device import StreamBinding, resolve_device  # noqa: E402
from xllm_async.runtime.model_runner import load_runner  # noqa: E402


def steps(runner, prompts: list[list[int]], count: int, fused: bool) -> tuple[list[tuple[float, float]], list]:
    """The prompts' prefill, then `count` decode steps one way: each step's (wall, thread CPU) seconds,
    and the tokens. (Thread CPU leaves out the time another process held the core: with one torch
    thread, the steadier figure on a crowded machine.)"""
    prefilled = runner.prefill(prompts, max(map(len, prompts)) + count + 1)
    kv, token = prefilled.cache, argmax_rows(prefilled.logits)
    seconds, tokens = [], []
    for _ in range(count):
        wall, cpu = time.perf_counter(), time.thread_time()
        token = runner.decode_greedy(kv, token) if fused else argmax_rows(runner.decode(kv, token))
        seconds.append((time.perf_counter() - wall, time.thread_time() - cpu))
        tokens.append(token)
    return seconds, tokens


def head_alone(runner, rows: int, rounds: int, calls: int) -> list[tuple[float, float]]:
    """(logits way, fused way) median microseconds of the head alone over `rows` random hidden rows, a pair
    per round."""
    head = runner.model.packed_lm_head
    hidden = torch.randn(rows, runner.model.shape.hidden).to(runner.dtype)
    ways = {"logits": lambda: argmax_rows(runner.model.logits(hidden)),
            "fused": lambda: runner.model.greedy(hidden).tolist()}
    assert ways["logits"]() == ways["fused"](), "the head's two ways picked differently"
    assert head is not None and runner.picks_greedy
    out = []
    for round_ in range(rounds):
        took = {}
        for name in (("logits", "fused") if round_ % 2 == 0 else ("fused", "logits")):
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                ways[name]()
                times.append(time.perf_counter() - start)
            took[name] = statistics.median(times) * 1e6
        out.append((took["logits"], took["fused"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--rows", default="1,8", help="decode rows (clients), comma-separated")
    parser.add_argument("--steps", type=int, default=16, help="decode steps a way a round")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    runner = load_runner(servers.ensure_model(args.model), resolve_device("cpu"), args.dtype)
    runner.set_kv_cache(None, 1)
    if not runner.picks_greedy:
        raise SystemExit("head_pick: this model and CPU have no fused pick (cpu_kernels.head_pick)")
    binding = StreamBinding(runner.device, args.threads)
    binding.enter()
    rng = random.Random(0)
    print(f"{runner.config.model_type}, {runner.dtype}, vocab {runner.vocab_size}, {binding.describe()}, "
          f"a {args.input_len}-token prompt a row, {args.steps} steps a way a round, {args.rounds} rounds")
    try:
        with torch.inference_mode():
            for rows in [int(r) for r in args.rows.split(",")]:
                prompts = [[rng.randrange(1000, min(runner.vocab_size, 40000)) for _ in range(args.input_len)]
                           for _ in range(rows)]
                steps(runner, prompts, 8, True)  # unmeasured: first shapes allocate
                steps(runner, prompts, 8, False)
                took = {(fused, clock): [] for fused in (True, False) for clock in (0, 1)}  # clock 0: wall, 1: CPU
                picked = {}
                for round_ in range(args.rounds):
                    for fused in ((True, False) if round_ % 2 == 0 else (False, True)):
                        seconds, tokens = steps(runner, prompts, args.steps, fused)
                        for clock in (0, 1):
                            took[fused, clock].append(statistics.median(s[clock] for s in seconds) * 1e3)
                        if picked.setdefault(fused, tokens) != tokens:
                            raise SystemExit(f"head_pick: the {'fused' if fused else 'logits'} steps changed tokens")
                if picked[True] != picked[False]:
                    raise SystemExit(f"head_pick: {rows} rows: the two ways picked different tokens")
                for clock, name in ((0, "wall"), (1, "thread CPU")):
                    fused, logits = took[True, clock], took[False, clock]
                    ratios = [f / g for f, g in zip(fused, logits)]
                    print(f"{rows} rows, {name}: step ms, medians over rounds: logits {statistics.median(logits):.3f}, "
                          f"fused {statistics.median(fused):.3f}; fused/logits, median of per-round ratios "
                          f"{statistics.median(ratios):.3f} (quartiles "
                          f"{' '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=4))}); saved "
                          f"{statistics.median(g - f for f, g in zip(fused, logits)):.3f} ms a step (median of "
                          f"per-round differences); same tokens")
                pairs = head_alone(runner, rows, args.rounds, 50)
                print(f"{rows} rows, the head alone: logits way {statistics.median(p[0] for p in pairs):.0f} us, fused "
                      f"{statistics.median(p[1] for p in pairs):.0f} us, median ratio "
                      f"{statistics.median(p[1] / p[0] for p in pairs):.3f}")
    finally:
        binding.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
