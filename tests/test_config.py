"""Settings from XLLM_* variables and --flags; one clear line for a bad value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from xllm_async.config import ConfigError, Settings, load_settings, options_table

from .conftest import ROOT


def test_defaults():
    s = load_settings([], {})
    assert (s.host, s.port, s.devices, s.dtype, s.scheduler) == ("127.0.0.1", 8000, "auto", "auto", "fixed_steps")
    assert (s.concurrent_execute_stream_num, s.max_tokens_per_batch, s.max_seqs_per_batch) == (2, 8192, 256)
    assert s.model is None and s.max_model_len is None


def test_environment_then_flags_override():
    env = {"XLLM_PORT": "9001", "XLLM_SCHEDULER": "continuous", "XLLM_CONCURRENT_EXECUTE_STREAM_NUM": "4"}
    s = load_settings([], env)
    assert (s.port, s.scheduler, s.concurrent_execute_stream_num) == (9001, "continuous", 4)
    s = load_settings(["--port", "9002", "--concurrent-execute-stream-num", "1"], env)
    assert (s.port, s.scheduler, s.concurrent_execute_stream_num) == (9002, "continuous", 1)


@pytest.mark.parametrize("env,needle", [
    ({"XLLM_PORT": "eighty"}, "XLLM_PORT='eighty'"),
    ({"XLLM_PORT": "70000"}, "from 1 to 65535"),
    ({"XLLM_SCHEDULER": "fastest"}, "fixed_steps, continuous"),
    ({"XLLM_DEVICES": "tpu:0"}, "XLLM_DEVICES"),
    ({"XLLM_DTYPE": "int3"}, "float32"),
    ({"XLLM_CONCURRENT_EXECUTE_STREAM_NUM": "0"}, "XLLM_CONCURRENT_EXECUTE_STREAM_NUM"),
    ({"XLLM_MAX_TOKENS_PER_BATCH": "-5"}, "XLLM_MAX_TOKENS_PER_BATCH"),
    ({"XLLM_MODEL": "/no/such/folder"}, "config.json"),
    ({"XLLM_PREFIX_CACHE": "maybe"}, "on, off"),
    ({"XLLM_PREFIX_CACHE_SHARE": "1.5"}, "between 0 and 1"),
])
def test_bad_values_name_variable_value_and_allowed(env, needle):
    with pytest.raises(ConfigError) as info:
        load_settings([], env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_flag_is_named_as_a_flag():
    with pytest.raises(ConfigError, match="--port='x'"):
        load_settings(["--port", "x"], {})


def test_server_exits_with_one_line_and_no_traceback():
    env = {**os.environ, "XLLM_SCHEDULER": "sometimes"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "server.py")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "XLLM_SCHEDULER='sometimes'" in proc.stderr and "Traceback" not in proc.stderr


def refused_at_start_up(tiny_model_dir: str, env: dict) -> str:
    """The ConfigError a Service of these settings stops at, in-process: what server.py prints as its
    one line and exits 2 on (test_server_exits_with_one_line_and_no_traceback above; for a Service's
    own refusals, test_a_bad_item_table_stops_start_up_with_one_line and
    test_a_bad_quantization_stops_the_server_with_one_line), without a process started for each."""
    import torch

    from xllm_async.service import Service

    threads = torch.get_num_threads()  # (a Service sets the loop thread's count: this process's)
    try:
        with pytest.raises(ConfigError) as refused:
            Service(load_settings([], {"XLLM_MODEL": tiny_model_dir, **env}))
    finally:
        torch.set_num_threads(threads)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def test_unavailable_device_stops_start_up_naming_it(tiny_model_dir):
    assert "XLLM_DEVICES='npu:0'" in refused_at_start_up(tiny_model_dir, {"XLLM_DEVICES": "npu:0"})


def test_readme_table_lists_every_setting():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert options_table() in readme
    assert len(options_table().splitlines()) == len(vars(Settings())) + 2


def test_help_lists_every_setting(capsys):
    """--help prints (a help text with a bare % once made argparse fail on it)."""
    with pytest.raises(SystemExit) as exit_info:
        load_settings(["--help"], {})
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--kv-cache-bytes" in out and "20% of host" in out and "XLLM_TORCH_THREADS" in out


def test_beam_rounds_limit_below_the_default_rounds_stops_start_up(tiny_model_dir):
    # XLLM_BEAM_MAX_TOKENS is 3
    assert "XLLM_MAX_BEAM_ROUNDS=2" in refused_at_start_up(tiny_model_dir, {"XLLM_MAX_BEAM_ROUNDS": "2"})
