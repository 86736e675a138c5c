"""What the LM head's fused top-k (csrc/head_topk.cpp, issue 49) saves a decode step that samples
with top_k: the step as a slot runs such a batch (ModelRunner.decode_top, then
top_sampling.sample_top over each row's candidates) against the step before it (ModelRunner.decode's
float32 [rows, vocab] logits, then sampling.sample), in one process, short rounds interleaved (the
order alternating), each round a fresh prefill, freshly seeded generators and `--steps` steps of
each way; the figure is the median of the rounds' ratios. It checks that both ways sample the same
tokens (the same seeds: top_sampling.py's claim).

    .venv/bin/python perf/experiments/head_topk.py --threads 1 --rows 1,8 --rounds 12

Measured (session 32, EPYC Zen 4, 2 vCPUs shared, load 2-3.5; SmolLM2-135M bf16, top_k 40, T 0.8, 1 thread,
12 rounds): 1 row 12.3 -> 10.9 ms (0.88x), 8 rows 29.3 -> 19.8 ms (0.69x); top_p 0.95: 0.84x, 0.57x;
same tokens (perf/RESULTS.md, "One client's decode").
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path)
import servers
import torch  # noqa: E402

import xllm_async  # noqa: F401  (OpenMP spinning and the malloc arena, set before torch loads)
from xllm_async.engine.params import SamplingParams  # noqa: E402
from xllm_async.execution.sampling import argmax_rows, sample  # noqa: E402
from xllm_async.execution.top_sampling import sample_top, width_for  # noqa: E402
from xllm_async.runtime.device import StreamBinding, resolve_device  # noqa: E402
from xllm_async.runtime.model_runner import load_runner  # noqa: E402


def steps(runner, prompts, params, count: int, fused: bool):
    """The prompts' prefill, then `count` decode steps one way: each step's wall seconds, and the tokens."""
    prefilled = runner.prefill(prompts, max(map(len, prompts)) + count + 1)
    kv, token = prefilled.cache, argmax_rows(prefilled.logits)
    gens = [torch.Generator().manual_seed(p.seed) for p in params]
    seconds, tokens = [], []
    width = width_for(params, runner.vocab_size)
    for _ in range(count):
        wall = time.perf_counter()
        if fused:
            top = runner.decode_top(kv, token, width)
            token = sample_top(top.values, top.columns, top.nans, params, gens, top.vocab,
                               lambda rows, h=top.hidden: runner.logits(h[rows]))
        else:
            token = sample(runner.decode(kv, token), params, gens)[0]
        seconds.append(time.perf_counter() - wall)
        tokens.append(token)
    return seconds, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--rows", default="1,8", help="decode rows (clients), comma-separated")
    parser.add_argument("--steps", type=int, default=12, help="decode steps a way a round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args(argv)
    runner = load_runner(servers.ensure_model(args.model), resolve_device("cpu"), args.dtype)
    runner.set_kv_cache(None, 1)
    if not runner.picks_top:
        raise SystemExit("head_topk: this model and CPU have no fused top-k (cpu_kernels.head_topk)")
    binding = StreamBinding(runner.device, args.threads)
    binding.enter()
    rng = random.Random(0)
    print(f"{runner.config.model_type}, {runner.dtype}, vocab {runner.vocab_size}, {binding.describe()}, "
          f"a {args.input_len}-token prompt a row, top_k 40, temperature 0.8, top_p {args.top_p}, "
          f"{args.steps} steps a way a round, {args.rounds} rounds")
    try:
        with torch.inference_mode():
            for rows in [int(r) for r in args.rows.split(",")]:
                prompts = [[rng.randrange(1000, min(runner.vocab_size, 40000)) for _ in range(args.input_len)]
                           for _ in range(rows)]
                params = [SamplingParams(temperature=0.8, top_k=40, top_p=args.top_p, seed=11 + r) for r in range(rows)]
                steps(runner, prompts, params, 4, True)  # unmeasured: first shapes allocate
                steps(runner, prompts, params, 4, False)
                took = {True: [], False: []}
                picked = {}
                for round_ in range(args.rounds):
                    for fused in ((True, False) if round_ % 2 == 0 else (False, True)):
                        seconds, tokens = steps(runner, prompts, params, args.steps, fused)
                        took[fused].append(statistics.median(seconds) * 1e3)
                        picked.setdefault(fused, tokens)
                same = picked[True] == picked[False]
                ratios = [f / g for f, g in zip(took[True], took[False])]
                print(f"{rows} rows: step ms, medians over rounds: logits {statistics.median(took[False]):.2f}, "
                      f"fused {statistics.median(took[True]):.2f}; fused/logits, median of per-round ratios "
                      f"{statistics.median(ratios):.3f} (quartiles "
                      f"{' '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=4))}); "
                      f"{'same tokens' if same else 'DIFFERENT TOKENS'}")
                if not same:
                    return 1
    finally:
        binding.exit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
