"""ds_hilore: HiLoRe activation recovery for DeepSpeed (store / compress / recompute)."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

README = Path(__file__).with_name("README.md")

# NOTE [ Autoload ] (ds_hilore/integrations/autoload.py): Python's `site` runs this line at every interpreter
# start. Without DS_HILORE / DS_HILORE_CONFIG it costs two look-ups and imports nothing.
AUTOLOAD_PTH = ("ds_hilore_autoload.pth",
                'import os; (os.environ.get("DS_HILORE") or os.environ.get("DS_HILORE_CONFIG")) '
                'and __import__("_ds_hilore_autoload").install()\n')


class BuildPyWithPth(build_py):
    """Puts the .pth at the root of the wheel, i.e. into site-packages."""

    def run(self):
        super().run()
        if not self.editable_mode:
            name, line = AUTOLOAD_PTH
            Path(self.build_lib, name).write_text(line, encoding="utf-8")


class EditableWheelWithPth(editable_wheel):
    """`pip install -e .`: the editable wheel carries the .pth too (setuptools' strategy only
    writes its own)."""

    def _select_strategy(self, name, tag, build_lib):
        return _WithPth(super()._select_strategy(name, tag, build_lib))


class _WithPth:
    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        name, line = AUTOLOAD_PTH
        wheel.writestr(name, line.encode("utf-8"))

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


setup(
    name="ds_hilore",
    version="0.1.0",
    description=("HiLoRe for DeepSpeed: per unit and microbatch, store activations in high "
                 "precision, store them packed, or recompute them -- a drop-in replacement "
                 "for activation checkpointing in GRPO training"),
    long_description=README.read_text(encoding="utf-8") if README.exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_hilore", "ds_hilore.*"]),
    py_modules=["_ds_hilore_autoload"],  # outside the package: importing it must not import torch
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
    # torch carries no version bound: pip keeps whatever build (CPU, CUDA, ROCm) is installed.
    # The others' lower bounds are the APIs the package calls: DeepSpeed's
    # runtime.tensor_parallel.init_utils.load_ds_config and ZeRO-3 trace queries, transformers'
    # GradientCheckpointingLayer (modeling_layers), pydantic 2's model_config / field validators.
    install_requires=[
        "torch",
        "deepspeed>=0.18",
        "transformers>=4.52",
        "peft>=0.15",
        "numpy",
        "pydantic>=2.6",
        "hjson",  # ds_config files are read as DeepSpeed reads them
        "matplotlib",  # the GRPO example's plots (examples/grpo)
    ],
    # trl: tests/test_trl.py runs TRL's GRPOTrainer; 1.16 keeps the torch, transformers,
    # deepspeed and accelerate versions above as they are.
    # mpi: only launches through mpirun need mpi4py (DeepSpeed's MPI discovery); make installs it.
    # pytest-xdist: `make test` runs the suite on two workers (NOTE [ Two test workers ] in
    # tests/conftest.py).
    extras_require={"test": ["pytest", "pytest-timeout", "pytest-xdist", "trl==1.16.0"],
                    "mpi": ["mpi4py"]},
    entry_points={"console_scripts": ["hilore=ds_hilore.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
