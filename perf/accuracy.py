"""Accuracy, measured: multiple-choice scoring and greedy agreement through /v1/completions, one
fresh server per configuration, the first configuration the reference.

    python perf/accuracy.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct \\
        --config "fp32=--dtype float32" --config "bf16=--dtype bfloat16"
    python perf/accuracy.py --config "bf16=" --config "int8=XLLM_QUANTIZATION=int8"
    python perf/accuracy.py --base-url ref=http://127.0.0.1:8000 --base-url other=http://127.0.0.1:8001

A configuration is NAME=ARGS as in sweep.py: ARGS are server.py flags (`@PATH` first runs another
checkout's server.py), and words of the form VAR=value before them are set in the server's
environment. `--base-url NAME=URL` measures a server already running instead (any
OpenAI-compatible one that takes token-id prompts and `echo`).

Tasks (nothing is downloaded): English prose on this machine (/usr/share/common-licenses and the
docstrings of a fixed list of Python stdlib modules) is split into sentences, and with a fixed
seed (`--seed`) two cloze tasks are drawn (tasks.py builds them):
- `word`: up to 48 words of a passage; the right choice is its next word, 3 distractors are words
  of other documents with the same capitalisation;
- `sentence`: up to 3 sentences; the right choice is the next sentence, 3 distractors are sentences
  of other documents of a similar length.
Each choice is scored as lm-eval-harness's local-completions does: context and choice token ids
(the model's tokenizer, the choice with its leading space) sent as one prompt with `echo: true,
logprobs: 1, max_tokens: 0` (`--score-max-tokens 1` for servers that refuse 0), the choice's
score the sum of its tokens' logprobs. `acc` takes the highest sum, `acc_norm` the highest sum per
character of the choice. Standard errors are binomial (sqrt(p(1-p)/n)); against the reference,
the paired difference and its standard error (the same items answered by both).

Greedy agreement: `--greedy-prompts` passages of the same text (their first 40 words), 32 tokens
each at temperature 0 with `ignore_eos`; against the reference, the fraction of identical texts
and the mean matched prefix in tokens (the tokens the servers' `logprobs` name; both texts
re-tokenized where a server gives none).

The items (400 per task, 128 greedy prompts; `--items` and `--greedy-prompts` take the first ones)
are written once to perf/results/accuracy/items-seed<seed>.json and reused (delete it to draw
again); each configuration's figures are appended to perf/results/accuracy.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import accuracy_tasks as tasks
import servers
from bench_serving import append_json_line, load_tokenizer
from cli import cpu_model

RESULTS = os.path.join(servers.PERF_DIR, "results")
GREEDY_TOKENS = 32


# --- configurations --------------------------------------------------------------------------


def parse_config(text: str) -> tuple[str, dict[str, str], list[str]]:
    """'NAME=VAR=v --flag x' -> (NAME, {VAR: v}, ['--flag', 'x'])."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"accuracy: --config must be NAME=ARGS, got {text!r}")
    words = shlex.split(rest)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-") and words[0].split("=")[0].isidentifier():
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name.strip(), env, words


def server_for(name: str, env: dict[str, str], flags: list[str], model: str):
    """A running_server context for one configuration (env set through `env`, so the pid stays the server's)."""
    command = servers.server_command(model, flags)
    if env:
        command = ["env", *(f"{k}={v}" for k, v in env.items()), *command]
    return servers.running_server(command, servers.server_log("accuracy", name), name)


# --- requests --------------------------------------------------------------------------------


def post(base_url: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"accuracy: {base_url} answered {exc.code}: {exc.read()[:500]!r}") from None


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def choice_logprob(base_url: str, model: str, context: list[int], choice: list[int], max_tokens: int) -> float:
    """The sum of the choice's token logprobs after the context."""
    body = {"model": model, "prompt": context + choice, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0.0}
    logprobs = post(base_url, body)["choices"][0]["logprobs"]["token_logprobs"]
    start = len(context)
    return sum(logprobs[start:start + len(choice)])


def greedy_text(base_url: str, model: str, prompt: list[int]) -> tuple[str, list[str] | None]:
    """The greedy text and its tokens as the server cut them (None where it gives no logprobs)."""
    body = {"model": model, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1}
    choice = post(base_url, body)["choices"][0]
    return choice["text"], ((choice.get("logprobs") or {}).get("tokens"))


# --- measuring -------------------------------------------------------------------------------


def encode_items(tokenizer, items: dict) -> dict:
    """Token ids of every context and choice (choices with their leading space), and greedy prompts."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    encoded = {task: [(ids(item["context"]), [ids(" " + c) for c in item["choices"]]) for item in task_items]
               for task, task_items in items["tasks"].items()}
    return {"tasks": encoded, "greedy": [ids(p) for p in items["greedy"]]}


def measure(base_url: str, items: dict, encoded: dict, args: argparse.Namespace) -> dict:
    """Per task, each item's chosen index by sum (acc) and by sum per character (acc_norm); greedy texts."""
    model = served_model(base_url)
    out: dict = {"tasks": {}}
    pool = ThreadPoolExecutor(args.concurrency)
    try:
        for task, task_items in encoded["tasks"].items():
            jobs = [(i, j, ctx, choice) for i, (ctx, choices) in enumerate(task_items)
                    for j, choice in enumerate(choices)]
            scores = list(pool.map(lambda job: choice_logprob(base_url, model, job[2], job[3], args.score_max_tokens),
                                   jobs))
            per_item: dict[int, list[float]] = {}
            for (i, _j, _ctx, _choice), score in zip(jobs, scores):
                per_item.setdefault(i, []).append(score)
            texts = items["tasks"][task]
            picks, picks_norm = [], []
            for i, sums in sorted(per_item.items()):
                lengths = [len(" " + c) for c in texts[i]["choices"]]
                picks.append(max(range(len(sums)), key=lambda k: sums[k]))
                picks_norm.append(max(range(len(sums)), key=lambda k: sums[k] / lengths[k]))
            out["tasks"][task] = {"acc": [int(p == t["answer"]) for p, t in zip(picks, texts)],
                                  "acc_norm": [int(p == t["answer"]) for p, t in zip(picks_norm, texts)],
                                  "picks": picks}
        out["greedy"] = list(pool.map(lambda prompt: greedy_text(base_url, model, prompt), encoded["greedy"]))
    finally:  # on Ctrl-C too: what is queued is dropped rather than sent
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def binomial(correct: list[int]) -> tuple[float, float]:
    p = sum(correct) / len(correct)
    return p, math.sqrt(p * (1 - p) / len(correct))


def paired(correct: list[int], reference: list[int]) -> tuple[float, float]:
    """The mean difference against the reference on the same items and its standard error."""
    d = [a - b for a, b in zip(correct, reference)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1)
    return mean, math.sqrt(var / len(d))


def agreement(texts: list[tuple], reference: list[tuple], tokenizer) -> tuple[float, float]:
    """The fraction of identical texts and the mean matched prefix in tokens: the servers' own tokens,
    or where either gave none, both texts re-tokenized."""
    same = sum(a[0] == b[0] for a, b in zip(texts, reference)) / len(texts)
    prefixes = []
    for (a, a_tokens), (b, b_tokens) in zip(texts, reference):
        ta, tb = a_tokens, b_tokens
        if ta is None or tb is None:
            ta, tb = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        prefixes.append(n)
    return same, sum(prefixes) / len(prefixes)


def summary_row(name: str, result: dict, reference: dict, tokenizer) -> dict:
    row: dict = {"config": name}
    for task, figures in result["tasks"].items():
        ref = reference["tasks"][task]
        for metric in ("acc", "acc_norm"):
            p, se = binomial(figures[metric])
            diff, diff_se = paired(figures[metric], ref[metric])
            row[f"{task}_{metric}"], row[f"{task}_{metric}_se"] = p, se
            row[f"{task}_{metric}_diff"], row[f"{task}_{metric}_diff_se"] = diff, diff_se
        row[f"{task}_same_pick"] = sum(a == b for a, b in zip(figures["picks"], ref["picks"])) / len(ref["picks"])
    row["greedy_identical"], row["greedy_prefix_tokens"] = agreement(result["greedy"], reference["greedy"], tokenizer)
    return row


def format_rows(rows: list[dict], items: dict) -> str:
    lines = []
    for task, task_items in items["tasks"].items():
        lines.append(f"{task} ({len(task_items)} items, 4 choices; +- binomial SE; diff vs {rows[0]['config']}, "
                     f"paired SE)")
        for r in rows:
            cells = [f"{m} {100 * r[f'{task}_{m}']:.1f} +- {100 * r[f'{task}_{m}_se']:.1f}"
                     f" (diff {100 * r[f'{task}_{m}_diff']:+.1f} +- {100 * r[f'{task}_{m}_diff_se']:.1f})"
                     for m in ("acc", "acc_norm")]
            same = f"   same pick {100 * r[f'{task}_same_pick']:.1f}%"
            lines.append(f"  {r['config']:<16} " + "   ".join(cells) + same)
    lines.append(f"greedy agreement with {rows[0]['config']} ({len(items['greedy'])} prompts, {GREEDY_TOKENS} tokens)")
    for r in rows:
        lines.append(f"  {r['config']:<16} identical {100 * r['greedy_identical']:.1f}%   mean matched prefix "
                     f"{r['greedy_prefix_tokens']:.1f} tokens   ({r['seconds']:.0f} s)")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3, built once)")
    parser.add_argument("--config", action="append", metavar="NAME=ARGS", help="a server configuration, repeatable")
    parser.add_argument("--base-url", action="append", metavar="NAME=URL", help="a running server instead")
    parser.add_argument("--items", type=int, default=100, help=f"items per task (the first of {tasks.ITEMS})")
    parser.add_argument("--greedy-prompts", type=int, default=32, help=f"the first of {tasks.GREEDY}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--score-max-tokens", type=int, default=0, choices=(0, 1))
    parser.add_argument("--output-file", default=os.path.join(RESULTS, "accuracy.jsonl"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    targets = [(*parse_config(c), None) for c in args.config or []]
    targets += [(name, {}, [], url) for name, _, url in (b.partition("=") for b in args.base_url or [])]
    if len(targets) < 1:
        raise SystemExit("accuracy: give at least one --config or --base-url (the first is the reference)")
    servers.interrupt_on_sigterm()
    model = servers.ensure_model(args.model)
    items = tasks.load_or_build(os.path.join(RESULTS, "accuracy", f"items-seed{args.seed}.json"), args.seed)
    items = {"tasks": {task: task_items[:args.items] for task, task_items in items["tasks"].items()},
             "greedy": items["greedy"][:args.greedy_prompts]}
    tokenizer = load_tokenizer(model)
    encoded = encode_items(tokenizer, items)
    results, rows = {}, []
    try:
        for name, env, flags, url in targets:
            print(f"{name}: {'running at ' + url if url else 'starting'}", flush=True)
            context = nullcontext(None) if url else server_for(name, env, flags, model)
            with context as up:
                start = time.monotonic()
                results[name] = measure(url or up.base_url, items, encoded, args)
                seconds = time.monotonic() - start
            row = summary_row(name, results[name], results[targets[0][0]], tokenizer)
            row.update(model_dir=model, seed=args.seed, env=env, flags=flags, base_url=url, cpu=cpu_model(),
                       seconds=seconds)
            append_json_line(args.output_file, row)
            rows.append(row)
    except servers.ServerError as exc:
        print(f"accuracy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("accuracy: interrupted", file=sys.stderr)
        return 130
    print(f"\nmodel {model}; {cpu_model()}")
    print(format_rows(rows, items))
    print(f"rows appended to {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
