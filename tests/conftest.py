"""Shared fixtures: a tiny random Qwen3 folder, a reference model, real servers
started as subprocesses (one per configuration, shared by the whole session)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time

import pytest

import xllm_async  # noqa: F401  (torch_npu autoload switch before torch)

from .hold import Hold

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONTEXT = 256


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "kernel(name): a test of our CPU kernel `name` (cpu_kernels.verified()): "
                            "skipped on a CPU without its instructions, failed on one with them where it did not "
                            "build or verify")


def require_kernel(name: str) -> None:
    """Go on with a test of our CPU kernel `name` only where it built and verified here. Where it
    did not: a skip on a CPU without the instructions our kernels need (the eager code serves
    there), a failure on one with them: a skip would let CI pass on a kernel that computes wrong."""
    from xllm_async.model import cpu_kernels

    if cpu_kernels.verified()[name]:
        return
    have = cpu_kernels.instruction_sets()
    if have:
        why = cpu_kernels.load_failure() or "its start-up check failed: see the log's warning"
        pytest.fail(f"our {name} kernel did not build or verify on this CPU, which has "
                    f"{' and '.join(cpu_kernels.ISA_NAMES[i] for i in have)}: {why}", pytrace=False)
    pytest.skip(f"no AVX512-BF16 here: our {name} kernel is not built")


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("kernel"):
        require_kernel(mark.args[0])


def pytest_terminal_summary(terminalreporter) -> None:
    """One line of what this run's CPU kernels exercised, so a run on a CPU with AMX shows that
    its tiles ran (and one without, that they did not)."""
    from xllm_async.model import cpu_kernels

    have = cpu_kernels.instruction_sets()
    status = cpu_kernels.verified()
    # AMX where the linear (and the prompts' attention, built alike) took its tiles; AVX512-BF16
    # wherever a kernel ran on this CPU's vector paths (all of them without AMX, the rest with it).
    exercised = ["AMX"] if cpu_kernels.our_linear() == "amx" else []
    if "avx512_bf16" in have and any(status.values()):
        exercised.append("AVX512-BF16")
    paths = " and ".join(exercised) or "neither AMX nor AVX512-BF16"
    cpu = " and ".join(cpu_kernels.ISA_NAMES[i] for i in have) or "neither"
    built = ", ".join(name for name, ok in status.items() if ok) or "none"
    missing = ", ".join(name for name, ok in status.items() if not ok)
    terminalreporter.write_line(f"CPU kernels: this CPU has {cpu}; our kernels ran on {paths}; built and "
                                f"verified: {built}" + (f"; not: {missing}" if missing else ""))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from xllm_async.testing.random_model import build_qwen3

    return build_qwen3(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"),
                       max_position_embeddings=TINY_CONTEXT)


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """The same folder loaded by plain transformers, for per-request generate()."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                 dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    generate.model = model
    generate.tokenizer = tokenizer
    return generate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """server.py in a subprocess on a free loopback port."""

    def __init__(self, args: list[str], env: dict | None = None, timeout: float = 180, port: int | None = None,
                 wait: bool = True) -> None:
        self.port = port or free_port()  # a given port: a replica restarted where its balancer expects it
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"xllm-test-{self.port}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115  (open for the server's whole life)
        self.hold = Hold()  # tests hold its forwards through this, never through timing
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "server.py"), "--port", str(self.port), *args],
            # float32 unless a test says otherwise: answers are compared with transformers' float32 ones.
            stdout=self._log, stderr=subprocess.STDOUT,
            env={"XLLM_DTYPE": "float32", **os.environ, **self.hold.env, **(env or {})},
            cwd=ROOT,
        )
        self.timeout = timeout
        if wait:  # (wait=False: the caller calls wait_ready(), as start_together does)
            self.wait_ready()

    def wait_ready(self) -> ServerProcess:
        self._wait_ready(self.timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.05)  # (a start-up takes seconds: a check every 50 ms costs nothing)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
        self.hold.remove()


def start_together(*specs: tuple[list[str], dict | None]) -> list[ServerProcess]:
    """Servers of (args, env) each, started at once and waited for together: a start-up is mostly
    one core's work (imports, the model's load), so two take about the time of one on two cores."""
    started = []
    try:
        for args, env in specs:
            started.append(ServerProcess(args, env, wait=False))
        return [server.wait_ready() for server in started]
    except BaseException:
        for server in started:
            server.stop()
        raise


CONFIGS = {
    "fixed_steps-N2": ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "2"],
    "fixed_steps-N1": ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "1"],
    "continuous-N1": ["--scheduler", "continuous", "--concurrent-execute-stream-num", "1"],
}


class ServerPool:
    """Servers of one model and arguments, one per configuration of CONFIGS, started when a test
    first asks for one of them: pool(name). The configurations of `together` (those its tests use)
    start at the first such call, all at once (start_together)."""

    def __init__(self, args: list[str], together: tuple[str, ...] = ()) -> None:
        self.args = args
        self.together = together
        self.started: dict[str, ServerProcess] = {}

    def __call__(self, name: str) -> ServerProcess:
        if name not in self.started:
            names = [name, *(n for n in self.together if n != name and n not in self.started)]
            for n, server in zip(names, start_together(*(([*self.args, *CONFIGS[n]], None) for n in names))):
                self.started[n] = server
        return self.started[name]

    def stop(self) -> None:
        for server in self.started.values():
            server.stop()


@pytest.fixture(scope="session")
def servers(tiny_model_dir):
    pool = ServerPool(["--model", tiny_model_dir, "--served-model-name", "tiny", "--max-seqs-per-batch", "8"],
                      together=tuple(CONFIGS))  # (any_server's tests, in many files, ask for all three)
    yield pool
    pool.stop()


@pytest.fixture(params=list(CONFIGS), scope="session")
def any_server(request, servers) -> ServerProcess:
    """Each test using this runs once per scheduler/stream configuration."""
    return servers(request.param)


@pytest.fixture(scope="session")
def server(servers) -> ServerProcess:
    """The default configuration (fixed_steps, N=2)."""
    return servers("fixed_steps-N2")


CACHED_CONFIGS = {"fixed_steps-N2": ("fixed_steps", "2"), "continuous-N1": ("continuous", "1")}


@pytest.fixture(scope="module")
def cached_servers(tiny_model_dir):
    """Both of cached_server's servers and cold_server's, started together (start_together)."""
    started = start_together(*((["--model", tiny_model_dir, "--served-model-name", "tiny", "--scheduler", scheduler,
                                  "--concurrent-execute-stream-num", slots],
                                 {"XLLM_PREFIX_CACHE": cache, "XLLM_KV_CACHE_BYTES": "64M"})
                                for scheduler, slots, cache in [*((*c, "on") for c in CACHED_CONFIGS.values()),
                                                                 ("fixed_steps", "2", "off")]))
    yield dict(zip([*CACHED_CONFIGS, "cold"], started))
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def cold_server(cached_servers):
    """A server with the prefix cache off (the default is on): what a cached answer must equal."""
    return cached_servers["cold"]


@pytest.fixture(scope="module", params=list(CACHED_CONFIGS))
def cached_server(request, cached_servers):
    """A server with the prefix cache on, under each scheduler (the store lives as long as the module's tests)."""
    return cached_servers[request.param]
