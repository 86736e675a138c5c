"""The servers the perf scripts measure: the model folder they use by default, and server
subprocesses that live exactly as long as a `with` block.

    with running_server(server_command(ensure_model(None), ["--scheduler", "continuous"]),
                        server_log("soak", "continuous")) as server:
        ...  # server.base_url answers /health with 200

A server is started on a free loopback port (`--port P` is added to its command: every server
the scripts run takes it), with its output appended to a log file, and waited for until /health
answers 200. If it exits first, is not healthy within START_TIMEOUT, or exits while in use, a
ServerError says so with the end of its log. However the block ends, the server is stopped:
SIGTERM, then SIGKILL after STOP_TIMEOUT. A server that spawns worker processes (LitServe) is
started in a process group of its own, and what is left of that group is killed at the end: only
processes started here are ever signalled.

perf/ is a folder of scripts, not a package: the scripts import this module, and each other, by
name, with perf/ on sys.path (Python puts a script's own folder there).
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

PERF_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(PERF_DIR)
DEFAULT_MODEL = os.path.join(PERF_DIR, "results", "models", "qwen3-tiny")
HOST = "127.0.0.1"  # loopback only: the scripts measure this machine
START_TIMEOUT = 300.0  # seconds for a server to load the model and answer /health
STOP_TIMEOUT = 20.0  # seconds between SIGTERM and SIGKILL


class ServerError(Exception):
    """A server the script needs cannot be had (no model folder, it exited, it never became
    healthy): one message for the user, with the end of the server's log where there is one."""


# --- the model -------------------------------------------------------------------------------


def ensure_model(path: str | None) -> str:
    """The model folder as an absolute path (servers run from the repository root). Without a path,
    or at DEFAULT_MODEL, a tiny random Qwen3 built the first time it is needed (nothing is downloaded)."""
    path = os.path.abspath(path or DEFAULT_MODEL)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if path != DEFAULT_MODEL:
        raise ServerError(f"--model {path}: no config.json there")
    print(f"building the tiny random Qwen3 at {path} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "xllm_async.testing.random_model", path, "--size", "tiny"], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL)
    return path


def ensure_random_model(size: str) -> str:
    """perf/results/models/qwen3-<size>: a random Qwen3 of xllm_async.testing.random_model's SIZES, built once."""
    path = os.path.join(PERF_DIR, "results", "models", f"qwen3-{size}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"building the {size} random Qwen3 at {path} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "xllm_async.testing.random_model", path, "--size", size], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL)
    return path


# --- servers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunningServer:
    """A server that answers /health: where to reach it, and its process id (for CPU time and the
    profiler; also the id of its process group when it was started in one of its own)."""

    port: int
    pid: int

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


def server_command(model: str, args: list[str]) -> list[str]:
    """server.py on the model with the given flags, run by this Python; the access log is off, as
    writing it would be part of every measured request. A first argument `@PATH` runs PATH/server.py
    instead: another checkout of the project (a worktree of an older commit, for an A/B), whose
    server.py imports its own package."""
    root = ROOT
    if args and args[0].startswith("@"):
        root, args = os.path.abspath(args[0][1:]), args[1:]
    return [sys.executable, os.path.join(root, "server.py"), "--model", model, "--access-log", "off", *args]


def server_log(folder: str, name: str) -> str:
    """perf/results/<folder>/<name>.log, its folder made: where a script keeps its servers' logs."""
    os.makedirs(os.path.join(PERF_DIR, "results", folder), exist_ok=True)
    return os.path.join(PERF_DIR, "results", folder, f"{name}.log")


@contextmanager
def running_server(command: list[str], log_path: str, name: str = "server",
                   own_group: bool = False) -> Iterator[RunningServer]:
    """The command plus `--port P` on a free port, its output appended to log_path, from the moment
    /health answers 200 until the block ends; stopped however the block ends. own_group: start it in
    a process group of its own and kill all of that group at the end (servers that spawn workers)."""
    port = free_port()
    with open(log_path, "ab") as log:
        log.write(f"\n=== {datetime.now().isoformat(timespec='seconds')} {name} :{port}\n".encode())
        log.flush()
        proc = subprocess.Popen([*command, "--port", str(port)], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=own_group)
    try:
        wait_healthy(proc, port, name, log_path)
        yield RunningServer(port, proc.pid)
        if (code := exit_code(proc)) is not None:  # what was just measured was measured against a dead server
            raise server_error(f"{name} exited with {code} while in use", log_path)
    finally:
        stop_server(proc, own_group)


def scrape_metrics(port: int) -> dict[str, float]:
    """The server's unlabelled /metrics values by name: counters, gauges, histogram sums and counts."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, name: str, log_path: str) -> None:
    """Returns once /health answers 200; a ServerError if the server exits first or START_TIMEOUT passes."""
    deadline = time.monotonic() + START_TIMEOUT
    while not health_ok(port):
        if (code := exit_code(proc)) is not None:
            raise server_error(f"{name} exited with {code} before answering /health", log_path)
        if time.monotonic() > deadline:
            raise server_error(f"{name} did not answer /health within {START_TIMEOUT:g} s", log_path)
        time.sleep(0.2)


def health_ok(port: int) -> bool:
    conn = http.client.HTTPConnection(HOST, port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def server_error(what: str, log_path: str, lines: int = 20) -> ServerError:
    """A ServerError saying what happened, with the end of the server's log: usually the reason."""
    with open(log_path, errors="replace") as f:
        tail = "".join(f.readlines()[-lines:])
    return ServerError(f"{what}; the end of {log_path}:\n{tail}")


def exit_code(proc: subprocess.Popen) -> int | None:
    """The exit code as Popen gives it (-N: killed by signal N), None while the process runs. It is not
    reaped: until then its id, and its process group's, cannot be given to a process we did not start."""
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def stop_server(proc: subprocess.Popen, own_group: bool) -> None:
    """SIGTERM (the server drains what it admitted), then SIGKILL after STOP_TIMEOUT: to the server,
    or to whatever is left of its own process group (workers its SIGTERM did not stop)."""
    # os.kill, not Popen's methods: those reap a process that has exited, and its id could then be reused.
    if exit_code(proc) is None:
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while exit_code(proc) is None and time.monotonic() < deadline:
            time.sleep(0.1)
    kill = os.killpg if own_group else os.kill
    try:
        kill(proc.pid, signal.SIGKILL)  # harmless on a process that has exited but is not reaped yet
    except ProcessLookupError:  # nothing left of the group
        pass
    proc.wait()


def interrupt_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C: without this Python would end without running `finally` blocks,
    and the servers running_server started would outlive the script."""

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
