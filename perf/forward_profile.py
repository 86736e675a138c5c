"""Where one forward's time goes: the server's own prefill (ModelRunner.prefill, then the greedy
pick that waits for the result, as a slot runs them) timed wall-clock, then one forward under
torch.profiler, split into the host's time in operators and the device's time in kernels.

    python perf/forward_profile.py --model perf/results/models/qwen3-0.6b --devices cuda:0 \\
        --dtype bfloat16 --batch-sizes 1,2,32 --input-len 320

On an accelerator, a forward whose wall time is far above its kernel time is bound by the host:
Python, operator dispatch and kernel launches, not the chip. Then more execution streams (slots)
help only as far as their threads overlap that host work, and batching is nearly free.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import servers
from cli import positive_ints

import xllm_async  # noqa: F401  (sets torch_npu autoloading and OpenMP spinning before torch loads)
from xllm_async.execution.sampling import argmax_rows
from xllm_async.runtime.device import StreamBinding, resolve_device
from xllm_async.runtime.model_runner import ModelRunner, load_runner


def forward(runner: ModelRunner, prompts: list[list[int]]) -> list[int]:
    """One prefill as a slot runs it: the logits, then the picked tokens (which waits for the device)."""
    logits = runner.prefill(prompts).logits
    return argmax_rows(logits)


def time_forwards(runner: ModelRunner, prompts: list[list[int]], runs: int) -> list[float]:
    for _ in range(3):  # unmeasured: first shapes allocate
        forward(runner, prompts)
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        forward(runner, prompts)
        seconds.append(time.perf_counter() - start)
    return seconds


def profile_forward(runner: ModelRunner, prompts: list[list[int]]) -> dict:
    """One forward under torch.profiler: host ms in operators, device ms in kernels, launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        forward(runner, prompts)
    events = prof.key_averages()
    # Kernels only: an operator's entry carries its kernels' time again.
    device_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.self_device_time_total, reverse=True)[:8]
    return {"operators": sum(e.count for e in events if e.key.startswith("aten::")),
            "launches": launches, "device_ms": device_us / 1000.0,
            "top_host": [(e.key, e.count, e.self_cpu_time_total / 1000.0) for e in top],
            "top_device": [(e.key[:60], e.count, e.self_device_time_total / 1000.0) for e in kernels]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL, help="model folder (default: the tiny Qwen3)")
    parser.add_argument("--devices", default="auto", help="as server.py: auto, cpu, cuda:N or npu:N")
    parser.add_argument("--dtype", default="auto", help="as server.py: auto, float32, bfloat16, float16")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "gguf"),
                        help="as server.py: the linear layers' weights plain, int8 or the GGUF file's blocks")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 32],
                        help="comma-separated prompts per forward")
    parser.add_argument("--input-len", type=int, default=320, help="tokens per prompt")
    parser.add_argument("--runs", type=int, default=20, help="timed forwards per batch size")
    parser.add_argument("--cpu-threads", type=int, default=0, help="torch threads on CPU (0: all cores)")
    parser.add_argument("--graph-max-tokens", type=lambda t: [int(x) for x in t.split(",")], default=[0],
                        help="comma-separated: 0 = the plain forward, N = graphs of up to N rows "
                             "(runtime/graphs.py; accelerators), each measured in turn")
    args = parser.parse_args(argv)
    try:
        model = servers.ensure_model(args.model)
    except servers.ServerError as exc:
        print(f"forward_profile: {exc}", file=sys.stderr)
        return 1
    runner = load_runner(model, resolve_device(args.devices), args.dtype, quantization=args.quantization)
    binding = StreamBinding(runner.device, args.cpu_threads or os.cpu_count() or 1)
    binding.enter()  # this thread runs the forwards, as one slot would
    rng = random.Random(0)
    high = min(runner.vocab_size, 100_000)
    try:
        print(f"{runner.config.model_type}, {runner.config.num_hidden_layers} layers, {runner.dtype}, "
              f"{binding.describe()}, {args.input_len} tokens a prompt")
        print(f"{'graphs':>6} {'batch':>5} {'wall ms p50':>12} {'min':>7} {'kernels ms':>11} {'launches':>9} "
              f"{'aten ops':>9}")
        tops = []
        prompt_sets = {size: [[rng.randrange(1000, high) for _ in range(args.input_len)] for _ in range(size)]
                       for size in args.batch_sizes}
        for graphs in args.graph_max_tokens:
            made = runner.capture_graphs(graphs)  # (0: the plain forward from here on)
            if made is not None:
                print(f"graphs of up to {graphs} rows: {len(made.sizes)} sizes x {len(made.model.layers) + 1} "
                      f"pieces captured in {made.capture_seconds:.1f} s", flush=True)
            for size, prompts in prompt_sets.items():
                seconds = time_forwards(runner, prompts, args.runs)
                prof = profile_forward(runner, prompts)
                tops.append((f"{size}, graphs {graphs}", prof["top_host"]))
                if prof["top_device"]:
                    tops.append((f"{size}, graphs {graphs}, kernels", prof["top_device"]))
                print(f"{graphs:>6} {size:>5} {statistics.median(seconds) * 1e3:>12.2f} {min(seconds) * 1e3:>7.2f} "
                      f"{prof['device_ms']:>11.2f} {prof['launches']:>9} {prof['operators']:>9}", flush=True)
        for size, top in tops:
            print(f"batch {size}, most {'device' if 'kernels' in size else 'host'} time (name, calls, self ms): "
                  + "; ".join(f"{key} x{count} {ms:.2f}" for key, count, ms in top))
    finally:
        binding.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
