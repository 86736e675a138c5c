"""perf/read_ceiling.py on the tiny model: it reads the packed weights four ways and prints each
reading's GB/s, the CPU and the step's fraction of the ceiling (figures only, no timing asserted)."""

from __future__ import annotations

import re

import pytest

from .test_perf_tools import _import_perf_script

read_ceiling = _import_perf_script("read_ceiling")


def test_the_ceiling_tool_prints_the_cpu_every_reading_and_the_fraction(tiny_model_dir, capsys):
    import torch

    from xllm_async.model import cpu_kernels

    if cpu_kernels.our_linear() is None:
        pytest.skip("no packed weights of our bfloat16 linear on this CPU")
    threads = torch.get_num_threads()
    try:
        code = read_ceiling.main(["--model", tiny_model_dir, "--dtype", "bfloat16", "--threads", "1", "--steps", "2",
                                  "--repeats", "2", "--rounds", "2", "--input-len", "8"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("CPU: ") and "transparent huge pages:" in out
    for reading in ("stream", "one linear", "linears", "step"):
        line = next(line for line in out.splitlines() if line.strip().startswith(reading))
        assert len(re.findall(r"[\d.]+ ", line.split("GB/s")[0])) == 2 and ", best " in line, line  # a figure a round
    assert re.search(r"packed weights, [\d.]+ MB; \d+ of their mappings' \d+ MiB resident on huge pages", out)
    for label in ("medians", "bests"):
        assert re.search(label + r": ceiling \(stream\) [\d.]+ GB/s; the step [\d.]+ GB/s = [\d.]+ of it", out)


def test_step_weights_are_every_layers_packed_linear_then_the_lm_head(tiny_model_dir):
    import torch

    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    weights = read_ceiling.step_weights(runner.model)
    if not weights:
        pytest.skip("no packed weights of our bfloat16 linear on this CPU")
    assert len(weights) == 4 * runner.model.shape.layers + 1  # qkv, o, gate_up, down a layer, the head
    assert weights[-1].shape[0] * 64 >= runner.vocab_size
