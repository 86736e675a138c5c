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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from xllm_async.random_model import build_qwen3

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

    def __init__(self, args: list[str], env: dict | None = None, timeout: float = 180, port: int | None = None) -> None:
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
        self._wait_ready(timeout)

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
                time.sleep(0.2)
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


CONFIGS = {
    "fixed_steps-N2": ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "2"],
    "fixed_steps-N1": ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "1"],
    "continuous-N1": ["--scheduler", "continuous", "--concurrent-execute-stream-num", "1"],
}


@pytest.fixture(scope="session")
def servers(tiny_model_dir):
    started: dict[str, ServerProcess] = {}

    def get(name: str) -> ServerProcess:
        if name not in started:
            started[name] = ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny",
                                           "--max-seqs-per-batch", "8", *CONFIGS[name]])
        return started[name]

    yield get
    for server in started.values():
        server.stop()


@pytest.fixture(params=list(CONFIGS), scope="session")
def any_server(request, servers) -> ServerProcess:
    """Each test using this runs once per scheduler/stream configuration."""
    return servers(request.param)


@pytest.fixture(scope="session")
def server(servers) -> ServerProcess:
    """The default configuration (fixed_steps, N=2)."""
    return servers("fixed_steps-N2")
