# One bootstrap for every entry point, and two environments, both built from pyproject and
# the constraints files by `make test` (or `make setup`), each once (a stamp file):
#   .venv          the main one: the whole suite, the demo and the benchmark, with
#                  Megatron-Bridge 0.6.2 on megatron-core 0.19.2 (constraints-bridge-0.6.txt);
#   .venv-bridge03 the Bridge tests again, against Megatron-Bridge 0.3.1 on megatron-core
#                  0.16.1 (constraints-bridge-0.3.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VENV03 := .venv-bridge03
STAMP03 := $(VENV03)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Importing megatron-core makes torch inductor's cache folder (/tmp/torchinductor_<user> by default):
# keep it inside the environment, so that set-up, the tests and the demo leave nothing in /tmp.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/$(VENV)/.torchinductor

# pip's expected noise, hidden: this machine's local mirror lacks folders for most names,
# and Bridge is installed --no-deps, so pip lists its own pins (transformer-engine, CUDA
# packages, wandb==0.29...) as unmet; it needs none of them for what nemo_memlog uses.
PIP_NOISE := is ignored: it is neither|dependency resolver does not currently take into account|^megatron-(bridge|core) [^ ]+ requires
PIP_INSTALL = python -m pip install --progress-bar off -c constraints.txt
# What a person sees of pip during the minutes of set-up: one line per package fetched, then the installs.
PIP_PROGRESS := ^(Collecting|Processing|Downloading|Installing collected|Successfully installed)|ERROR
# pip's output through scripts/ticker.py: the lines above (noise hidden, cut to 150 characters), and a
# line of its own after 8 s of silence saying how far pip is (packages collected, then installed of
# the ones it listed). It reads to the end of pip's output and exits 0 whatever happens in it; pip's
# status is the import check's to judge, as before.
PIP_LINES = python scripts/ticker.py pip

# $(call build_env,VENV,BRIDGE_CONSTRAINTS,EXTRA_PACKAGES): megatron-core and Megatron-Bridge
# first, --no-deps (Bridge pins transformer-engine and CUDA-only packages) and
# --ignore-requires-python (megatron-core 0.17+ and Bridge 0.4+ declare Python 3.12 and run
# on 3.11, see constraints-bridge-0.6.txt); then nemo_memlog[test] and what Bridge's training
# modules import, resolved by pip around the megatron-core already there.
define build_env
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	@echo "$(1): megatron-core and Megatron-Bridge as pinned in $(2) (--no-deps) ..."
	@$(1)/bin/$(PIP_INSTALL) -c $(2) --no-deps --ignore-requires-python megatron-core megatron-bridge 2>&1 \
		| $(1)/bin/$(PIP_LINES) $(1) --hide "$(PIP_NOISE)" --show "$(PIP_PROGRESS)" || true
	@echo "$(1): nemo_memlog[test], torch (CPU) and what Bridge's training modules import (a few minutes: pip's lines as it fetches, then how many packages are in place) ..."
	@$(1)/bin/$(PIP_INSTALL) -c $(2) -e '.[test]' transformers huggingface-hub datasets einops triton nvidia-modelopt $(3) 2>&1 \
		| $(1)/bin/$(PIP_LINES) $(1) --hide "$(PIP_NOISE)" --show "$(PIP_PROGRESS)" || true
	@echo "$(1): (pip's complaints about Megatron-Bridge's own unmet pins are expected and hidden: it is installed --no-deps)"
	@$(1)/bin/python scripts/ticker.py check $(1) $(2) 2>/dev/null \
		|| { echo "set-up of $(1) failed: see pip's output above"; exit 1; }
	@touch $(1)/.installed
endef

.PHONY: setup lint test test-fast demo bench clean prometheus-server

setup: $(STAMP) $(STAMP03) prometheus-server

# The Prometheus server tests/writers/test_otel.py starts (Debian's package), where apt-get is and
# we are root; elsewhere that check skips, saying why.
prometheus-server:
	@if command -v prometheus >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		$(PYTHON) scripts/ticker.py run "prometheus: apt-get install -y prometheus (the server tests/writers/test_otel.py scrapes our exporter with)" \
			-- sh -c "{ apt-get install -y -qq prometheus || { apt-get update -qq && apt-get install -y -qq prometheus; }; } >/dev/null 2>&1" \
			|| echo "prometheus: apt-get could not install it; tests/writers/test_otel.py's Prometheus check skips"; \
	else echo "prometheus: not installed (needs root and apt-get); tests/writers/test_otel.py's Prometheus check skips"; fi

$(STAMP): pyproject.toml constraints.txt constraints-bridge-0.6.txt Makefile
	$(call build_env,$(VENV),constraints-bridge-0.6.txt,megatron-energon)

$(STAMP03): pyproject.toml constraints.txt constraints-bridge-0.3.txt Makefile
	$(call build_env,$(VENV03),constraints-bridge-0.3.txt,)

# Style, types and the import layers first: an error fails in seconds, before the second
# environment is built and before the suite (mypy over pyproject's [tool.mypy] files; the layers
# and the other import contracts are pyproject's [tool.importlinter], checked by import-linter).
# To fix what ruff finds: .venv/bin/ruff format . && .venv/bin/ruff check --fix .
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

#: pytest-xdist's workers for `make test`: two, one per core of the 2-core machine the time is measured on.
TEST_WORKERS ?= 2

# The tests marked versions (expectations that depend on Megatron-Bridge's or megatron-core's
# version) run again in the second environment: one pytest session of it, which
# tests/test_versions.py runs as one test of this one.
test: lint $(STAMP03) prometheus-server
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The tests that start no process (no gloo cluster, torchrun, writer process or subprocess) and need
# no GPU: seconds, not minutes. Each test says which lane it is in by its own markers (pyproject.toml).
test-fast: lint
	$(PY) -m pytest -q -m "not processes and not gpu" tests

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) scripts/bench_overhead.py

clean:
	rm -rf $(VENV) $(VENV03) runs build *.egg-info
