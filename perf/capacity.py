"""Sizing a fleet on paper: how many replicas serve X requests a second with P99 latency <= Y ms,
read off one replica's measured sweep (the CSV of perf/sweep.py).

    python perf/capacity.py perf/results/sweep/sweep.csv --rate 20000 --p99-ms 200 --plot capacity.png

One replica, at each concurrency the sweep ran, served some requests a second at some P99. The
best rate whose P99 stays within the target (interpolated between two measured concurrencies
where the P99 crosses it) is what one replica can be given; the fleet is the target rate over
that, rounded up, and one more so that a rolling restart (one replica draining) still holds it.
This assumes the balancer keeps the replicas evenly loaded (least outstanding requests does) and
the traffic is the sweep's: other prompt and output lengths need their own sweep.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict


class Point:
    """One concurrency of one configuration, the median over its rounds."""

    __slots__ = ("concurrency", "rate", "latency_ms")

    def __init__(self, concurrency: int, rate: float, latency_ms: float) -> None:
        self.concurrency = concurrency
        self.rate = rate
        self.latency_ms = latency_ms


def read_sweep(path: str, config: str | None = None, latency_column: str = "p99_e2e_ms") -> tuple[str, list[Point]]:
    """The points of `config` (the file's only or first configuration when None), by concurrency."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")
    if latency_column not in rows[0]:
        raise ValueError(f"{path}: no column {latency_column!r} (columns: {', '.join(rows[0])})")
    config = config or rows[0]["config"]
    rounds: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        if row["config"] == config and int(float(row.get("failed") or 0)) == 0:
            rounds[int(row["concurrency"])].append(row)
    if not rounds:
        raise ValueError(f"{path}: no rows without failures for configuration {config!r}")
    points = [Point(c, statistics.median(float(r["req_per_s"]) for r in group),
                    statistics.median(float(r[latency_column]) for r in group)) for c, group in sorted(rounds.items())]
    return config, points


def rate_within(points: list[Point], latency_ms: float) -> float:
    """The most requests a second one replica serves with its latency <= latency_ms; 0 if none does."""
    best = max((p.rate for p in points if p.latency_ms <= latency_ms), default=0.0)
    for a, b in zip(points, points[1:]):  # where the latency crosses the target between two concurrencies
        if a.latency_ms <= latency_ms < b.latency_ms:
            best = max(best, a.rate + (b.rate - a.rate) * (latency_ms - a.latency_ms) / (b.latency_ms - a.latency_ms))
    return best


def replicas_needed(points: list[Point], rate: float, latency_ms: float) -> int | None:
    """Replicas that serve `rate` requests a second within `latency_ms` (None: no replica can)."""
    per_replica = rate_within(points, latency_ms)
    return math.ceil(rate / per_replica) if per_replica > 0 else None


def plot(points: list[Point], rate: float, latency_ms: float, label: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot([p.rate for p in points], [p.latency_ms for p in points], "o-")
    for p in points:
        left.annotate(f"c={p.concurrency}", (p.rate, p.latency_ms), textcoords="offset points", xytext=(4, 4))
    left.axhline(latency_ms, color="grey", linestyle="--", label=f"target {latency_ms:g} ms")
    per_replica = rate_within(points, latency_ms)
    if per_replica:
        left.axvline(per_replica, color="tab:green", linestyle=":", label=f"{per_replica:.1f} req/s per replica")
    left.set(xlabel="requests/s, one replica", ylabel=f"{label} (ms)", title="One replica, measured")
    left.legend()

    lowest, highest = min(p.latency_ms for p in points), max(p.latency_ms for p in points)
    targets = [lowest + (highest * 1.2 - lowest) * i / 200 for i in range(201)]
    needed = [replicas_needed(points, rate, t) for t in targets]
    right.step([t for t, n in zip(targets, needed) if n], [n for n in needed if n], where="post")
    right.axvline(latency_ms, color="grey", linestyle="--")
    right.set(xlabel=f"{label} target (ms)", ylabel="replicas", title=f"Replicas for {rate:g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="a sweep CSV of one replica (perf/sweep.py writes sweep.csv)")
    parser.add_argument("--rate", type=float, required=True, help="requests a second the fleet must serve")
    parser.add_argument("--p99-ms", "--latency-ms", dest="latency_ms", type=float, required=True,
                        help="latency target in ms (of --latency-column)")
    parser.add_argument("--config", help="the sweep configuration to read (default: the file's first)")
    parser.add_argument("--latency-column", default="p99_e2e_ms",
                        help="CSV column held to the target (p99_e2e_ms; p99_ttft_ms, median_e2e_ms, ...)")
    parser.add_argument("--plot", metavar="PNG", help="draw the replica's curve and the replicas per target")
    args = parser.parse_args(argv)
    try:
        config, points = read_sweep(args.csv, args.config, args.latency_column)
    except (OSError, ValueError, KeyError) as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return 2
    print(f"{config}, one replica ({args.latency_column}):")
    for p in points:
        print(f"  concurrency {p.concurrency:>4}: {p.rate:9.1f} req/s at {p.latency_ms:8.1f} ms")
    per_replica = rate_within(points, args.latency_ms)
    if args.plot:
        plot(points, args.rate, args.latency_ms, args.latency_column, args.plot)
        print(f"plot: {args.plot}")
    if per_replica <= 0:
        print(f"no measured concurrency keeps {args.latency_column} <= {args.latency_ms:g} ms: "
              "no number of replicas does")
        return 1
    n = math.ceil(args.rate / per_replica)
    print(f"one replica: {per_replica:.1f} req/s within {args.latency_ms:g} ms")
    print(f"{args.rate:g} req/s: {n} replicas, {n + 1} to keep it through a rolling restart")
    return 0


if __name__ == "__main__":
    sys.exit(main())
