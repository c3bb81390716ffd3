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
# The slowest tests are listed at the end of every run (the suite's time is mostly launches).
PYTEST_ARGS ?= --durations=15
# pytest-xdist workers, a whole test module each (NOTE [ Two test workers ] in tests/conftest.py);
# 0 runs the suite in one process.
PYTEST_WORKERS ?= 2
# tests/test_openrlhf.py checks examples/README.md's OpenRLHF command against this release's
# argument parser; it reads OpenRLHF's sources only, so the package goes in without its
# dependencies (Ray, vLLM, flash-attn), which leaves every other package of the environment as
# it was.
# Its wheels are CPython 3.10-3.12, x86-64, with no sdist: elsewhere the install is skipped
# with a note, and the test skips.
# It goes into a folder of its own, off sys.path: its wheel also carries a top-level `tests`
# package, which in site-packages would shadow this repository's tests.
OPENRLHF_VERSION ?= 0.11.2
OPENRLHF_SOURCES := $(VENV)/sources/openrlhf
# DeepSpeed builds its C++ ops (the CPU all-reduce) on first use into torch's extension cache,
# by default ~/.cache/torch_extensions, shared by every DeepSpeed on the machine: another
# version's build of the same op name is loaded as if it were ours ("module 'deepspeed_shm_comm'
# has no attribute ..."). The project's builds stay in its environment; the variable reaches
# every launched rank, which inherits the environment. `make test TORCH_EXTENSIONS_DIR=...`
# overrides it; a value in the shell's environment does not.
TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: venv test demo

venv: $(STAMP)

# Reinstalls when setup.py changes; otherwise a second `make` does nothing here.
$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(BIN)/pip install mpich mpi4py
	$(BIN)/pip install -e ".[test,mpi]"
	rm -rf $(OPENRLHF_SOURCES) && $(BIN)/pip install --no-deps --target $(OPENRLHF_SOURCES) openrlhf==$(OPENRLHF_VERSION) || \
		echo "note: no openrlhf $(OPENRLHF_VERSION) wheel for this Python/platform: tests/test_openrlhf.py will skip"
	touch $@

test: venv
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(TORCH_EXTENSIONS_DIR) $(BIN)/python -m pytest tests -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The same seeded GRPO run (2 ranks, ZeRO-2, LoRA) with gradient checkpointing and with HiLoRe,
# then side by side; writes under output/demo. Extra trainer arguments: make demo DEMO_ARGS="...".
DEMO_ARGS ?=
demo: venv
	TORCH_EXTENSIONS_DIR=$(TORCH_EXTENSIONS_DIR) $(BIN)/python -m examples.grpo.demo $(DEMO_ARGS)

# Wheels for examples/bench/gpu.sh, which installs on a GPU machine without a package registry:
# deepspeed and what the machine may lack, at this .venv's versions (GPU_PYTHON: its Python).
.PHONY: gpu-wheels
gpu-wheels: venv
	examples/bench/gpu_wheels.sh
