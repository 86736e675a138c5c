"""The read ceiling of this CPU for a one-row decode step, and the step's fraction of it.

    python perf/read_ceiling.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --threads 2

A one-row step is bound by reading the weights: every packed linear (csrc/linear.cpp's layout) and
the LM head, once, split between the slot's OpenMP threads by contiguous ranges of 64-column blocks
(blocked_linear.h: thread t of T reads blocks [B*t/T, B*(t+1)/T)). Timed on this thread, bound as a
lone slot binds its own (torch's intra-op threads: `--threads`), rounds interleaved, medians:

- stream: a pure read of a buffer of the weights' bytes (a copy of them, one after another), by a
  float32 sum over the bytes: torch's reduction splits a contiguous buffer between its threads in
  contiguous ranges too, and the sum's one add per 64 bytes leaves it bound by the read;
- one linear: our linear at one row over one packed weight as large as all of them (random, the
  model's input width): the kernel's own streaming speed, in one parallel region;
- linears: our linear at one row over each of the model's packed weights in turn (a parallel region
  each, as the step runs them; the Python loop's ~121 calls are in it);
- step: the offline decode step at one row (perf/decode_step.py's, a 128-token prompt).

Each is reported as GB/s of the weights' bytes (a round's median, and the best read or step of all
rounds: on a shared machine the steadier figure), and the step's as a fraction of the stream's and
of the better of the two reads. Also: the CPU model, our linear's instruction set, transparent huge
pages' mode and how much of the weights' resident memory is on huge pages (/proc/self/smaps).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import decode_step
import servers
import torch  # noqa: E402  (after xllm_async, through decode_step: the OpenMP and malloc settings)
from cli import cpu_model

from xllm_async.runtime.device import StreamBinding, resolve_device
from xllm_async.runtime.model_runner import load_runner

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled ("madvise": only memory
    advised with MADV_HUGEPAGE gets huge pages), or "unknown"."""
    try:
        with open(THP) as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def huge_page_share(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(resident bytes, of which on transparent huge pages) of the mappings that hold the tensors'
    storage, from /proc/self/smaps; (0, 0) where it cannot be read."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    rss = huge = 0
    try:
        with open("/proc/self/smaps") as f:
            holds = False
            for line in f:
                head = line.split()[0] if line.strip() else ""
                if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                    start, end = (int(x, 16) for x in head.split("-"))
                    holds = any(a < end and b > start for a, b in spans)
                elif holds and head == "Rss:":
                    rss += int(line.split()[1]) << 10
                elif holds and head == "AnonHugePages:":
                    huge += int(line.split()[1]) << 10
    except OSError:
        return 0, 0
    return rss, huge


def step_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Our linear's packed weights in the order a step reads them: every layer's, then the LM head."""
    weights = [m.packed.ours for m in model.modules()
               if getattr(m, "packed", None) is not None and m.packed.ours is not None]
    head = getattr(model, "packed_lm_head", None)
    if head is not None and head.ours is not None:
        weights.append(head.ours)
    return weights


def one_row(packed: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A one-row input for a packed weight ([blocks, k * 64]) and its output width."""
    k = packed.shape[1] // 64
    return torch.randn(1, k, dtype=packed.dtype), packed.shape[0] * 64


def big_weight(total_bytes: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """One packed weight of about total_bytes, input width k (random values)."""
    columns = max(64, total_bytes // (k * dtype.itemsize) // 64 * 64)
    return torch.ops.xllm.pack_linear(torch.randn(columns, k, dtype=dtype))


def timed(work, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(runner, args: argparse.Namespace) -> dict:
    """Every round's times (seconds, each read or step) of the four readings, and what they read."""
    weights = step_weights(runner.model)
    if not weights:
        raise SystemExit("read_ceiling: no packed weights of our linear here (needs AVX512-BF16 or AVX512 float32)")
    total = sum(w.numel() * w.element_size() for w in weights)
    stream = torch.cat([w.reshape(-1).view(torch.uint8) for w in weights])
    stream = stream[:stream.numel() // 4 * 4].view(torch.float32)
    big = big_weight(total, weights[0].shape[1] // 64, weights[0].dtype)
    big_x, big_n = one_row(big)
    rows = [one_row(w) for w in weights]
    rng = random.Random(0)
    prompt = [rng.randrange(1000, min(runner.vocab_size, 40000)) for _ in range(args.input_len)]

    def stream_sum() -> None:
        # A float32 view of bfloat16 pairs can be subnormal (a zero high half): flushed, no slow adds
        # (this thread only, and only here: the step runs as served).
        torch.set_flush_denormal(True)
        try:
            stream.sum()
        finally:
            torch.set_flush_denormal(False)

    def linears() -> None:
        for w, (x, n) in zip(weights, rows):
            torch.ops.xllm.linear(x, w, None, n)

    readings = {
        "stream": lambda: timed(stream_sum, args.repeats),
        "one linear": lambda: timed(lambda: torch.ops.xllm.linear(big_x, big, None, big_n), args.repeats),
        "linears": lambda: timed(linears, args.repeats),
        "step": lambda: [wall for wall, _ in decode_step.steps(runner, prompt, args.steps)[0]],
    }
    rounds: dict[str, list[list[float]]] = {name: [] for name in readings}
    readings["step"]()  # unmeasured: first shapes allocate
    for round_ in range(args.rounds):
        for name in list(readings) if round_ % 2 == 0 else list(readings)[::-1]:
            rounds[name].append(readings[name]())
    rss, huge = huge_page_share(weights)
    return {"bytes": total, "big_bytes": big.numel() * big.element_size(), "tensors": len(weights),
            "rounds": rounds, "rss": rss, "huge": huge}


def report(measured: dict, describe: str) -> list[str]:
    total = measured["bytes"]
    rss, huge = measured["rss"], measured["huge"]
    lines = [f"CPU: {cpu_model()}; our linear on {torch.ops.xllm.linear_isa()}; "
             f"transparent huge pages: {thp_mode()}",
             f"{describe}; {measured['tensors']} packed weights, {total / 1e6:.1f} MB; "
             f"{huge / 2**20:.0f} of their mappings' {rss / 2**20:.0f} MiB resident on huge pages",
             f"GB/s of the weights' bytes, each round's median, and the best read or step of all rounds "
             f"(on a shared machine the best is the steadier figure; the one linear reads "
             f"{measured['big_bytes'] / 1e6:.1f} MB):"]
    medians, bests = {}, {}
    for name, rounds in measured["rounds"].items():
        nbytes = measured["big_bytes"] if name == "one linear" else total
        seconds = [statistics.median(r) for r in rounds]
        medians[name] = statistics.median(nbytes / s / 1e9 for s in seconds)
        bests[name] = nbytes / min(min(r) for r in rounds) / 1e9
        lines.append(f"  {name:10s} {' '.join(f'{nbytes / s / 1e9:6.1f}' for s in seconds)} GB/s, best "
                     f"{bests[name]:6.1f} | {' '.join(f'{s * 1e3:.3f}' for s in seconds)} ms")
    for label, gbs in (("medians", medians), ("bests", bests)):
        ceiling = gbs["stream"]
        better = max(ceiling, gbs["one linear"])
        lines.append(f"{label}: ceiling (stream) {ceiling:.1f} GB/s; the step {gbs['step']:.1f} GB/s = "
                     f"{gbs['step'] / ceiling:.3f} of it ({gbs['step'] / better:.3f} of the better read, "
                     f"{better:.1f} GB/s); the linears alone {gbs['linears']:.1f} GB/s = "
                     f"{gbs['linears'] / ceiling:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL, help="model folder (default: the tiny Qwen3)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (a lone slot's)")
    parser.add_argument("--input-len", type=int, default=128, help="the step's prompt")
    parser.add_argument("--steps", type=int, default=64, help="decode steps a round")
    parser.add_argument("--repeats", type=int, default=20, help="reads a round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    runner = load_runner(servers.ensure_model(args.model), resolve_device("cpu"), args.dtype)
    runner.set_kv_cache(None, 1)
    binding = StreamBinding(runner.device, args.threads)
    binding.enter()  # this thread reads and steps, as a lone slot's would
    try:
        measured = measure(runner, args)
        print("\n".join(report(measured, f"{runner.config.model_type}, {runner.dtype}, {binding.describe()}")))
    finally:
        binding.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
