"""perf/capacity.py on a small synthetic sweep CSV."""

from __future__ import annotations

import csv
import os
import sys

import pytest

from .conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "perf"))
import capacity  # noqa: E402

# One replica: 100 req/s at 20 ms, 300 at 60 ms, 400 at 140 ms, 420 at 400 ms (two rounds each,
# medians as given), and a second configuration and a failed row that must be left out.
ROWS = [("fixed_steps-N2", c, r, rate, p99, 0) for c, rate, p99 in
        [(1, 100, 20), (4, 300, 60), (16, 400, 140), (64, 420, 400)] for r in (1, 2)]
ROWS += [("fixed_steps-N2", 8, 1, 999, 1, 3), ("continuous-N1", 4, 1, 50, 10, 0)]


@pytest.fixture
def sweep_csv(tmp_path) -> str:
    path = str(tmp_path / "sweep.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["config", "concurrency", "round", "req_per_s", "p99_e2e_ms", "failed"])
        writer.writerows(ROWS)
    return path


def test_capacity_reads_the_first_configuration_without_failed_rows(sweep_csv):
    config, points = capacity.read_sweep(sweep_csv)
    assert config == "fixed_steps-N2"
    assert [(p.concurrency, p.rate, p.latency_ms) for p in points] == [(1, 100, 20), (4, 300, 60), (16, 400, 140),
                                                                       (64, 420, 400)]


def test_capacity_interpolates_where_p99_crosses_the_target(sweep_csv):
    _, points = capacity.read_sweep(sweep_csv)
    assert capacity.rate_within(points, 60) == 300
    assert capacity.rate_within(points, 100) == pytest.approx(350)  # halfway from 60 to 140 ms
    assert capacity.rate_within(points, 10) == 0
    assert capacity.replicas_needed(points, 10_000, 100) == 29  # 10000 / 350 = 28.6
    assert capacity.replicas_needed(points, 10_000, 10) is None


def test_capacity_cli_answers_and_draws(sweep_csv, tmp_path, capsys):
    png = str(tmp_path / "capacity.png")
    assert capacity.main([sweep_csv, "--rate", "10000", "--p99-ms", "100", "--plot", png]) == 0
    out = capsys.readouterr().out
    assert "350.0 req/s within 100 ms" in out and "29 replicas, 30 to keep it through a rolling restart" in out
    assert os.path.getsize(png) > 10_000
    assert capacity.main([sweep_csv, "--rate", "10000", "--p99-ms", "5"]) == 1
