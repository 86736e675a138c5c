"""Does the read ceiling itself move while one process runs? Short windows, one after another in one
process, each a stream read of the weights' bytes, our linears at one row over them, and a run of
one-row decode steps (perf/read_ceiling.py's three readings, in a window of about a second), and
the load of the machine's steal time in it.

    python perf/bandwidth_phases.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --windows 40

Where the stream's time moves from window to window in one process, with the same pages, threads
and allocator state, what moves a fresh process's decode is the machine's memory, not the process
(issue 49, item 5). Then a straight line fitted through the windows, step = fixed + slope x stream,
tells the step's part that does not scale with the read (the host work around the linears:
attention, norms, the calls) from the part that does.

Prints each window, then each reading's range (max/min - 1) over the windows, the correlation of the
step with the stream, and the fit.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import decode_step
import read_ceiling
import servers
import torch  # noqa: E402  (after xllm_async, through decode_step: the OpenMP and malloc settings)
from cli import cpu_model

from xllm_async.runtime.device import StreamBinding, resolve_device
from xllm_async.runtime.model_runner import load_runner


def steal_ticks() -> tuple[int, int]:
    """(steal, all) jiffies of the machine so far (/proc/stat's cpu line), (0, 0) where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x and the correlation r: (a, b, r)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else 0.0
    r = sxy / (sxx * syy) ** 0.5 if sxx and syy else 0.0
    return my - b * mx, b, r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL, help="model folder (default: the tiny Qwen3)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (a lone slot's)")
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--reads", type=int, default=10, help="stream reads and linear passes a window")
    parser.add_argument("--steps", type=int, default=40, help="decode steps a window")
    args = parser.parse_args(argv)
    runner = load_runner(servers.ensure_model(args.model), resolve_device("cpu"), args.dtype)
    runner.set_kv_cache(None, 1)
    binding = StreamBinding(runner.device, args.threads)
    binding.enter()
    try:
        weights = read_ceiling.step_weights(runner.model)
        if not weights:
            raise SystemExit("bandwidth_phases: no packed weights of our linear here")
        total = sum(w.numel() * w.element_size() for w in weights)
        stream = torch.cat([w.reshape(-1).view(torch.uint8) for w in weights])
        stream = stream[:stream.numel() // 4 * 4].view(torch.float32)
        rows = [read_ceiling.one_row(w) for w in weights]
        rng = random.Random(0)
        prompt = [rng.randrange(1000, min(runner.vocab_size, 40000)) for _ in range(128)]
        decode_step.steps(runner, prompt, 20)  # unmeasured: first shapes allocate
        torch.set_flush_denormal(True)  # (the stream's float32 view of bfloat16 pairs: read_ceiling)

        def linears() -> None:
            for w, (x, n) in zip(weights, rows):
                torch.ops.xllm.linear(x, w, None, n)

        print(f"CPU: {cpu_model()}; {runner.config.model_type}, {runner.dtype}, {binding.describe()}; "
              f"{total / 1e6:.1f} MB of packed weights; medians a window, ms")
        windows = []
        for index in range(args.windows):
            steal0 = steal_ticks()
            read = statistics.median(read_ceiling.timed(stream.sum, args.reads))
            passes = statistics.median(read_ceiling.timed(linears, args.reads))
            step = statistics.median(wall for wall, _ in decode_step.steps(runner, prompt, args.steps)[0])
            steal1 = steal_ticks()
            steal = (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])
            windows.append((read * 1e3, passes * 1e3, step * 1e3))
            print(f"  window {index + 1:3d}: stream {read * 1e3:6.2f} ({total / read / 1e9:5.1f} GB/s)  linears "
                  f"{passes * 1e3:6.2f}  step {step * 1e3:6.2f}  steal {steal:5.1%}", flush=True)
    finally:
        torch.set_flush_denormal(False)
        binding.exit()
    reads, passes, steps = zip(*windows)
    for name, values in (("stream", reads), ("linears", passes), ("step", steps)):
        print(f"{name:8s} min {min(values):6.2f} median {statistics.median(values):6.2f} max {max(values):6.2f} ms: "
              f"max/min - 1 = {max(values) / min(values) - 1:.1%}")
    for name, values in (("linears", passes), ("step", steps)):
        a, b, r = fit(list(reads), list(values))
        print(f"{name} = {a:.2f} ms + {b:.2f} x stream (r = {r:.2f}); at the median stream "
              f"{statistics.median(reads):.2f} ms the fixed part is {a / statistics.median(values):.0%} of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
