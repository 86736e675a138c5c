"""perf/soak.py itself: a short soak against the shared server passes its own checks."""

from __future__ import annotations

import importlib
import os
import sys

from .conftest import ROOT


def test_short_soak_finds_every_answer_correct_and_nothing_leaked(server, capsys):
    # perf/ is a folder of scripts, not a package: they import each other by name, from perf/ on sys.path.
    perf = os.path.join(ROOT, "perf")
    if perf not in sys.path:
        sys.path.insert(0, perf)
    soak = importlib.import_module("soak")
    code = soak.main(["--base-url-port", str(server.port), "--requests", "80", "--concurrency", "8",
                      "--distinct", "6", "--max-prompt", "200", "--disconnect-share", "0.3", "--rss-growth", "0.5",
                      "--idle-seconds", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "running: ok" in out
