"""The OpenRLHF section of examples/README.md, against the OpenRLHF release it names.

Runs only where OpenRLHF's files are present (``make`` puts them, ``--no-deps``, in
``.venv/sources/openrlhf``, off sys.path; its Ray trainer needs Ray and vLLM, which are not). What it imports: nothing of OpenRLHF's. The
argument parser of ``openrlhf.cli.train_ppo_ray`` is built inline under
``if __name__ == "__main__":`` next to imports of Ray and vLLM, so the test reads that file's
source (found in the package's folder, which is never imported), runs its standard-library imports and the statements that build the
parser, and parses the section's command line and flags with it. The class names the section
gives for per-engine settings are checked in the sources the same way.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "examples" / "README.md"
SECTION = "\n## OpenRLHF\n"  # from this heading to the next one of its level
# flags of other tools the section names: `ray job submit`'s (before its `--`) and pip's
OTHER_TOOLS_FLAGS = {"--address", "--runtime-env-json", "--no-deps"}


# ``make`` installs OpenRLHF's files here, off sys.path (its wheel carries a top-level ``tests``
# package that would shadow this suite's); an installed openrlhf is used when this is absent.
SOURCES = Path(__file__).resolve().parents[1] / ".venv" / "sources" / "openrlhf"


def _distribution():
    found = list(importlib.metadata.distributions(name="openrlhf", path=[str(SOURCES)]))
    if found:
        return found[0], SOURCES / "openrlhf"
    try:
        spec = importlib.util.find_spec("openrlhf")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        pytest.skip("openrlhf is not installed (make installs it with pip install --no-deps "
                    "--target .venv/sources/openrlhf openrlhf==<the version examples/README.md "
                    "names>)")
    return importlib.metadata.distribution("openrlhf"), Path(spec.submodule_search_locations[0])


def _openrlhf_version() -> str:
    return _distribution()[0].version


def _source(module: str) -> str:
    """A module's source, read from the package's folder: nothing is imported
    (``openrlhf.utils``'s ``__init__`` imports its whole stack)."""
    _, *rest = module.split(".")
    root = _distribution()[1]
    return root.joinpath(*rest[:-1], rest[-1] + ".py").read_text(encoding="utf-8")


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _ppo_parser() -> argparse.ArgumentParser:
    """train_ppo_ray's parser, built from its source without importing the module."""
    tree = ast.parse(_source("openrlhf.cli.train_ppo_ray"))
    stdlib = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
              and all((alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
                      in sys.stdlib_module_names for alias in node.names)]
    main = next(node for node in tree.body if isinstance(node, ast.If)
                and "__main__" in ast.unparse(node.test))
    building = []
    for statement in main.body:
        if "parse_args" in ast.unparse(statement):
            break
        building.append(statement)
    namespace: dict = {}
    exec(compile(ast.Module(body=stdlib + building, type_ignores=[]), "train_ppo_ray", "exec"), namespace)
    return namespace["parser"]


def test_the_readme_names_the_openrlhf_version_installed():
    version = _openrlhf_version()
    assert f"OpenRLHF {version}" in _section(), (
        f"the OpenRLHF section of examples/README.md was not checked against the installed "
        f"OpenRLHF {version}")


def test_the_readme_command_parses_with_openrlhf_s_parser():
    _openrlhf_version()
    block = re.search(r"```bash\n(.*?)```", _section(), re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    flags = [w for w in words[words.index("openrlhf.cli.train_ppo_ray") + 1:] if w != "..."]
    parser = _ppo_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(flags)
    except SystemExit:
        pytest.fail(f"train_ppo_ray rejects {flags}: {said.getvalue().strip().splitlines()[-1]}")
    assert getattr(args, "algo.advantage.estimator") == "group_norm"
    assert getattr(args, "actor.gradient_checkpointing_enable") is True


def test_every_flag_the_section_names_is_one_of_openrlhf_s():
    _openrlhf_version()
    known = {option for action in _ppo_parser()._actions for option in action.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][\w.-]*", _section())) - OTHER_TOOLS_FLAGS
    assert named and not named - known, f"flags OpenRLHF does not know: {sorted(named - known)}"


def test_the_engine_classes_the_readme_names_are_what_openrlhf_passes_to_deepspeed():
    _openrlhf_version()
    strategy = _source("openrlhf.utils.deepspeed.deepspeed")
    # the actor's engine wraps the Actor's inner transformers model, the critic's the CriticModel
    assert "raw_model = model.model if isinstance(model, Actor) else model" in strategy
    assert "model=raw_model" in strategy
    assert re.search(r"^\s+class CriticModel\(", _source("openrlhf.models.model"), re.M)
    section = _section()
    assert "`CriticModel`" in section and "`Actor.model`" in section
