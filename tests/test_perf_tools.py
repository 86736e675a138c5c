"""perf/sweep.py's pure pieces (arguments, CSV rows, medians, ratios, plots), perf/servers.py's
server subprocesses (stand-ins, no model), and perf/offline.py's measurement on the tiny model:
exact counts of the batches, requests and tokens it ran."""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import os
import sys
import time

import pytest

from .conftest import ROOT


def _import_perf_script(name: str):
    # perf/ is a folder of scripts, not a package: they import each other by name, from perf/ on sys.path.
    perf = os.path.join(ROOT, "perf")
    if perf not in sys.path:
        sys.path.insert(0, perf)
    return importlib.import_module(name)


sweep = _import_perf_script("sweep")
cli = _import_perf_script("cli")
servers = _import_perf_script("servers")
offline = _import_perf_script("offline")


# --- sweep: arguments ---


def test_config_is_a_name_and_shell_split_server_flags():
    name, args = sweep.parse_config("fixed_steps-N2=--scheduler fixed_steps --served-model-name 'a b'")
    assert name == "fixed_steps-N2"
    assert args == ["--scheduler", "fixed_steps", "--served-model-name", "a b"]
    assert sweep.parse_config("bare=") == ("bare", [])


@pytest.mark.parametrize("text", ["no-equals-sign", "=--scheduler continuous", "x=--flag 'unclosed"])
def test_malformed_config_is_refused(text):
    with pytest.raises(sweep.SweepError):
        sweep.parse_config(text)


def test_configs_keep_their_order_and_refuse_a_repeated_name():
    configs = sweep.parse_configs(list(sweep.DEFAULT_CONFIGS))
    assert list(configs) == ["continuous-N1", "fixed_steps-N2"]
    assert configs["fixed_steps-N2"] == ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "2"]
    with pytest.raises(sweep.SweepError):
        sweep.parse_configs(["a=--x", "a=--y"])


def test_integer_lists_are_distinct_positive_integers():
    assert cli.positive_ints("1,2,4, 64") == [1, 2, 4, 64]
    for bad in ("", "1,x", "0,2", "2,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.positive_ints(bad)


def test_a_bad_list_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.build_parser().parse_args(["--concurrency", "0,2"])
    assert exit_info.value.code == 2
    assert "distinct positive integers" in capsys.readouterr().err


def test_prompts_per_point_default_to_four_per_connection_and_at_least_100():
    assert sweep.prompts_for(1, None) == 100
    assert sweep.prompts_for(64, None) == 256
    assert sweep.prompts_for(64, 50) == 50


# --- sweep: rows, medians, ratios, report ---


def metrics(req_per_s: float, p50: float = 100.0, failed: int = 0) -> dict:
    """The bench_serving figures make_row reads, as benchmark() names them."""
    return {"request_throughput": req_per_s, "output_throughput": req_per_s * 16, "mean_e2e_latency_ms": p50 + 5,
            "median_e2e_latency_ms": p50, "p90_e2e_latency_ms": p50 * 1.5, "p99_e2e_latency_ms": p50 * 2,
            "mean_ttft_ms": p50 / 10, "p99_ttft_ms": p50 / 5, "failed": failed, "completed": 100 - failed,
            "num_prompts": 100, "duration": 100 / req_per_s}


def test_row_has_every_csv_column_from_the_benchmark_metrics(tmp_path):
    row = sweep.make_row("A", 8, 2, metrics(40.0, p50=120.0, failed=1))
    assert list(row) == sweep.CSV_COLUMNS
    assert row["config"] == "A" and row["concurrency"] == 8 and row["round"] == 2
    assert row["req_per_s"] == 40.0 and row["output_tok_per_s"] == 640.0
    assert row["median_e2e_ms"] == 120.0 and row["p99_e2e_ms"] == 240.0 and row["p99_ttft_ms"] == 24.0
    assert row["failed"] == 1 and row["completed"] == 99 and row["duration_s"] == 2.5

    sweep.CsvLog(str(tmp_path / "sweep.csv")).add(row)
    with open(tmp_path / "sweep.csv") as f:
        (read,) = list(csv.DictReader(f))
    assert read["config"] == "A" and float(read["req_per_s"]) == 40.0 and read["failed"] == "1"


def test_each_point_is_checked_against_the_first_answers_at_its_concurrency():
    check = sweep.OutputCheck()
    assert check.differences(2, ["a", "b", "c"]) == 0  # the first run at 2 is the reference
    assert check.differences(2, ["a", "x", "c"]) == 1
    assert check.differences(2, ["a", None, "y"]) == 1  # a failure is counted as failed, not here
    assert check.differences(32, ["x", "x", "x"]) == 0  # another concurrency has its own reference


def test_the_answer_verdict_names_every_point_that_differs():
    rows = hand_made_rows()
    assert sweep.format_output_check(rows).startswith("answers: identical")
    rows[1]["outputs_differ"] = 3
    verdict = sweep.format_output_check(rows)
    assert "DIFFER" in verdict and "A round 1 concurrency 4: 3 of 100 prompts" in verdict


def hand_made_rows() -> list[dict]:
    """Two configs, two concurrencies, three rounds; B has no point at concurrency 4."""
    rows = []
    for round_index, noise in enumerate((1.0, 1.2, 0.9), start=1):
        rows.append(sweep.make_row("A", 1, round_index, metrics(10 * noise, p50=50 * noise)))
        rows.append(sweep.make_row("A", 4, round_index, metrics(20 * noise, p50=80 * noise)))
        rows.append(sweep.make_row("B", 1, round_index, metrics(30 * noise, p50=40 * noise)))
    return rows


def test_medians_over_rounds_and_ratios_to_the_first_config():
    summary = sweep.medians(hand_made_rows())
    assert summary[("A", 1)]["req_per_s"] == pytest.approx(10.0)
    assert summary[("A", 4)]["median_e2e_ms"] == pytest.approx(80.0)
    assert summary[("B", 1)]["req_per_s"] == pytest.approx(30.0)
    ratios = sweep.throughput_ratios(summary, ["A", "B"], [1, 4])
    assert ratios[1] == {"A": 1.0, "B": pytest.approx(3.0)}
    assert ratios[4]["A"] == 1.0 and math.isnan(ratios[4]["B"])


def test_summary_and_ratio_tables_name_every_point():
    summary = sweep.medians(hand_made_rows())
    table = sweep.format_summary(summary, ["A", "B"], [1, 4])
    assert len(table.splitlines()) == 1 + 3  # header, A@1, A@4, B@1
    ratios = sweep.format_ratios(sweep.throughput_ratios(summary, ["A", "B"], [1, 4]), ["A", "B"])
    assert "3.00" in ratios and "nan" in ratios


def test_per_round_ratios_pair_each_run_with_the_baselines_run_of_its_round():
    rows = hand_made_rows()
    rows[-1]["req_per_s"] = 36.0  # B at 1, round 3: 36 against A's 9 in that round
    ratios = sweep.round_ratios(rows, ["A", "B"])
    assert ratios == {("B", 1): [pytest.approx(3.0), pytest.approx(3.0), pytest.approx(4.0)]}
    text = sweep.format_round_ratios(ratios)
    assert "B at 1: median 3.00, rounds 3.00-4.00" in text
    assert sweep.format_round_ratios(sweep.round_ratios(rows[:3], ["A", "B"])) == ""  # one round: nothing


def test_plots_are_written_as_non_empty_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = sweep.plot(sweep.medians(hand_made_rows()), ["A", "B"], [1, 4], str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["throughput.png", "latency.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 1000


# --- servers ---

# A stand-in for a server: answers /health on the port given last. With "worker" it first starts a
# child that ignores SIGTERM and logs its pid, as a LitServe worker outlives a SIGTERM to its leader.
STAND_IN = """
import http.server, subprocess, sys
if sys.argv[1] == "worker":
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    print("worker", subprocess.Popen([sys.executable, "-c", ignore]).pid, flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(sys.argv[-1])), Health).serve_forever()
"""


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an orphan is reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_soon(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


def test_a_missing_model_folder_other_than_the_default_is_an_error(tmp_path):
    with pytest.raises(servers.ServerError):
        servers.ensure_model(str(tmp_path / "nowhere"))


def test_a_server_answers_health_inside_the_block_and_is_stopped_after_it(tmp_path):
    with servers.running_server([sys.executable, "-c", STAND_IN, "plain"], str(tmp_path / "s.log")) as server:
        assert servers.health_ok(server.port)
        assert server.base_url == f"http://127.0.0.1:{server.port}"
    assert _gone_soon(server.pid)


def test_a_server_that_exits_before_it_is_healthy_is_an_error_with_the_end_of_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('no config.json in /models/x'); sys.exit(3)"]
    log = str(tmp_path / "s.log")
    with pytest.raises(servers.ServerError) as caught, servers.running_server(command, log, "broken"):
        pytest.fail("the block must not run")
    assert "broken exited with 3 before answering /health" in str(caught.value)
    assert "no config.json in /models/x" in str(caught.value)


def test_a_server_in_its_own_process_group_is_stopped_with_its_workers(tmp_path):
    log = tmp_path / "s.log"
    with servers.running_server([sys.executable, "-c", STAND_IN, "worker"], str(log), own_group=True) as server:
        worker = int(log.read_text().split("worker ")[1].split()[0])
        assert _running(worker) and os.getpgid(worker) == server.pid
    assert _gone_soon(server.pid) and _gone_soon(worker)


# --- offline ---


def test_quota_hands_out_a_fixed_number_of_batches_or_at_least_one_before_the_deadline():
    quota = offline.BatchQuota(batches=3)
    assert [quota.claim() for _ in range(5)] == [0, 1, 2, None, None]
    timed = offline.BatchQuota(seconds=0.0)
    assert timed.claim() == 0
    with pytest.raises(ValueError):
        offline.BatchQuota()


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    import torch

    return offline.ModelRunner(tiny_model_dir, torch.device("cpu"))


@pytest.fixture(scope="module")
def pool(runner):
    return [p.prompt for p in offline.bench.make_random_prompts(runner.tokenizer, 8, 8, 2, seed=0)]


@pytest.fixture
def one_slot(runner):
    slots = offline.start_slots(runner.device, 1)
    yield slots
    for slot in slots:
        slot.stop()


def test_offline_throughput_counts_exactly_the_requests_and_tokens_it_ran(runner, pool, one_slot):
    measured = offline.measure_throughput(runner, one_slot, pool, batch_size=2, output_len=2,
                                          quota=offline.BatchQuota(batches=2))
    # The unmeasured warm-up batch is not counted.
    assert (measured.batches, measured.requests, measured.prompt_tokens, measured.output_tokens) == (2, 4, 32, 8)
    record = measured.record("throughput")
    assert record["request_throughput"] == pytest.approx(4 / measured.seconds)
    assert record["output_throughput"] == pytest.approx(8 / measured.seconds)
    assert len(measured.batch_seconds) == 2 and record["median_batch_ms"] > 0


def test_offline_latency_runs_one_request_at_a_time(runner, pool, one_slot):
    measured = offline.measure_latency(runner, one_slot, pool, output_len=2, runs=3)
    assert (measured.batches, measured.requests, measured.output_tokens) == (3, 3, 6)
    assert offline.describe_slot(one_slot[0]).startswith("cpu with")


def test_offline_table_lists_throughput_points_then_latencies(runner, pool, one_slot):
    latency = offline.measure_latency(runner, one_slot, pool, output_len=2, runs=1).record("latency", slot="cpu")
    point = offline.measure_throughput(runner, one_slot, pool, 2, 2, offline.BatchQuota(batches=1)).record("throughput")
    lines = offline.format_table([latency, point]).splitlines()
    assert len(lines) == 3 and lines[1].split()[:3] == ["1", "2", "1"] and "single request" in lines[2]


forward_profile = _import_perf_script("forward_profile")


def test_forward_profile_times_the_server_prefill_and_counts_its_operators(runner, pool):
    seconds = forward_profile.time_forwards(runner, pool[:2], runs=3)
    assert len(seconds) == 3 and min(seconds) > 0
    prof = forward_profile.profile_forward(runner, pool[:2])
    assert prof["operators"] > 50  # a transformer layer alone is dozens of aten calls
    assert (prof["launches"], prof["device_ms"]) == (0, 0.0)  # CPU: no kernels to launch
    assert len(prof["top_host"]) > 0 and all(ms >= 0 for _, _, ms in prof["top_host"])


decode_step = _import_perf_script("decode_step")


def test_decode_step_times_steps_and_counts_the_hosts_calls(runner, pool):
    import torch

    with torch.inference_mode():
        seconds, tokens = decode_step.steps(runner, pool[0], 3)
        calls, modules = decode_step.host_counts(runner, pool[0], count=2)
    assert len(seconds) == len(tokens) == 3 and all(wall > 0 and cpu >= 0 for wall, cpu in seconds)
    assert calls > 10 and modules >= 1  # the LM head's step ends at the model's own call at least


# --- ceiling: ratios and verdicts from recorded figures ---

ceiling = _import_perf_script("ceiling")


def served_point(req_s: float, median_ms: float) -> dict:
    return {"request_throughput": req_s, "median_e2e_latency_ms": median_ms}


def test_ceiling_round_divides_latency_by_the_single_request_and_throughput_by_the_ceiling():
    offline = {"ceiling_req_s": 600.0, "ceiling_batch": 16, "single_ms": 5.0}
    row = ceiling.round_row(2, offline, {1: served_point(170.0, 5.5), 32: served_point(510.0, 60.0)})
    assert row["round"] == 2 and row["ceiling_batch"] == 16
    assert row["served"][1]["latency_ratio"] == pytest.approx(1.1)
    assert row["served"][32]["throughput_ratio"] == pytest.approx(0.85)
    assert "throughput_ratio" not in row["served"][1] and "latency_ratio" not in row["served"][32]


def test_ceiling_summary_takes_medians_over_rounds_and_judges_each_target():
    offline = {"ceiling_req_s": 100.0, "ceiling_batch": 8, "single_ms": 10.0}
    rounds = [ceiling.round_row(i, offline, {1: served_point(90.0, ms), 8: served_point(r, 1.0),
                                             32: served_point(r, 1.0)})
              for i, (ms, r) in enumerate([(10.5, 80.0), (12.0, 90.0), (11.5, 84.0)], 1)]
    lines = ceiling.summarize(rounds)
    assert "  c=1: served median E2E / offline single request = 1.150 (target <= 1.10: not met)" in lines
    assert "  c=8: served / ceiling = 0.840" in lines  # below 32: no target
    assert "  c=32: served / ceiling = 0.840 (target >= 0.85: not met)" in lines
    faster = [ceiling.round_row(1, offline, {1: served_point(90.0, 10.9), 32: served_point(86.0, 1.0)})]
    assert ceiling.summarize(faster)[1:] == [
        "  c=1: served median E2E / offline single request = 1.090 (target <= 1.10: met)",
        "  c=32: served / ceiling = 0.860 (target >= 0.85: met)"]


# --- profile_server: how samples split the measured CPU time ---

profile = _import_perf_script("profile_server")


def test_profile_samples_name_their_stage_and_a_slot_waiting_for_work_is_idle():
    slot = ["Thread.run (threading.py:982)"]
    assert profile.stage_of(slot + ["ExecutionSlot._run (xllm_async/runtime/executor.py:51)"]) == "idle"
    assert profile.stage_of(slot + ["ExecutionSlot._run (xllm_async/runtime/executor.py:53)",
                                    "GenerationBatch.prefill (xllm_async/execution/batch.py:43)",
                                    "Linear.forward (torch/nn/modules/linear.py:125)"]) == "forward"
    assert profile.stage_of(["parse_completion (xllm_async/api/requests.py:80)"]) == "parse"
    assert profile.stage_of([]) == "loop"


def test_profile_shares_slot_cpu_over_busy_samples_and_leaves_the_loop_rest_to_c_code():
    table = {"slot": {"forward": 300, "sample": 100, "idle": 600},
             "loop": {"parse": 10, "respond": 5, "loop": 500, "idle": 3}}
    seconds = profile.stage_seconds(table, {"slot": 4.0, "loop": 0.5}, rate=100)
    assert seconds["forward"] == pytest.approx(3.0) and seconds["sample"] == pytest.approx(1.0)
    assert seconds["parse"] == pytest.approx(0.1) and seconds["respond"] == pytest.approx(0.05)
    assert seconds["loop"] == pytest.approx(0.35)  # the loop thread's CPU beyond its Python samples
    assert "idle" not in seconds


# --- trace_c1: a request's stretches from tracepoints ---

trace_c1 = _import_perf_script("trace_c1")

# One request as `perf script -F tid,time,event,trace` prints it: client 30, loop 10, slot 11.
ONE_REQUEST = """
   30 100.000100: syscalls:sys_enter_write: fd: 0x0000000f, buf: 0x1, count: 0x00000a25
   10 100.000140:  syscalls:sys_exit_epoll_pwait: 0x1
   10 100.000150:  syscalls:sys_exit_epoll_pwait: 0x0
   10 100.000260:             sched:sched_waking: comm=python pid=11 prio=125 target_cpu=000
   10 100.000265:        syscalls:sys_exit_futex: 0x1
   11 100.000310:        syscalls:sys_exit_futex: 0x0
   11 100.004310:       syscalls:sys_enter_write: fd: 0x00000009, buf: 0x2, count: 0x00000008
   11 100.004320:       syscalls:sys_enter_write: fd: 0x00000009, buf: 0x2, count: 0x00000008
   10 100.004370:  syscalls:sys_exit_epoll_pwait: 0x1
   10 100.004430:       syscalls:sys_enter_write: fd: 0x00000010, buf: 0x3, count: 0x00000231
   10 100.004440:             sched:sched_waking: comm=python pid=30 prio=120 target_cpu=001
   30 100.004480:  syscalls:sys_exit_epoll_pwait: 0x1
"""


def test_a_traced_request_splits_into_its_wake_ups_and_its_work():
    events = trace_c1.parse_events(ONE_REQUEST)
    found = trace_c1.split_requests(events, loop=10, server_threads={10, 11}, client=30)
    micros = {name: round(values[0] * 1e6) for name, values in found.items()}
    assert micros == {"client -> loop wake-up": 40, "loop: request to slot": 120, "loop -> slot wake-up": 50,
                      "slot: prefill": 4000, "slot -> loop wake-up": 60, "loop: tokens to response": 60,
                      "loop -> client wake-up": 50}
    assert "beyond the prefill: 380.0 us" in trace_c1.format_table(found)


def test_a_request_the_trace_cut_short_is_left_out():
    # The trace starts after the client's write: the first request has no start and is not counted.
    events = trace_c1.parse_events(ONE_REQUEST.split("\n", 2)[2] + ONE_REQUEST)
    found = trace_c1.split_requests(events, loop=10, server_threads={10, 11}, client=30)
    assert {len(values) for values in found.values()} == {1}
    # A slot that is not one of the server's threads is not taken for one.
    found = trace_c1.split_requests(trace_c1.parse_events(ONE_REQUEST), loop=10, server_threads={10}, client=30)
    assert all(not values for values in found.values())
    assert trace_c1.format_table(found).startswith("no complete request")


def test_open_loop_pools_runs_and_pairs_passes_within_each_run(tmp_path):
    """Interleaved runs saved as JSON report as one: medians over every pass, and each configuration
    over the baseline within the same pass of the same run (never across runs)."""
    open_loop = _import_perf_script("open_loop")
    args = vars(open_loop.build_parser().parse_args(["--interleave", "2"])) | {"model": "m"}
    paths = []
    for run, slow in enumerate((1.0, 10.0)):  # the second run's host was ten times slower
        rows = [{"round": 0, "config": c, "fraction": "capacity", "rate": 100.0, "req_s": 100.0, "mean_ms": 1.0,
                 "p99_ms": 1.0, "failed": 0} for c in ("a", "b")]
        rows += [{"round": p, "config": c, "fraction": 0.5, "rate": 50.0, "req_s": 50.0, "mean_ms": m * slow,
                  "p99_ms": 2 * m * slow, "failed": 0} for p in (0, 1) for c, m in (("a", 10.0), ("b", 8.0))]
        path = tmp_path / f"run{run}.json"
        path.write_text(json.dumps({"args": args, "rows": rows}))
        paths.append(str(path))
    pooled_rows, pooled_args = open_loop.pooled(paths)
    assert pooled_args.fractions == [0.5] and len(pooled_rows) == 12
    line = next(x for x in open_loop.report(pooled_rows, pooled_args).splitlines() if x.startswith("| 50%"))
    assert "(0.80x / 0.80x)" in line  # b is 0.8x of a in every pass, whatever each run's host did
