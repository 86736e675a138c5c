"""Where a served request's time goes: a sampling profile of the server under load,
folded into the stages a request passes through, next to the CPU time of the server
and the load client (which share this machine).

    python perf/profile_server.py --concurrency 32 --seconds 8

It starts server.py on the tiny perf model (or --model), drives it with
perf/bench_serving.py in a subprocess, records the server with py-spy (all threads,
`--native` off) and folds every sample by the innermost frame that names a stage:

  parse      HTTP parsing and JSON/field validation (http/request, http/protocol, api/requests,
             api/prompts, api/fields)
  tokenise   text -> token ids (only string prompts; token-id prompts skip it)
  schedule   batcher, budgets, engine bookkeeping, delivery to waiting handlers
  forward    the model forward (torch / transformers)
  sample     logits -> tokens (execution/sampling)
  detokenise token ids -> text (execution/detokenizer, tokenizer.decode)
  respond    response JSON and SSE framing (api/responses, api/generation, api/app)
  write      transport writes (http/response, protocol.write)

CPU time comes from /proc, per thread, over the profiled window only (which opens once the
client's requests are flowing, so that building its dataset is not counted): the event loop
thread (the main thread) and the slot threads. py-spy cannot tell a thread that waits from
one that works in C code without a Python frame, so samples are used only to split each
thread's measured CPU time:
- slot threads: samples waiting for a job (ExecutionSlot._run at its queue) are dropped, and
  the CPU time is shared out over the other samples by stage;
- the loop thread: each sample in a Python stage counts 1/rate seconds; what its CPU time has
  beyond those is "loop": uvloop's own C code and the socket system calls.
Wall-clock time spent waiting in the queue is not CPU: it comes from the server's own
xllm:request_queue_time_seconds histogram.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

import servers

# (stage, fragments of a frame that place a sample in it), checked innermost frame first.
STAGES = [
    ("sample", ("execution/sampling.py",)),
    ("detokenise", ("execution/detokenizer.py", "tokenization_utils", "decode (")),
    ("tokenise", ("encode (", "apply_chat_template")),
    ("forward", ("torch/", "transformers/", "model_runner.py")),
    ("parse", ("http/request.py", "http/protocol.py", "api/requests.py", "api/prompts.py", "api/fields.py",
               "parse_json")),
    ("respond", ("api/responses.py", "api/generation.py", "api/app.py", "access_log.py")),
    ("write", ("http/response.py",)),
    ("schedule", ("engine/", "runtime/executor.py", "metrics.py")),
]
IDLE = ("Condition.wait", "SimpleQueue.get", "_wait_for_tstate_lock", "Event.wait", "select (", "epoll")
SLOT_WAITING = "ExecutionSlot._run ("  # innermost frame of a slot thread blocked in its queue's get (C code)
STAGE_NAMES = ["parse", "tokenise", "schedule", "forward", "sample", "detokenise", "respond", "write"]


def stage_of(frames: list[str]) -> str:
    """The stage of one sample; 'idle' for a thread that waits, 'loop' for C code with no Python frame."""
    if not frames:  # the loop's C code, or a thread waiting outside Python
        return "loop"
    innermost = frames[-1]
    if any(mark in innermost for mark in IDLE) or innermost.startswith(SLOT_WAITING):
        return "idle"
    for frame in reversed(frames):
        for stage, marks in STAGES:
            if any(mark in frame for mark in marks):
                return stage
    return "loop"


def fold(raw_path: str) -> dict[str, dict[str, int]]:
    """{thread kind: {stage: samples}} from py-spy's raw (collapsed) output."""
    table: dict[str, dict[str, int]] = collections.defaultdict(collections.Counter)
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            thread = "slot" if "xllm-slot" in frames[0] else ("loop" if "MainThread" in frames[0] else "other")
            table[thread][stage_of(frames[1:])] += int(count)
    return table


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def stat_cpu_seconds(stat_path: str) -> float:
    """User + system CPU seconds from a /proc .../stat file (a process's or one thread's)."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of the main (event loop) thread and of all the others, from /proc."""
    seconds = {"loop": 0.0, "slot": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu = stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # a thread that just ended
            continue
        seconds["loop" if int(tid) == pid else "slot"] += cpu
    return seconds


def stage_seconds(table: dict[str, dict[str, int]], cpu: dict[str, float], rate: int) -> dict[str, float]:
    """Each stage's CPU seconds over the window (see the module's docstring for how)."""
    seconds = collections.Counter()
    slot = {stage: n for stage, n in table.get("slot", {}).items() if stage != "idle"}
    busy = sum(slot.values())
    for stage, n in slot.items():
        seconds[stage] += cpu["slot"] * n / busy
    python = 0.0
    for stage, n in table.get("loop", {}).items():
        if stage not in ("idle", "loop"):
            seconds[stage] += n / rate
            python += n / rate
    seconds["loop"] += max(cpu["loop"] - python, 0.0)
    return dict(seconds)


def metric(port: int, name: str) -> float:
    return servers.scrape_metrics(port).get(name, 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: perf/results/models/qwen3-tiny, built once)")
    parser.add_argument("--server-args", default="", help="extra server.py flags, e.g. '--scheduler continuous'")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--random-input", type=int, default=320)
    parser.add_argument("--random-output", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=8, help="how long to profile, once the load runs")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(py_spy):
        raise SystemExit("needs py-spy: pip install py-spy (make profile does it)")
    raw = os.path.join(tempfile.mkdtemp(), "profile.txt")
    try:
        model = servers.ensure_model(args.model)
        command = servers.server_command(model, args.server_args.split())
        with servers.running_server(command, servers.server_log("profile", "server")) as server:
            figures = profile_under_load(server, py_spy, raw, args)
    except servers.ServerError as exc:
        print(f"profile_server: {exc}", file=sys.stderr)
        return 1
    report(fold(raw), figures, args)
    return 0


def profile_under_load(server: servers.RunningServer, py_spy: str, raw: str, args: argparse.Namespace) -> dict:
    """Drive the server with bench_serving in a subprocess and record it with py-spy into raw;
    returns what was measured over the recorded window."""
    port = server.port
    prompts = max(200, int(args.seconds * 1000))  # more than the load can finish while profiled
    client = subprocess.Popen(
        [sys.executable, os.path.join(servers.PERF_DIR, "bench_serving.py"), "--base-url", server.base_url,
         "--random-input", str(args.random_input), "--random-output", str(args.random_output),
         "--num-prompts", str(prompts), "--max-concurrency", str(args.concurrency), "--disable-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=servers.ROOT)
    try:
        wait_for_load(port, client)
        done_before = metric(port, "xllm:e2e_request_latency_seconds_count")
        queue_before = metric(port, "xllm:request_queue_time_seconds_sum")
        server_before, client_before = thread_cpu_seconds(server.pid), stat_cpu_seconds(f"/proc/{client.pid}/stat")
        started = time.monotonic()
        subprocess.run([py_spy, "record", "-p", str(server.pid), "-d", str(int(args.seconds)), "-r", str(args.rate),
                        "-f", "raw", "-o", raw, "--threads", "--nonblocking"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.monotonic() - started
        server_after, client_after = thread_cpu_seconds(server.pid), stat_cpu_seconds(f"/proc/{client.pid}/stat")
        return {"done": metric(port, "xllm:e2e_request_latency_seconds_count") - done_before, "wall": wall,
                "queue": metric(port, "xllm:request_queue_time_seconds_sum") - queue_before,
                "cpu": {k: server_after[k] - server_before[k] for k in server_after},
                "client_cpu": client_after - client_before}
    finally:
        client.kill()
        client.wait()


def wait_for_load(port: int, client: subprocess.Popen, timeout: float = 300.0) -> None:
    """Until the client's requests flow: it builds its dataset first, on the same cores."""
    deadline = time.monotonic() + timeout
    first = metric(port, "xllm:e2e_request_latency_seconds_count")
    while metric(port, "xllm:e2e_request_latency_seconds_count") < first + 50:
        if client.poll() is not None:
            raise servers.ServerError(f"the load client exited with {client.returncode} before its load began")
        if time.monotonic() > deadline:
            raise servers.ServerError(f"no load after {timeout:.0f} s")
        time.sleep(0.2)


def report(table: dict, figures: dict, args: argparse.Namespace) -> None:
    done, wall, cpu = figures["done"], figures["wall"], figures["cpu"]
    rate = done / wall
    per_request = 1000 / done  # seconds over the window -> ms per request
    print(f"load: concurrency {args.concurrency}, {args.random_input} tokens in, {args.random_output} out; "
          f"{rate:.0f} req/s over {wall:.1f} s profiled; server flags: {args.server_args or '(defaults)'}")
    print(f"CPU per request: server {(cpu['loop'] + cpu['slot']) * per_request:.3f} ms (event loop thread "
          f"{cpu['loop'] * per_request:.3f}, slot threads {cpu['slot'] * per_request:.3f}), load client "
          f"{figures['client_cpu'] * per_request:.3f} ms; the machine has {os.cpu_count() / rate * 1000:.2f} "
          f"core-ms per request ({os.cpu_count()} cores)")
    print(f"mean wait in the queue: {figures['queue'] * per_request:.2f} ms per request (wall clock, not CPU)")
    stages = STAGE_NAMES + ["loop", "idle"]
    print(f"\n{'thread':<7}" + "".join(f"{s:>11}" for s in stages) + "   (% of that thread's samples)")
    for thread in ("loop", "slot"):
        counts = table.get(thread, {})
        total = sum(counts.values()) or 1
        print(f"{thread:<7}" + "".join(f"{100 * counts.get(s, 0) / total:>10.1f}%" for s in stages))
    seconds = stage_seconds(table, cpu, args.rate)
    total = sum(seconds.values()) or 1
    print("\nserver CPU by stage (measured thread CPU, split by the samples):")
    for stage, value in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {stage:<11} {100 * value / total:5.1f}%  {value * per_request:.3f} ms per request")


if __name__ == "__main__":
    sys.exit(main())
