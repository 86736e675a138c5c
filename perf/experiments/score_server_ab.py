"""Issue 47's item ranking through the server, A/B: another checkout's server (--base, e.g. an older
commit unpacked with `git archive`) and this one's, both up, requests alternated between them one at
a time, so that a shared machine's load falls on both alike. Per round and server: a 1-token
completion on a fresh 1,000-token history (the history's prefill) and one /v1/score request of N
`item_ids` of perf/ranking.py's item table (run perf/ranking.py --items 1520000 once to write it).

    .venv/bin/python perf/experiments/score_server_ab.py --base /tmp/base --candidates 100,1000 --rounds 7

Prints per count and server the median wall time of each and the score's ratio to the prefill,
and the same by the server process's CPU time (all its threads, from /proc: less sensitive to a
busy second core than wall time).
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import servers
from cli import positive_ints
from ranking import post


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the other checkout (its server.py runs its own package)")
    parser.add_argument("--model", default="perf/results/models/qwen3-medium")
    parser.add_argument("--table", default=None, help="item table (default: perf/ranking.py's 1.52M-item one)")
    parser.add_argument("--candidates", type=positive_ints, default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--history", type=int, default=1000)
    args = parser.parse_args()
    model = servers.ensure_model(args.model)
    table = args.table or sorted(glob.glob(os.path.join(servers.PERF_DIR, "results/ranking/items-1520000x*.tsv")))[0]
    with open(table) as f:
        names = [line.split("\t", 1)[0] for line in f if not line.startswith("#")]
    rng = random.Random(7)
    flags = ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "1", "--prefix-cache", "off",
             "--item-table", os.path.abspath(table)]
    log = servers.server_log("ranking", "score-server-ab")

    def history() -> list[int]:
        return [rng.randrange(200, 150000) for _ in range(args.history)]

    with servers.running_server(servers.server_command(model, [f"@{args.base}", *flags]), log, "base") as base, \
            servers.running_server(servers.server_command(model, flags), log, "this") as this:
        both = {"base": base, "this": this}
        for server in both.values():  # (each server's first shapes, unmeasured)
            for count in (4, *args.candidates):
                post(server.port, "/v1/score", {"query": history(), "item_ids": rng.sample(names, count)})
        for count in args.candidates:
            got: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for round_ in range(args.rounds):
                for name in (list(both) if round_ % 2 == 0 else list(both)[::-1]):
                    server = both[name]
                    for kind in ("prefill", "score"):
                        path, body = (("/v1/completions", {"prompt": history(), "max_tokens": 1}) if kind == "prefill"
                                      else ("/v1/score", {"query": history(), "item_ids": rng.sample(names, count)}))
                        cpu, started = cpu_seconds(server.pid), time.perf_counter()
                        post(server.port, path, body)
                        got.setdefault((name, kind), []).append((time.perf_counter() - started,
                                                                 cpu_seconds(server.pid) - cpu))
            for name in both:
                (pw, pc), (sw, sc) = ((statistics.median(w for w, _ in got[(name, k)]),
                                       statistics.median(c for _, c in got[(name, k)])) for k in ("prefill", "score"))
                print(f"{count} items, {name}: prefill {pw * 1e3:.0f} ms (CPU {pc * 1e3:.0f}); score "
                      f"{sw * 1e3:.0f} ms = {sw / pw:.2f}x (CPU {sc * 1e3:.0f} = {sc / pc:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
