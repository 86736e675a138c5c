"""perf/bench_serving.py: the dataset's exact lengths, the figures and the table from known
timings, the HTTP/SSE client against canned servers, and whole runs against a real server."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import sys

import pytest

from .conftest import ROOT, free_port


def _load_bench_serving():
    # perf/ is a folder of scripts, not a package: load the file as a module of its own.
    spec = importlib.util.spec_from_file_location("bench_serving", os.path.join(ROOT, "perf", "bench_serving.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bench = _load_bench_serving()
RequestResult = bench.RequestResult


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return bench.load_tokenizer(tiny_model_dir)


# --- dataset ---


@pytest.mark.parametrize("prompt_format", ["ids", "text"])
def test_random_prompts_have_exactly_the_drawn_token_lengths(tokenizer, prompt_format):
    prompts = bench.make_random_prompts(tokenizer, 40, 64, 8, range_ratio=0.5, seed=3, prompt_format=prompt_format)
    assert len(prompts) == 40
    for prompt, prompt_len, output_len in prompts:
        assert 32 <= prompt_len <= 64 and 4 <= output_len <= 8
        if prompt_format == "ids":
            assert all(isinstance(t, int) for t in prompt)
            ids = prompt
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert len(ids) == prompt_len
        assert not set(ids) & set(tokenizer.all_special_ids)
    assert len({p.prompt_len for p in prompts}) > 5  # lengths are drawn, not all alike


@pytest.mark.parametrize("prompt_format", ["ids", "text"])
def test_random_prompts_are_deterministic_per_seed(tokenizer, prompt_format):
    def make(seed):
        return bench.make_random_prompts(tokenizer, 5, 24, 4, range_ratio=0.5, seed=seed, prompt_format=prompt_format)

    assert make(7) == make(7)
    assert make(7) != make(8)


def test_range_ratio_one_gives_the_exact_lengths(tokenizer):
    prompts = bench.make_random_prompts(tokenizer, 10, 200, 3, prompt_format="text")
    assert {(p.prompt_len, p.output_len) for p in prompts} == {(200, 3)}
    assert all(len(tokenizer.encode(p.prompt, add_special_tokens=False)) == 200 for p in prompts)


def test_shared_prefix_prompts_share_their_group_s_system_prompt(tokenizer):
    prompts = bench.make_shared_prefix_prompts(tokenizer, 3, 4, 40, 6, 2, seed=1)
    assert len(prompts) == 12 and {(p.prompt_len, p.output_len) for p in prompts} == {(46, 2)}
    systems = [tuple(p.prompt[:40]) for p in prompts]
    assert len(set(systems)) == 3 and all(systems.count(s) == 4 for s in systems)
    assert len({tuple(p.prompt) for p in prompts}) == 12
    assert systems[:4] != [systems[0]] * 4 or systems[4:8] != [systems[4]] * 4  # shuffled: groups interleave
    assert prompts == bench.make_shared_prefix_prompts(tokenizer, 3, 4, 40, 6, 2, seed=1)


def test_bad_dataset_settings_are_refused(tokenizer):
    with pytest.raises(ValueError, match="range_ratio"):
        bench.make_random_prompts(tokenizer, 1, 8, 8, range_ratio=1.5)
    with pytest.raises(ValueError, match="prompt_format"):
        bench.make_random_prompts(tokenizer, 1, 8, 8, prompt_format="words")
    with pytest.raises(ValueError, match="token ids"):
        bench.make_shared_prefix_prompts(tokenizer, 1, 1, 8, 8, 1, prompt_format="text")


# --- figures ---


def hand_made_results() -> list:
    return [
        RequestResult(True, latency=1.0, ttft=0.2, itl=[0.2, 0.3, 0.3], prompt_len=10, output_len=4, retokenized_len=4),
        RequestResult(True, latency=2.0, ttft=0.5, itl=[0.5, 1.0], prompt_len=20, output_len=3, retokenized_len=3),
        RequestResult(True, latency=0.5, ttft=0.5, itl=[], prompt_len=30, output_len=1, retokenized_len=2),
        RequestResult(False, latency=0.1, ttft=0.1, prompt_len=40, output_len=0, error="HTTP 500: boom"),
        RequestResult(False, latency=0.1, ttft=0.1, prompt_len=40, output_len=0, error="HTTP 503: later"),
    ]


def test_metrics_from_known_timings():
    m = bench.compute_metrics(hand_made_results(), duration=2.5)
    approx = pytest.approx
    assert (m["completed"], m["failed"], m["first_error"]) == (3, 2, "HTTP 500: boom")
    # the failed requests' 80 prompt tokens and latencies count nowhere
    assert (m["total_input_tokens"], m["total_output_tokens"], m["total_output_tokens_retokenized"]) == (60, 8, 9)
    assert m["request_throughput"] == approx(1.2)
    assert m["input_throughput"] == approx(24.0)
    assert m["output_throughput"] == approx(3.2)
    assert m["total_throughput"] == approx(27.2)
    assert m["concurrency"] == approx(3.5 / 2.5)
    # numpy's linear percentiles, worked out by hand
    expected = {
        "e2e_latency": (3500 / 3, 1000, 1800, 1980),  # [500, 1000, 2000]
        "ttft": (400, 500, 500, 500),  # [200, 500, 500]
        # [800/3, 750]; a 1-token request has none
        "tpot": (1525 / 3, 1525 / 3, 800 / 3 + 0.9 * 1450 / 3, 800 / 3 + 0.99 * 1450 / 3),
        "itl": (460, 300, 800, 980),  # [200, 300, 300, 500, 1000]
    }
    for name, values in expected.items():
        got = tuple(m[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p90", "p99"))
        assert got == approx(values), name


def test_metrics_with_no_successful_request_are_zero():
    m = bench.compute_metrics(hand_made_results()[3:], duration=1.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (0, 2, 0)
    assert m["mean_ttft_ms"] == m["p99_itl_ms"] == m["request_throughput"] == 0.0


def test_table_has_the_standard_layout():
    m = bench.compute_metrics(hand_made_results(), duration=2.5)
    m.update(backend="xllm_async", request_rate="inf", max_concurrency=None)
    lines = bench.format_table(m).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for line in ("Backend:                                 xllm_async",
                 "Traffic request rate:                    inf       ",
                 "Max request concurrency:                 not set   ",
                 "Successful requests:                     3         ",
                 "Failed requests:                         2         ",
                 "First error:                             HTTP 500: boom",
                 "Benchmark duration (s):                  2.50      ",
                 "Total input tokens:                      60        ",
                 "Total generated tokens:                  8         ",
                 "Total generated tokens (retokenized):    9         ",
                 "Request throughput (req/s):              1.20      ",
                 "Input token throughput (tok/s):          24.00     ",
                 "Output token throughput (tok/s):         3.20      ",
                 "Total token throughput (tok/s):          27.20     ",
                 "Concurrency:                             1.40      ",
                 "----------------End-to-End Latency----------------",
                 "Mean E2E Latency (ms):                   1166.67   ",
                 "P90 E2E Latency (ms):                    1800.00   ",
                 "---------------Time to First Token----------------",
                 "Median TTFT (ms):                        500.00    ",
                 "-----Time per Output Token (excl. 1st token)------",
                 "Mean TPOT (ms):                          508.33    ",
                 "---------------Inter-Token Latency----------------",
                 "P99 ITL (ms):                            980.00    "):
        assert line in lines, line


# --- HTTP and SSE ---


def test_sse_events_survive_any_split():
    stream = b'data: {"a": 1}\n\n: comment\r\ndata:{"b": 2}\r\n\r\ndata: [DONE]\n\n'
    for size in (1, 2, 7, len(stream)):
        parser = bench.SseParser()
        events = []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i:i + size])
        assert events == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"], size


@contextlib.asynccontextmanager
async def canned_server(responses: list[bytes], close_after_each: bool = False):
    """A loopback server answering each request with the next canned bytes; yields its port."""
    answers = iter(responses)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(next(answers))
                await writer.drain()
                if close_after_each:
                    break
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


def sse_response(*events: bytes) -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%b\r\n" % (len(body), body) + b"0\r\n\r\n")


TEXT_EVENT = b'{"choices": [{"text": "hi"}]}'
USAGE_EVENT = b'{"choices": [], "usage": {"completion_tokens": 1}}'


@pytest.mark.parametrize("events, error", [
    ((TEXT_EVENT, USAGE_EVENT, b"[DONE]"), ""),
    ((TEXT_EVENT, b'{"error": {"message": "engine died"}}', b"[DONE]"), "error event: engine died"),
    ((TEXT_EVENT, USAGE_EVENT), "stream ended without [DONE]"),
])
async def test_stream_failures_are_reported(events, error):
    async with canned_server([sse_response(*events)]) as port:
        conn = bench.HttpConnection("127.0.0.1", port)
        result = await bench.send_request(conn, "/v1/completions", b"{}", 5, chat=False, stream=True)
        conn.close()
    assert (result.success, result.error) == (not error, error)
    assert result.generated_text == "hi" and result.ttft > 0
    # One small write arrives as one piece: the text and the end came together, and the
    # latency ends when they arrived, not after the client parsed them.
    assert result.latency == result.ttft


async def test_a_connection_the_server_closed_is_reopened():
    # Content-Length bodies and a server that drops every connection after one answer, without saying so.
    whole = b'{"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}'
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(whole), whole)
    async with canned_server([answer] * 3, close_after_each=True) as port:
        conn = bench.HttpConnection("127.0.0.1", port)
        results = [await bench.send_request(conn, "/v1/completions", b"{}", 5, chat=False, stream=False)
                   for _ in range(3)]
        conn.close()
    assert [(r.success, r.generated_text, r.output_len) for r in results] == [(True, "ok", 1)] * 3


async def test_a_body_without_length_runs_until_close_and_a_cut_body_fails():
    whole = b'{"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}'
    until_close = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + whole
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(whole) + 10, whole)
    results = []
    for answer in (until_close, cut):
        async with canned_server([answer], close_after_each=True) as port:
            conn = bench.HttpConnection("127.0.0.1", port)
            results.append(await bench.send_request(conn, "/v1/completions", b"{}", 5, chat=False, stream=False))
            conn.close()
    assert (results[0].success, results[0].generated_text) == (True, "ok")
    assert results[1].error == "HttpError: connection closed inside the response body"


# --- against the real server ---


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_benchmark_against_the_server(server, tokenizer, endpoint, stream):
    prompt_format = "text" if "chat" in endpoint else "ids"
    prompts = bench.make_random_prompts(tokenizer, 8, 16, 4, seed=1, prompt_format=prompt_format)
    m = await bench.benchmark(f"http://127.0.0.1:{server.port}", prompts, tokenizer=tokenizer, model="tiny",
                              endpoint=endpoint, max_concurrency=2, stream=stream, keep_texts=True)
    assert (m["completed"], m["failed"]) == (8, 0), m["first_error"]
    assert len(m["generated_texts"]) == 8 and all(isinstance(t, str) and t for t in m["generated_texts"])
    assert m["total_input_tokens"] == 128 and m["total_output_tokens"] == 32
    assert m["total_output_tokens_retokenized"] > 0
    assert m["mean_ttft_ms"] > 0 and m["mean_e2e_latency_ms"] >= m["mean_ttft_ms"]
    assert 0 < m["concurrency"] <= 2.0 + 1e-6
    if stream:
        assert m["mean_tpot_ms"] > 0
    assert (m["max_concurrency"], m["request_rate"], m["stream"]) == (2, "inf", stream)


async def test_poisson_arrivals_spread_the_requests(server, tokenizer):
    prompts = bench.make_random_prompts(tokenizer, 8, 16, 2, seed=2)
    m = await bench.benchmark(f"http://127.0.0.1:{server.port}", prompts, tokenizer=tokenizer, model="tiny",
                              request_rate=40.0, seed=2)
    assert (m["completed"], m["request_rate"]) == (8, 40.0)
    assert m["duration"] > 0.05  # seven exponential gaps of mean 25 ms, not all at once


@pytest.mark.parametrize("where", ["missing route", "no server"])
async def test_failed_requests_are_counted_with_the_first_error(server, tokenizer, where):
    base_url, endpoint, error = {
        "missing route": (f"http://127.0.0.1:{server.port}", "/v1/nope", "HTTP 404: Route /v1/nope not found"),
        "no server": (f"http://127.0.0.1:{free_port()}", "/v1/completions", "ConnectionRefusedError"),
    }[where]
    prompts = bench.make_random_prompts(tokenizer, 8, 16, 4)
    m = await bench.benchmark(base_url, prompts, tokenizer=tokenizer, model="tiny", endpoint=endpoint,
                              max_concurrency=2, keep_texts=True)
    assert (m["completed"], m["failed"]) == (0, 8)
    assert m["generated_texts"] == [None] * 8
    assert m["first_error"].startswith(error)
    table = bench.format_table(m)
    assert "Failed requests:                         8" in table and error in table


def test_command_line_run_prints_the_table_and_appends_json(server, tmp_path, capsys):
    out = tmp_path / "results" / "bench.jsonl"
    argv = ["--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "8", "--random-input", "16",
            "--random-output", "4", "--max-concurrency", "2", "--disable-progress", "--output-file", str(out)]
    assert bench.main(argv) == 0
    assert bench.main([*argv, "--endpoint", "/v1/chat/completions", "--no-stream"]) == 0
    assert capsys.readouterr().out.count("============ Serving Benchmark Result ============") == 2
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    # the model, its tokenizer folder and the backend label all come from GET /v1/models
    assert (first["model"], first["backend"], first["prompt_format"]) == ("tiny", "xllm_async", "ids")
    assert (first["completed"], first["total_output_tokens"], first["failed"]) == (8, 32, 0)
    assert (first["random_input"], first["random_output"], first["num_prompts"]) == (16, 4, 8)
    assert first["endpoint"] == "/v1/completions" and first["date"]
    assert (second["endpoint"], second["stream"], second["prompt_format"]) == ("/v1/chat/completions", False, "text")
    assert second["completed"] == 8


def test_command_line_stops_on_a_failed_warm_up(server, capsys):
    argv = ["--base-url", f"http://127.0.0.1:{server.port}", "--endpoint", "/v1/nope", "--num-prompts", "2",
            "--random-input", "8", "--random-output", "2"]
    assert bench.main(argv) == 1
    assert "warm-up request failed: HTTP 404" in capsys.readouterr().err


def test_rec_workload_counts_beams_and_returned_tokens(server, tmp_path, capsys):
    out = tmp_path / "rec.jsonl"
    argv = ["--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "6", "--random-input", "20",
            "--random-output", "3", "--beam-width", "4", "--num-return-sequences", "2", "--max-concurrency", "3",
            "--disable-progress", "--output-file", str(out)]
    assert bench.main(argv) == 0
    assert "Beam throughput (beams/s):" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert (figures["completed"], figures["failed"], figures["stream"]) == (6, 0, False)
    assert figures["total_output_tokens"] == 6 * 2 * 3  # 2 returned sequences of 3 rounds each
    assert figures["beam_throughput"] == pytest.approx(4 * figures["request_throughput"])


# --- item tables (generative recommendation) ---


class FakeTokenizer:
    def __init__(self, vocab_size: int, special: list[int]) -> None:
        self.vocab_size = vocab_size
        self.all_special_ids = special


def test_item_token_base_leaves_special_tokens_out_of_the_range():
    assert bench.item_token_base(FakeTokenizer(5000, [0, 1, 2]), 768) == 1000
    assert bench.item_token_base(FakeTokenizer(5000, [0, 1200]), 768) == 1201
    assert bench.item_token_base(FakeTokenizer(900, [0]), 768) == 132  # a small vocabulary: as high as fits
    with pytest.raises(ValueError, match="no 768 consecutive ordinary ids"):
        bench.item_token_base(FakeTokenizer(800, [0, 400]), 768)


def test_item_table_spells_each_codebook_in_its_own_range(tmp_path):
    table = bench.make_item_table(500, 3, 16, base=1000, seed=4)
    assert len(table.items) == 500 and table.item_length == 3
    assert len(set(table.items.values())) == 500
    for key in table.items:
        assert [(token - 1000) // 16 for token in key] == [0, 1, 2]
    assert bench.make_item_table(500, 3, 16, base=1000, seed=4) == table
    assert bench.make_item_table(500, 3, 16, base=1000, seed=5) != table
    with pytest.raises(ValueError, match="cannot be spelt"):
        bench.make_item_table(17, 1, 16, base=1000)


def test_written_item_table_is_the_one_the_server_loads(tmp_path):
    from xllm_async.api.items import ItemTable

    path = tmp_path / "tables" / "items.tsv"
    table = bench.make_item_table(300, 3, 8, base=2000)
    bench.write_item_table(str(path), table, "300 items")
    assert path.read_text().startswith("# 300 items\nitem-00000\t")
    assert bench.read_item_table(str(path)) == table
    loaded = ItemTable.load(str(path))
    numbers, missing = loaded.find(list(table.items.values()))
    assert loaded.count == 300 and not missing
    assert {tuple(loaded.tokens_of(n)): item for n, item in zip(numbers, table.items.values())} == table.items
    (tmp_path / "mixed.tsv").write_text("a\t1 2 3\nb\t1 2\n")
    with pytest.raises(ValueError, match="mixed.tsv:2"):
        bench.read_item_table(str(tmp_path / "mixed.tsv"))


def test_item_figures_count_returned_asked_and_invalid_choices():
    table = bench.ItemTable({(1, 2): "a", (1, 3): "b", (4, 5): "c"})
    results = [
        RequestResult(True, latency=1.0, choices=[("a", (1, 2)), ("b", (1, 3)), ("c", (4, 5))]),
        RequestResult(True, latency=1.0, choices=[("a", (1, 2)), (None, (9, 9))]),  # a beam that is no item
        RequestResult(True, latency=1.0, choices=[("b", (1, 2))]),  # an id that does not name those tokens
        RequestResult(False, latency=1.0, error="HTTP 500: boom"),
    ]
    m = bench.item_metrics(results, table, asked_per_request=3, duration=2.0)
    assert m == {"items_asked": 9, "items_returned": 5, "item_share": pytest.approx(5 / 9), "invalid_items": 2,
                 "item_throughput": 2.5}
    m.update(bench.compute_metrics(results, duration=2.0), backend="x", request_rate="inf", max_concurrency=8)
    lines = bench.format_table(m).splitlines()
    for line in ("Item throughput (items/s):               2.50      ",
                 "Items returned (% of asked):             55.56     ",
                 "Invalid items:                           2         "):
        assert line in lines, line


@pytest.fixture(scope="module")
def item_table_server(tiny_model_dir, tmp_path_factory):
    from .conftest import ServerProcess

    path = str(tmp_path_factory.mktemp("items") / "items.tsv")
    assert bench.main(["--item-table-out", path, "--item-table-items", "200", "--item-codes", "16",
                       "--tokenizer", tiny_model_dir]) == 0
    server = ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny", "--item-table", path])
    yield server, path
    server.stop()


def test_item_table_run_reports_items_per_second(item_table_server, tmp_path, capsys):
    server, path = item_table_server
    out = tmp_path / "items.jsonl"
    argv = ["--base-url", f"http://127.0.0.1:{server.port}", "--item-table", path, "--num-prompts", "4",
            "--random-input", "20", "--beam-width", "8", "--num-return-sequences", "8", "--max-concurrency", "2",
            "--disable-progress", "--output-file", str(out)]
    assert bench.main(argv) == 0
    assert "Item throughput (items/s):" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert (figures["completed"], figures["failed"], figures["random_output"]) == (4, 0, 3)  # max_tokens = 3 codes
    assert (figures["items_asked"], figures["items_returned"], figures["invalid_items"]) == (32, 32, 0)
    assert figures["item_share"] == 1.0 and (figures["item_count"], figures["item_length"]) == (200, 3)
    assert figures["item_throughput"] == pytest.approx(8 * figures["request_throughput"])
    assert bench.main(argv[:4] + ["--num-prompts", "1"]) == 1  # a table without beams is refused
    assert "--item-table needs --beam-width" in capsys.readouterr().err
