"""ds_hilore: HiLoRe activation recovery for DeepSpeed (store / compress / recompute)."""

from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).with_name("README.md")

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
    # torch carries no version bound: pip keeps whatever build (CPU, CUDA, ROCm) is installed.
    install_requires=[
        "torch",
        "deepspeed",
        "transformers",
        "peft",
        "mpi4py",
        "numpy",
        "pydantic>=2",
        "hjson",  # ds_config files are read as DeepSpeed reads them
    ],
    extras_require={"test": ["pytest", "pytest-timeout"]},
    entry_points={"console_scripts": ["hilore=ds_hilore.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
