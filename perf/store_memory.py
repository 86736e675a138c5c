"""The prefix store within XLLM_KV_CACHE_BYTES, served (issue 48, model/kv_budget.py): a server with
a small budget is filled with prompts that never repeat (each kept on first sight: more than one
token out), the last of them are sent again, then beam searches whose caches reach most of a
slot's arena, then the last prompts again. After each phase: the process's resident memory, that
of its key/value mappings (the store's pool and the slots' arenas, told apart by their sizes),
the store's bytes (`xllm:prefix_cache_bytes`) and the prompt tokens it served. The key/value
memory must stay within the budget.

    .venv/bin/python perf/store_memory.py                     # small random Qwen3, 256 MiB
    .venv/bin/python perf/store_memory.py --budget 512M --prompts 600
"""

from __future__ import annotations

import argparse
import json
import random
import urllib.request

import servers
from cli import cpu_model

MIB = 1 << 20


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://{servers.HOST}:{port}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / MIB


def kv_resident_mb(pid: int, budget: int, slots: int) -> float:
    """Resident MB of the mappings the size of the store's pool (the budget, plus 2 MiB to align it)
    or of a slot's arena (the budget over the slots): the key/value memory, apart from the
    transient tensors a forward allocates (a wide beam's logits are hundreds of MB)."""
    sizes = (budget, budget // slots)
    total = size = 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            field = line.split()
            if "-" in field[0] and len(field) >= 5:  # a mapping's first line: its address range
                low, high = (int(x, 16) for x in field[0].split("-"))
                size = high - low
            elif field[0] == "Rss:" and any(abs(size - s) <= 4 * MIB for s in sizes):
                total += int(field[1]) * 1024
    return total / MIB


def figures(server, phase: str, cached: int, budget: int) -> dict:
    metrics = servers.scrape_metrics(server.port)
    row = {"phase": phase, "rss_mb": round(resident_mb(server.pid), 1),
           "kv_rss_mb": round(kv_resident_mb(server.pid, budget, 2), 1),
           "store_mb": round(metrics.get("xllm:prefix_cache_bytes", 0) / MIB, 1),
           "store_used": round(metrics.get("xllm:prefix_cache_usage_ratio", 0), 3), "cached_tokens": cached}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="random Qwen3 size")
    parser.add_argument("--budget", default="256M", help="XLLM_KV_CACHE_BYTES")
    parser.add_argument("--prompts", type=int, default=400, help="distinct prompts, each --length tokens")
    parser.add_argument("--length", type=int, default=640)
    parser.add_argument("--again", type=int, default=100, help="the last prompts sent again (the store holds them)")
    parser.add_argument("--beam-tokens", type=int, default=48, help="beam rounds (max_tokens)")
    parser.add_argument("--reach", type=float, default=0.75,
                        help="share of a slot's cache each beam search reaches (its width follows)")
    parser.add_argument("--beams", type=int, default=2, help="beam searches, one at a time")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = servers.ensure_random_model(args.size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 10000) for _ in range(args.length)] for _ in range(args.prompts)]
    command = servers.server_command(model, ["--kv-cache-bytes", args.budget, "--scheduler", "fixed_steps",
                                             "--concurrent-execute-stream-num", "2", "--max-beam-width", "1024",
                                             "--max-num-return-sequences", "1024", "--max-tokens-per-batch", "65536"])
    print(f"CPU: {cpu_model()}; budget {args.budget}; {args.prompts} prompts of {args.length} tokens", flush=True)
    rows = []
    budget = servers_bytes(args.budget)
    with servers.running_server(command, servers.server_log("store_memory", "server")) as server:
        print(json.dumps({"phase": "started", "rss_mb": round(resident_mb(server.pid), 1)}), flush=True)

        def fill(phase: str, some: list[list[int]]) -> None:
            cached = sum(post(server.port, {"prompt": p, "max_tokens": 2, "temperature": 0})["usage"]
                         ["prompt_tokens_details"]["cached_tokens"] for p in some)
            rows.append(figures(server, phase, cached, budget))

        fill("prompts, first time", prompts)
        recent = prompts[-args.again:]
        fill(f"the last {len(recent)} again", recent)
        with urllib.request.urlopen(f"http://{servers.HOST}:{server.port}/server_info", timeout=10) as response:
            slot_tokens = json.loads(response.read())["kv_cache_tokens_per_slot"]
        width = min(1024, int(args.reach * slot_tokens / (args.beam_tokens - 1)))
        print(f"a slot's cache: {slot_tokens} tokens; beam width {width} x {args.beam_tokens} rounds", flush=True)
        cached = 0
        for i in range(args.beams):
            body = {"prompt": prompts[i][:64], "beam_width": width, "max_tokens": args.beam_tokens}
            cached += post(server.port, body)["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append(figures(server, "wide beam searches", cached, budget))
        fill(f"the last {len(recent)} again, after the beams", recent)
    worst = max(row["kv_rss_mb"] for row in rows)
    print(f"key/value memory resident at most: {worst:.1f} MB, budget {budget / MIB:.0f} MB: "
          f"{'within' if worst <= budget / MIB + 4 else 'OVER'}")


def servers_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


if __name__ == "__main__":
    main()
