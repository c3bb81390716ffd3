#!/usr/bin/env bash
# Fills a folder with what examples/bench/gpu.sh installs on a GPU machine without a package
# registry: deepspeed (built here into a wheel from its sdist; pure Python, its ops are built
# on first use) and every package the GPU machine may lack, each at the version this checkout's
# .venv runs, as binary wheels for the GPU machine's Python. torch is never fetched.
#
#   examples/bench/gpu_wheels.sh [DIR]          (make gpu-wheels)
#   GPU_PYTHON=3.12 GPU_PLATFORM=manylinux_2_28_x86_64 examples/bench/gpu_wheels.sh
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$REPO/examples/bench/wheels}"
VENV_PY="${VENV_PY:-$REPO/.venv/bin/python}"
GPU_PYTHON="${GPU_PYTHON:-3.12}"  # the GPU machine's Python (its torch decides it)
GPU_PLATFORM="${GPU_PLATFORM:-manylinux_2_28_x86_64}"

# packages deepspeed, ds_hilore and the bench's plot need beyond what the GPU machine ships
# (torch, transformers, peft, accelerate, mpi4py, and with them numpy, packaging, tqdm, psutil):
# pure Python ones, then compiled ones. Under the 64 MiB a run carries. typing-extensions too:
# the machine has one, which pydantic may need newer (gpu.sh upgrades it only then).
PURE="hjson py-cpuinfo einops pydantic annotated-types typing-inspection typing-extensions
      cycler pyparsing python-dateutil tzdata"
COMPILED="ninja msgpack pydantic-core matplotlib contourpy fonttools kiwisolver pillow"

mkdir -p "$DIR"
version() { "$VENV_PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }

ds="$(version deepspeed)"
echo "deepspeed $ds: wheel built from its sdist (no ops prebuilt)"
DS_BUILD_OPS=0 "$VENV_PY" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$DIR" "deepspeed==$ds"

for pkg in $PURE; do
    "$VENV_PY" -m pip download --no-deps --only-binary=:all: --dest "$DIR" "$pkg==$(version "$pkg")"
done
for pkg in $COMPILED; do
    "$VENV_PY" -m pip download --no-deps --only-binary=:all: --dest "$DIR" \
        --python-version "$GPU_PYTHON" --implementation cp --platform "$GPU_PLATFORM" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "$pkg==$(version "$pkg")"
done
du -sh "$DIR"
