"""A test-only hold on the model's forwards, so that tests never depend on how fast
the machine is: a test that needs a slot busy, a request waiting or a deadline
passed holds the forwards on a file it controls, instead of hoping that a long
generation takes longer than a timeout.

Off unless XLLM_TEST_HOLD_DIR names a folder when the server starts (read once:
the production path neither wraps the runner nor checks anything). With it set:

- while `<dir>/prefill` (or `<dir>/decode`) exists, each such forward waits on
  the slot's thread before it runs, its requests already started (not expirable);
- a number in that file lets that many more forwards of the kind pass first
  (the hold takes effect mid-generation);
- a waiting forward shows as `<dir>/<kind>.held.<thread id>` until the file is removed.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "XLLM_TEST_HOLD_DIR"
POLL_SECONDS = 0.002


def maybe_hold(runner):
    """The runner itself, or, with XLLM_TEST_HOLD_DIR set, the runner behind a HeldRunner."""
    folder = os.environ.get(ENV)
    return HeldRunner(runner, folder) if folder else runner


class HeldRunner:
    """The runner's prefill and decode, each first waiting while its hold file exists;
    every other attribute is the runner's own."""

    def __init__(self, runner, folder: str) -> None:
        self._runner = runner
        self._folder = folder

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:  # settings such as max_model_len belong to the runner
            setattr(self._runner, name, value)

    def prefill(self, *args, **kwargs):
        self._wait("prefill")
        return self._runner.prefill(*args, **kwargs)

    def prefill_scored(self, *args, **kwargs):
        self._wait("prefill")
        return self._runner.prefill_scored(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self._wait("decode")
        return self._runner.decode(*args, **kwargs)

    def decode_greedy(self, *args, **kwargs):  # (a decode step too: an all-greedy batch's)
        self._wait("decode")
        return self._runner.decode_greedy(*args, **kwargs)

    def decode_top(self, *args, **kwargs):  # (a decode step too: a top-k batch's)
        self._wait("decode")
        return self._runner.decode_top(*args, **kwargs)

    def _wait(self, kind: str) -> None:
        gate = os.path.join(self._folder, kind)
        try:
            with open(gate, "r+") as f:
                passes = f.read().strip()
                if passes.isdigit() and int(passes) > 0:
                    f.seek(0)
                    f.truncate()
                    f.write(str(int(passes) - 1))
                    return
        except FileNotFoundError:
            return
        marker = os.path.join(self._folder, f"{kind}.held.{threading.get_native_id()}")
        open(marker, "w").close()  # noqa: SIM115
        try:
            while os.path.exists(gate):
                time.sleep(POLL_SECONDS)
        finally:
            os.unlink(marker)
