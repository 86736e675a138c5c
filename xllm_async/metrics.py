"""Prometheus metrics in the text exposition format, without a client library.

Cross-cutting: the HTTP, API and engine layers import this; it imports none
of them. Observations may come from slot threads, so each metric takes a lock
(uncontended, it costs less than shipping numbers to the loop).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable

PREFIX = "xllm:"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, values)) + "}"


class Counter:
    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        self.name = PREFIX + name
        self.help = help_text
        self.label_names = labels
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, *labels) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        values = self._values if self._values or self.label_names else {(): 0.0}
        for labels, value in sorted(values.items()):
            yield f"{self.name}{_labels(self.label_names, labels)} {value}"


class Gauge:
    """A value read when scraped (a callback), so nothing updates it on the hot path."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name = PREFIX + name
        self.help = help_text
        self.read = read

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        yield f"{self.name} {float(self.read())}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple = LATENCY_BUCKETS) -> None:
        self.name = PREFIX + name
        self.help = help_text
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        with self._lock:
            counts, total = list(self._counts), self._sum
        running = 0
        for bound, count in zip(self.buckets, counts):
            running += count
            yield f'{self.name}_bucket{{le="{bound}"}} {running}'
        running += counts[-1]
        yield f'{self.name}_bucket{{le="+Inf"}} {running}'
        yield f"{self.name}_sum {total}"
        yield f"{self.name}_count {running}"


class PerSlot:
    """Per execution slot figures, read from the slots when scraped."""

    def __init__(self, name: str, help_text: str, kind: str, read: Callable[[], list[float]]) -> None:
        self.name = PREFIX + name
        self.help = help_text
        self.kind = kind
        self.read = read

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for slot, value in enumerate(self.read()):
            yield f'{self.name}{{slot="{slot}"}} {float(value)}'


class ProcessFigures:
    """The process's own figures (CPU seconds, memory, open files, start time, garbage collector,
    Python version) from prometheus_client's collectors, under their standard names.

    They run only when /metrics is scraped. The per-request metrics above stay hand-written:
    prometheus_client's updates cost more on the hot path (perf/experiments/metrics_cost.py;
    perf/RESULTS.md, "Offline, the ceiling and the server's own cost")."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def render(self) -> Iterable[str]:
        from prometheus_client import generate_latest

        yield generate_latest(self.registry).decode().rstrip("\n")


class _Off:
    """Stands in for every metric when metrics are turned off (to measure what they cost)."""

    def observe(self, value: float) -> None:
        pass

    def inc(self, amount: float = 1.0, *labels) -> None:
        pass

    def render(self) -> Iterable[str]:
        return ()


class Metrics:
    """Every metric the server exports, in one place."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.ttft = Histogram("time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = Histogram("inter_token_latency_seconds", "Time between two tokens of one sequence.")
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from request arrival to its last token.")
        self.queue = Histogram("request_queue_time_seconds", "Time a request waited before its batch started.")
        self.prefill = Histogram("batch_prefill_time_seconds", "Prefill forward time of one batch.")
        self.decode = Histogram("batch_decode_time_seconds", "Decode step time of one batch.")
        self.batch_size = Histogram("batch_size", "Sequences in one prefill batch.", SIZE_BUCKETS)
        self.fill = Histogram("batch_fill_wait_seconds",
                              "Time a free slot held a batch back for company (fixed_steps; only batches that waited).")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens processed.")
        self.prefix_queries = Counter("prefix_cache_queries_total",
                                      "Prompt tokens looked up in the prefix cache (XLLM_PREFIX_CACHE=on).")
        self.prefix_hits = Counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.")
        self.finished = Counter("request_success_total", "Sequences finished, by reason.", ("finished_reason",))
        self.http = Counter("http_requests_total", "HTTP responses, by status code.", ("status",))
        self.beam_requests = Counter("beam_requests_total", "Beam-search (recommendation) prompts answered.")
        self.beams = Histogram("beams_per_request", "beam_width of each beam-search prompt.", SIZE_BUCKETS)
        self.items = Histogram("items_returned_per_request",
                               "Sequences (items, with an item table) returned for each beam-search prompt.",
                               (0, *SIZE_BUCKETS))
        self._extra: list = []
        if not enabled:
            off = _Off()
            for name, value in vars(self).items():
                if isinstance(value, (Counter, Histogram)):
                    setattr(self, name, off)

    def batch_prefilled(self, seconds: float, prompts: list[list[int]], tokens: int,
                        cached: list[int] | None = None) -> None:
        """cached: each prompt's tokens found in the prefix cache (empty or None: the runner has none)."""
        self.prefill.observe(seconds)
        self.batch_size.observe(len(prompts))
        prompt_tokens = sum(len(p) for p in prompts)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        if cached:
            self.prefix_queries.inc(prompt_tokens)
            self.prefix_hits.inc(sum(cached))

    def batch_decoded(self, seconds: float, tokens: int) -> None:
        self.decode.observe(seconds)
        self.generation_tokens.inc(tokens)

    def add(self, metric) -> None:
        """Register a scrape-time metric (gauges and per-slot figures owned by other parts)."""
        if self.enabled:
            self._extra.append(metric)

    def render(self) -> bytes:
        lines: list[str] = []
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.prefill, self.decode, self.batch_size,
                       self.fill, self.prompt_tokens, self.prefix_queries, self.prefix_hits, self.generation_tokens,
                       self.finished, self.http,
                       self.beam_requests, self.beams, self.items, *self._extra):
            lines.extend(metric.render())
        return ("\n".join(lines) + "\n").encode()
