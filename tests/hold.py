"""Holding a test server's forwards on files (xllm_async/testing/hold.py), so that a
test keeps a slot busy, a request waiting or a deadline passing for exactly as
long as it needs, on any machine."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time

from xllm_async.testing.hold import ENV


class Hold:
    """The hold folder of one server process."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="xllm-hold-")
        self.env = {ENV: self.folder}

    @contextlib.contextmanager
    def __call__(self, kind: str, passes: int = 0):
        """While the block runs, forwards of `kind` ("prefill" or "decode") wait, after
        `passes` more of them have run; they go on when the block ends, however it ends."""
        gate = os.path.join(self.folder, kind)
        staged = gate + ".new"
        with open(staged, "w") as f:
            f.write(str(passes))
        os.replace(staged, gate)  # the server never reads a half-written count
        try:
            yield self
        finally:
            os.unlink(gate)

    def held(self, kind: str) -> int:
        """How many forwards of `kind` are waiting now."""
        return len(glob.glob(os.path.join(self.folder, f"{kind}.held.*")))

    def wait_held(self, kind: str, count: int = 1, timeout: float = 120.0) -> None:
        """Until `count` forwards of `kind` wait (the timeout only guards against a hang)."""
        deadline = time.monotonic() + timeout
        while self.held(kind) < count:
            assert time.monotonic() < deadline, f"no {kind} held after {timeout} s"
            time.sleep(0.01)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def wait_until(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    """Poll until predicate() is true; the timeout only guards against a hang, never paces a test."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached after {timeout} s"
        time.sleep(0.01)
