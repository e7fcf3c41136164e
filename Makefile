# One bootstrap for every entry point: a .venv built from pyproject + constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip's output less the expected noise: constraints for packages not installed, and the
# resolver's list of megatron-bridge's requirements, missing by design (--no-deps, below).
PIP_QUIET := grep -v -e "is ignored: it is neither" -e "^ERROR: pip's dependency resolver does not currently" \
	-e "^megatron-bridge [^ ]* requires "

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing nemo_memlog[test] into $(VENV) (torch pinned by constraints.txt) ..."
	@$(PY) -m pip install -q -c constraints.txt -e '.[test]' 2>&1 | $(PIP_QUIET) || true
	@echo "installing Megatron-Bridge (--no-deps: it pins CUDA-only packages; pip's complaints about them are expected and hidden) and what its training modules import ..."
	@$(PY) -m pip install -q --no-deps -c constraints.txt megatron-bridge 2>&1 | $(PIP_QUIET) || true
	@$(PY) -m pip install -q -c constraints.txt transformers huggingface-hub datasets einops triton 2>&1 | $(PIP_QUIET) || true
	@$(PY) -c "import nemo_memlog, torch, megatron.core, tensorboard, wandb, mlflow, comet_ml, omegaconf, transformers, triton, lightning.pytorch, pytorch_lightning; from importlib.metadata import version; assert version('megatron-bridge') == '0.3.1'" 2>/dev/null \
		|| { echo "set-up failed: see pip's output above"; exit 1; }
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) scripts/bench_overhead.py

clean:
	rm -rf $(VENV) runs build *.egg-info
