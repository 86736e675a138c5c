"""Puts perf/ on sys.path, so that an experiment imports perf/'s tools (cli, servers, sweep,
bench_serving) by name, as the scripts in perf/ do (Python puts only a script's own folder there)."""

import os
import sys

PERF_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PERF_DIR not in sys.path:
    sys.path.insert(0, PERF_DIR)
