"""perf/restart_spread.py's pure pieces: variants from the command line and the spread figures."""

from __future__ import annotations

import pytest

from .test_perf_tools import _import_perf_script

restart_spread = _import_perf_script("restart_spread")


def test_variants_are_names_with_environment_variables_in_order():
    variants = restart_spread.parse_variants(["huge=", "4k=XLLM_HUGE_PAGES=off OMP_PROC_BIND=close"])
    assert variants == [("huge", {}), ("4k", {"XLLM_HUGE_PAGES": "off", "OMP_PROC_BIND": "close"})]


@pytest.mark.parametrize("texts", [["a=NOVALUE"], ["a=", "a=X=1"], ["=X=1"]])
def test_a_malformed_or_repeated_variant_is_refused(texts):
    with pytest.raises(restart_spread.sweep.SweepError):
        restart_spread.parse_variants(texts)


def test_spread_is_max_over_min_and_the_coefficient_of_variation():
    figures = restart_spread.spread([10.0, 12.0, 11.0, 9.0, 8.0])
    assert figures["median"] == 10.0
    assert figures["max_over_min"] == pytest.approx(0.5)
    assert figures["cv"] == pytest.approx(2 ** 0.5 / 10)  # population stdev sqrt(2) over the mean 10
    assert restart_spread.spread([5.0, 5.0])["cv"] == 0.0


def test_a_side_line_names_each_process_figure_its_load_and_whether_the_tokens_agree():
    rows = [{"ms": 10.0, "load": 1.0, "answer": [1, 2]}, {"ms": 11.0, "load": 2.5, "answer": [1, 2]}]
    line = restart_spread.format_side("huge", "served", rows)
    assert "10.00  11.00" in line and "max/min - 1 10.0%" in line and "load 1.0 2.5" in line
    assert line.endswith("same tokens: True")
    rows[1]["answer"] = [1, 3]
    assert restart_spread.format_side("huge", "served", rows).endswith("same tokens: False")
