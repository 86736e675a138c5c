"""Structured outputs' and token controls' cost (issue 46): decoding tokens/s with a json_schema
grammar (or with penalties, `--controls penalties`) against the same requests plain, at 8 clients,
on one server.

    .venv/bin/python perf/structured.py                         # the default model (SmolLM2), 64 prompts
    .venv/bin/python perf/structured.py --num-prompts 16 --output-len 64   # a quick look
    .venv/bin/python perf/structured.py --controls penalties    # the three penalties on every request

The server (fixed_steps, N=2 unless --server-args) is started here on the model `make serve`
serves (SmolLM2-135M-Instruct, bf16) unless --model names a folder. Both runs send the same random
chat prompts (--input-len tokens of text), greedy, with ignore_eos and --output-len tokens each,
as perf/bench_serving.py does. The constrained run adds a response_format whose schema cannot be
finished within that budget (a list of at least LONG_LIST records), so that every answer runs
its full length in both runs and the batches stay equally full: what differs is the grammar's work
(a matcher fills each row's bitmask, xgrammar's kernel applies it, the matcher accepts the token).
One warm-up request of each kind goes first, so the schema's compilation is not measured (it is
cached by its spec). The runs alternate --rounds times; the table shows each run's output tokens/s
and the ratio of the medians. Never a final figure on a machine that others are using.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import bench_serving
import servers

LONG_LIST = 1000
# Records of a string, an integer, a boolean and an enum. No maxLength on the string: xgrammar fills a
# bounded string's mask without its token cache, milliseconds a row instead of microseconds.
ITEM = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                                         "ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "count", "ok", "colour"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": LONG_LIST, "items": ITEM}},
          "required": ["items"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answers", "schema": SCHEMA, "strict": True}}
# What the second run adds to every request. Penalties: vLLM's three at once, over the prompt's and
# the answer's tokens (they change which tokens win, not how many are made: ignore_eos holds the length).
CONTROLS = {"json_schema": {"response_format": RESPONSE_FORMAT},
            "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}}


def default_model() -> str:
    """The folder `make serve` serves (SmolLM2-135M-Instruct, converted once into the cache)."""
    from xllm_async.config import Settings
    from xllm_async.runtime.default_model import default_model_dir

    return default_model_dir(Settings().cache_dir)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


async def measure(base_url: str, prompts, tokenizer, model: str, extra: dict | None, concurrency: int) -> dict:
    metrics = await bench_serving.benchmark(base_url, prompts, tokenizer=tokenizer, model=model,
                                            endpoint="/v1/chat/completions", max_concurrency=concurrency,
                                            stream=True, warmup_requests=1, extra_body=extra)
    if metrics["failed"]:
        raise bench_serving.BenchmarkError(f"{metrics['failed']} requests failed: {metrics['first_error']}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, as `make serve`)")
    parser.add_argument("--server-args", default="--scheduler fixed_steps --concurrent-execute-stream-num 2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="unconstrained and constrained runs, alternating")
    parser.add_argument("--controls", choices=sorted(CONTROLS), default="json_schema",
                        help="what the second run adds to each request")
    parser.add_argument("--output-file", help="append the figures as one JSON line")
    args = parser.parse_args(argv)
    model = servers.ensure_model(args.model) if args.model else default_model()
    tokenizer = bench_serving.load_tokenizer(model)
    prompts = bench_serving.make_random_prompts(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                                prompt_format="text")
    runs: dict[str, list[float]] = {"plain": [], args.controls: []}
    command = servers.server_command(model, args.server_args.split())
    with servers.running_server(command, servers.server_log("structured", "server")) as server:
        info = bench_serving.run(bench_serving.fetch_model_info(server.base_url))
        for _ in range(args.rounds):
            for name in runs:
                metrics = bench_serving.run(measure(server.base_url, prompts, tokenizer, info["id"],
                                                    CONTROLS.get(name), args.concurrency))
                runs[name].append(metrics["output_throughput"])
                print(f"{name:>13}: {metrics['output_throughput']:8.1f} output tokens/s "
                      f"({metrics['total_output_tokens']} tokens, {metrics['duration']:.1f} s)", flush=True)
    plain, controlled = (statistics.median(runs[name]) for name in runs)
    per_round = [c / p for p, c in zip(runs["plain"], runs[args.controls])]
    result = {"model": model, "cpu": cpu_name(), "concurrency": args.concurrency, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "server_args": args.server_args,
              "controls": args.controls, "plain_tokens_per_s": runs["plain"],
              "controlled_tokens_per_s": runs[args.controls], "ratio": controlled / plain, "per_round": per_round}
    print(f"\n| run | output tokens/s (median of {args.rounds}) |\n|---|---|\n| plain | {plain:.1f} |\n"
          f"| {args.controls} | {controlled:.1f} |\n\n{args.controls} / plain = {controlled / plain:.3f} "
          f"(rounds {', '.join(f'{r:.2f}' for r in per_round)}) at {args.concurrency} clients on {cpu_name()}")
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
