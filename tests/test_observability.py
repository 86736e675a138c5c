"""/metrics (checked with prometheus_client's own parser), access logs,
X-Request-Id, /server_info, /version."""

from __future__ import annotations

import os

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .client import get, post
from .conftest import ServerProcess
from .hold import wait_until


def scrape(port: int) -> dict:
    status, body, headers = get(port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample_value(families: dict, family: str, sample: str, default: float | None = None, **labels) -> float:
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    if default is not None:  # a labelled counter has no sample until its first increment
        return default
    raise KeyError((family, sample, labels))


def test_metrics_parse_and_count_requests(server):
    before = scrape(server.port)
    n_before = sample_value(before, "xllm:e2e_request_latency_seconds", "xllm:e2e_request_latency_seconds_count")
    gen_before = sample_value(before, "xllm:generation_tokens", "xllm:generation_tokens_total")
    for _ in range(3):
        status, _, _ = post(server.port, "/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 3,
                                                             "ignore_eos": True})
        assert status == 200
    post(server.port, "/v1/completions", {"prompt": [1], "max_tokens": -1})
    after = scrape(server.port)
    assert sample_value(after, "xllm:e2e_request_latency_seconds", "xllm:e2e_request_latency_seconds_count") \
        == n_before + 3
    assert sample_value(after, "xllm:generation_tokens", "xllm:generation_tokens_total") >= gen_before + 9
    assert sample_value(after, "xllm:request_success", "xllm:request_success_total", finished_reason="length") >= 3
    assert sample_value(after, "xllm:http_requests", "xllm:http_requests_total", status="400") >= 1
    for name in ("xllm:time_to_first_token_seconds", "xllm:inter_token_latency_seconds",
                 "xllm:request_queue_time_seconds", "xllm:batch_prefill_time_seconds",
                 "xllm:batch_decode_time_seconds", "xllm:batch_size"):
        assert after[name].type == "histogram"
        assert sample_value(after, name, name + "_count") > 0
    assert after["xllm:batch_fill_wait_seconds"].type == "histogram"  # batches that waited: maybe none here
    assert after["xllm:num_requests_waiting"].type == "gauge"
    assert sample_value(after, "xllm:num_requests_running", "xllm:num_requests_running") == 0
    assert sample_value(after, "xllm:model_load_seconds", "xllm:model_load_seconds") > 0
    batches = [s for s in after["xllm:slot_batches"].samples if s.name == "xllm:slot_batches_total"]
    assert sorted(s.labels["slot"] for s in batches) == ["0", "1"]
    assert sum(s.value for s in batches) > 0
    assert sample_value(after, "xllm:slot_busy_seconds", "xllm:slot_busy_seconds_total", slot="0") > 0
    # The process's own figures, from prometheus_client's collectors at scrape time.
    assert sample_value(after, "process_cpu_seconds", "process_cpu_seconds_total") > 0
    assert sample_value(after, "process_open_fds", "process_open_fds") > 0
    assert sample_value(after, "process_resident_memory_bytes", "process_resident_memory_bytes") > 0
    assert after["python_gc_collections"].type == "counter"


def log_line(server, marker: str) -> str:
    """The server's log line holding marker, once it is written (it may follow the answer)."""
    lines: list[str] = []

    def found() -> bool:
        lines[:] = [line for line in server.log().splitlines() if marker in line]
        return bool(lines)

    wait_until(found, what=f"a log line with {marker}")
    return lines[0]


def test_request_id_is_echoed_and_logged(server):
    status, _, headers = post(server.port, "/v1/completions", {"prompt": [7, 8], "max_tokens": 2},
                              headers={"x-request-id": "trace-abc-123"})
    assert status == 200 and headers["x-request-id"] == "trace-abc-123"
    line = log_line(server, "id=trace-abc-123")
    assert '"POST /v1/completions" 200' in line and "prompt=2 output=2" in line and "ttft=" in line


def test_server_info_and_version(server):
    for path in ("/server_info", "/get_server_info"):
        status, body, _ = get(server.port, path)
        info = orjson.loads(body)
        assert status == 200
        assert info["scheduler"] == "fixed_steps" and info["concurrent_execute_stream_num"] == 2
        assert info["model"] == "tiny" and info["device"] == "cpu" and info["max_model_len"] == 256
        assert info["uptime_seconds"] > 0 and info["version"]
    status, body, _ = get(server.port, "/version")
    assert status == 200 and orjson.loads(body)["version"]


@pytest.fixture(scope="module")
def json_log_server(tiny_model_dir):
    server = ServerProcess(["--model", tiny_model_dir, "--access-log", "json", "--scheduler", "continuous"])
    yield server
    server.stop()


def test_json_access_log_lines(json_log_server):
    post(json_log_server.port, "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 2},
         headers={"x-request-id": "json-1"})
    line = log_line(json_log_server, '"json-1"')
    record = orjson.loads(line[line.index("{"):])
    assert record["status"] == 200 and record["path"] == "/v1/completions" and record["method"] == "POST"
    assert record["prompt_tokens"] == 3 and record["output_tokens"] == 2
    assert record["ttft_ms"] > 0 and record["total_ms"] >= record["ttft_ms"] and record["bytes"] > 0


async def test_metrics_can_be_turned_off(tiny_model_dir):
    import asyncio

    from xllm_async.config import Settings
    from xllm_async.service import Service

    service = Service(Settings(model=tiny_model_dir, port=0, metrics="off", access_log="off"))
    await service.start()
    try:
        port = service.http.port
        status, body, _ = await asyncio.to_thread(post, port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        status, body, _ = await asyncio.to_thread(get, port, "/metrics")
        assert status == 404 and b"off" in body
    finally:
        await service.shutdown()


async def test_the_loop_thread_keeps_one_intra_op_thread_and_slots_their_own(tiny_model_dir, tmp_path):
    """A parallel torch operation on the event loop's thread (building an item table's masks was
    one) starts an OpenMP team there, and every slot's forward then ran 30-40% slower: the
    service keeps the loop's thread on one intra-op thread; the slots set theirs."""
    import threading

    import torch

    from xllm_async.config import Settings
    from xllm_async.service import Service

    table = tmp_path / "items.tsv"
    table.write_text("".join(f"sku-{i}\t{1000 + i % 16} {2000 + i // 16}\n" for i in range(64)))
    before = torch.get_num_threads()
    service = Service(Settings(model=tiny_model_dir, port=0, metrics="off", access_log="off",
                               item_table=str(table), scheduler="fixed_steps", concurrent_execute_stream_num=1))
    await service.start()
    try:
        assert torch.get_num_threads() == 1
        seen, done = [], threading.Event()
        service.slots[0].submit(lambda: (seen.append(torch.get_num_threads()), done.set()))
        assert done.wait(60) and seen == [os.cpu_count()]
    finally:
        await service.shutdown()
        torch.set_num_threads(before)
