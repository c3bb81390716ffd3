"""The project's own environment: its JIT-built ops never come from another DeepSpeed's cache."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from launch import REPO_ROOT, _environment

EXTENSIONS = f"TORCH_EXTENSIONS_DIR={REPO_ROOT / '.venv' / 'torch_extensions'}"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
@pytest.mark.parametrize("target, command", [("test", "-m pytest tests"), ("demo", "-m examples.grpo.demo")])
def test_make_targets_build_torch_extensions_inside_the_environment(target, command):
    # a shell value must not send the build back to a shared cache; the make variable may
    env = {"TORCH_EXTENSIONS_DIR": "/tmp/shared_torch_extensions", "PATH": "/usr/bin:/bin"}
    dry = subprocess.run(["make", "-n", target], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    line = next(line for line in dry.splitlines() if command in line)
    assert EXTENSIONS in line.split()
    override = subprocess.run(["make", "-n", target, "TORCH_EXTENSIONS_DIR=/elsewhere"], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, check=True).stdout
    assert "TORCH_EXTENSIONS_DIR=/elsewhere" in next(x for x in override.splitlines() if command in x)


def test_launched_ranks_inherit_the_extension_cache(monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/some/env/torch_extensions")
    assert _environment()["TORCH_EXTENSIONS_DIR"] == "/some/env/torch_extensions"
