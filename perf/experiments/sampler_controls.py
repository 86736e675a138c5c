"""What the token controls cost the sampler: sample() before they existed against sample() now.

With no row of a batch setting any control, GenerationBatch passes controls=None and sample()
must cost what it cost before (issue 46's target: unchanged, A/B within noise). This loads the
sampler of an earlier revision (--before, default the merge base with main) from git beside the
current one and times both on the same logits, interleaved over rounds, at SmolLM2's vocabulary
(49,152) for 1, 8 and 32 rows, greedy and sampled (temperature 0.8, seeded; no top_p, whose sort of the
vocabulary would dwarf every other cost: it is the same code before and after). For scale it
also times the current sampler with penalties and a logit_bias on every row (prompts of 256
tokens, 64 generated).

    .venv/bin/python perf/experiments/sampler_controls.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from xllm_async.engine.params import SamplingParams, TokenControls  # noqa: E402
from xllm_async.execution import sampling as after  # noqa: E402
from xllm_async.execution.token_controls import RowControls  # noqa: E402

VOCAB = 49152  # SmolLM2's


def sampler_at(revision: str) -> types.ModuleType:
    """execution/sampling.py as it was at `revision`, importable beside today's (its relative
    imports resolve in today's package)."""
    source = subprocess.run(["git", "show", f"{revision}:xllm_async/execution/sampling.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("xllm_async.execution._sampling_before")
    module.__package__ = "xllm_async.execution"
    exec(compile(source, f"{revision}:sampling.py", "exec"), module.__dict__)
    return module


def merge_base() -> str:
    return subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def timed(cases: dict, repeat: int) -> dict[str, float]:
    """Median microseconds of one call of each case, over `repeat` calls each, the cases taking
    turns call by call (so that a busy moment of the machine falls on all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, call in cases.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=None, help="the revision to compare with (default: merge base with main)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=50, help="calls timed per case and round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a slot's step runs on its cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    revision = args.before or merge_base()
    before = sampler_at(revision)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}; torch {torch.__version__}, {args.threads} thread(s); before = {revision[:10]}")
    rng = torch.Generator().manual_seed(0)
    kinds = {"greedy": SamplingParams(temperature=0.0),
             "sampled": SamplingParams(temperature=0.8, seed=1)}
    controls = TokenControls(logit_bias={5: 3.0, 17: -2.0}, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.2)
    results: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for rows in (1, 8, 32):
            logits = torch.randn(rows, VOCAB, generator=rng) * 4
            controlled = logits.clone()  # (the controls change it in place)
            prompt = torch.randint(0, VOCAB, (256,), generator=rng).tolist()
            output = torch.randint(0, VOCAB, (64,), generator=rng).tolist()
            states = [RowControls(controls, prompt, output, frozenset({2})) for _ in range(rows)]
            for kind, params in kinds.items():
                plist = [params] * rows
                gens = [[after.make_generator(params, torch.device("cpu"), i) for i in range(rows)] for _ in range(3)]
                cases = {
                    "before": partial(before.sample, logits, plist, gens[0]),
                    "after, none set": partial(after.sample, logits, plist, gens[1], None),
                    # (They change these logits in place, call after call: the same work each time, no copy.)
                    "after, penalties + bias, all rows": partial(after.sample, controlled, plist, gens[2], states),
                }
                repeat = args.repeat if kind == "greedy" else max(5, args.repeat // 3)  # (a sampled step is slow)
                for call in cases.values():
                    call()  # warm
                for name, micros in timed(cases, repeat).items():
                    results.setdefault((rows, kind, name), []).append(micros)
    print(f"{'rows':>4} {'kind':<8} {'case':<38} {'median us':>10} {'min..max of rounds':>20}")
    for (rows, kind, name), values in results.items():
        print(f"{rows:>4} {kind:<8} {name:<38} {statistics.median(values):>10.1f} "
              f"{min(values):>9.1f}..{max(values):<9.1f}")


if __name__ == "__main__":
    main()
