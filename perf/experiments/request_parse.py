"""A request body's validation on the loop, timed in-process (issue 50's speed guard):
perf/sweep.py's streamed completion (320 token ids, max_tokens 1) parsed into a GenerationSpec N times,
in this checkout and in another (--other DIR), each in a subprocess of its own, rounds interleaved;
medians of the per-round best batch means (thread CPU time), in microseconds a request. Also the
engine requests and response shape a generation builds from the spec, for the same spec.

    .venv/bin/python perf/experiments/request_parse.py --other /tmp/wt-before [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "perf/results/models/qwen3-tiny")


def child(checkout: str, model_dir: str, n: int) -> None:
    """Prints 'parse build' microseconds a request, the mean over n."""
    sys.path.insert(0, checkout)
    import orjson
    from transformers import AutoTokenizer

    from xllm_async.api.model_info import ModelInfo
    from xllm_async.api.requests import parse_completion, parse_json
    from xllm_async.api.responses import CompletionShape
    from xllm_async.engine.output import OutputStream
    from xllm_async.engine.request import EngineRequest

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = ModelInfo("m", tokenizer, len(tokenizer), 4096, 16)
    rng = random.Random(0)
    body = orjson.dumps({"model": "m", "prompt": [rng.randrange(100, 5000) for _ in range(320)], "max_tokens": 1,
                         "temperature": 0.0, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}})
    spec = parse_completion(parse_json(body), model)

    def parse() -> None:
        parse_completion(parse_json(body), model)

    def build() -> None:
        stream = OutputStream(1)
        [EngineRequest(i, spec.prompts[0], spec.params, stream) for i in range(1)]
        CompletionShape(model.name, tokenizer, "cmpl", 320, False)

    print(" ".join(f"{best_of(work, n):.3f}" for work in (parse, build)))


def best_of(work, n: int, batches: int = 20) -> float:
    """Microseconds of thread CPU time a call: the least of `batches` batches' means (the batch
    least disturbed by whatever else shares the core)."""
    clock = time.thread_time
    size = max(1, n // batches)
    for _ in range(size):  # warm
        work()
    best = float("inf")
    for _ in range(batches):
        started = clock()
        for _ in range(size):
            work()
        best = min(best, (clock() - started) / size * 1e6)
    return best


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="another checkout, measured first in each round")
    parser.add_argument("--this", default=ROOT)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("-n", type=int, default=20000)
    args = parser.parse_args()
    results = {"other": [], "this": []}
    for r in range(args.rounds):
        order = [("other", args.other), ("this", args.this)]
        for name, checkout in order if r % 2 == 0 else reversed(order):
            out = subprocess.run([sys.executable, __file__, "--child", os.path.abspath(checkout), args.model,
                                  str(args.n)], check=True, capture_output=True, text=True, cwd="/tmp").stdout
            results[name].append([float(v) for v in out.split()])
    for i, what in enumerate(("parse_completion", "requests+shape")):
        a = statistics.median(row[i] for row in results["other"])
        b = statistics.median(row[i] for row in results["this"])
        print(f"{what:18s} other {a:7.2f} us  this {b:7.2f} us  this-other {b - a:+6.2f} us  "
              f"(rounds: other {[round(row[i], 1) for row in results['other']]}, "
              f"this {[round(row[i], 1) for row in results['this']]})")


if __name__ == "__main__":
    main()
