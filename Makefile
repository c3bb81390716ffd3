# `make test` and `make demo` work on a fresh machine: both create .venv first.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ds_hilore-installed
# torch is installed on its own, before anything that depends on it: resolved as a
# dependency (deepspeed, transformers, peft), pip would pick the newest release, a CUDA
# build of several GB. TORCH_PIP_ARGS can add e.g. an index of CPU-only wheels.
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
# Per-test limit in seconds: a hung collective fails its test instead of the whole run.
TEST_TIMEOUT ?= 900
PYTEST_ARGS ?=

.PHONY: venv test demo

venv: $(STAMP)

# Reinstalls when setup.py changes; otherwise a second `make` does nothing here.
$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(BIN)/pip install mpich mpi4py
	$(BIN)/pip install -e ".[test]"
	touch $@

test: venv
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest tests -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) $(PYTEST_ARGS)

# The same seeded GRPO run (2 ranks, ZeRO-2, LoRA) with gradient checkpointing and with HiLoRe,
# then side by side; writes under output/demo. Extra trainer arguments: make demo DEMO_ARGS="...".
DEMO_ARGS ?=
demo: venv
	$(BIN)/python -m examples.grpo.demo $(DEMO_ARGS)
