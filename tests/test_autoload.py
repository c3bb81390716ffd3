"""The zero-code-change path: the .pth hook, DS_HILORE / DS_HILORE_CONFIG, ``python -m ds_hilore.run``.

Subprocess tests start fresh interpreters of this venv, so they see the installed
``ds_hilore_autoload.pth`` as every Python process does. The in-process tests build 1-rank
DeepSpeed engines (as tests/test_engine.py) with ``deepspeed.initialize`` replaced and put
back afterwards. Whole training stacks are in test_trl.py and test_dschat.py.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

import ds_hilore.integrations.engine as engine_mod  # noqa: E402
from ds_hilore import HiLoReConfigError, find_runtime  # noqa: E402
from ds_hilore.integrations import autoload  # noqa: E402
from ds_hilore.run import Command, parse  # noqa: E402
from tests.launch import REPO_ROOT, free_port  # noqa: E402
from tests.workers import ds_engine_worker as worker  # noqa: E402

PTH = "ds_hilore_autoload.pth"
# NOTE [ What the .pth may cost ]
# The .pth line runs in every interpreter of the environment, so it must stay cheap: without the
# variables it imports nothing; with DS_HILORE=1 it loads only the small hook module (which
# imports nothing that was not loaded already: no torch, no deepspeed, no ds_hilore). The tests
# assert exactly which modules the line adds to sys.modules -- deterministic on any machine --
# and print the measured cost (tens of microseconds / about a millisecond on a 2-core Xeon)
# without asserting on it: a time limit would fail on a loaded machine.
_VARIABLES = (autoload.ENV_SWITCH, autoload.ENV_CONFIG)
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _python(code: str, **env: str) -> dict:
    """Runs ``code`` in a fresh interpreter of this venv; returns the JSON it prints last."""
    child_env = {k: v for k, v in os.environ.items() if k not in _VARIABLES + _DIST_ENV}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _installed_pth() -> Path:
    for directory in site.getsitepackages():
        if (Path(directory) / PTH).is_file():
            return Path(directory) / PTH
    pytest.fail(f"{PTH} is not in {site.getsitepackages()}: reinstall with pip install -e .")


# ---- the .pth at interpreter start ----------------------------------------------------------
_PROBE = """
    import json, site, sys, time, os
    heavy = ("torch", "deepspeed", "ds_hilore", "_ds_hilore_autoload")
    at_start = {name: name in sys.modules for name in heavy}
    hook_first = type(sys.meta_path[0]).__name__
    cost, added = None, None
    if "_ds_hilore_autoload" not in sys.modules:  # what site did at start (variables set here)
        os.environ.update(json.loads(sys.argv[1]))
        before = set(sys.modules)
        start = time.perf_counter()
        site.addpackage(%r, %r, set())
        cost = time.perf_counter() - start
        added = sorted(set(sys.modules) - before)
    print(json.dumps({"at_start": at_start, "hook_first": hook_first, "cost_s": cost, "added": added,
                      "after": {name: name in sys.modules for name in heavy},
                      "hook_first_after": type(sys.meta_path[0]).__name__}))
"""


def _probe(variables_after_start: dict | None = None, **env: str) -> dict:
    """A fresh interpreter reports what its start imported; with ``variables_after_start`` it
    also runs the .pth's line with those variables set, as ``site`` runs it, and reports the
    modules it added and its time (NOTE [ What the .pth may cost ]). Bytecode may be
    cached (PYTHONDONTWRITEBYTECODE unset), as on a user's machine after the first start."""
    pth = _installed_pth()
    code = textwrap.dedent(_PROBE % (str(pth.parent), pth.name))
    argv = [json.dumps(variables_after_start or {})]
    child_env = {k: v for k, v in os.environ.items()
                 if k not in _VARIABLES + _DIST_ENV + ("PYTHONDONTWRITEBYTECODE",)}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", code, *argv], env=child_env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pth_is_installed_and_names_the_hook():
    line = _installed_pth().read_text()
    assert line.startswith("import os;") and '__import__("_ds_hilore_autoload").install()' in line
    assert line.count("\n") == 1  # site runs each line on its own


def test_without_the_variables_the_pth_imports_nothing():
    got = _probe(variables_after_start={})
    nothing = {"torch": False, "deepspeed": False, "ds_hilore": False, "_ds_hilore_autoload": False}
    assert got["at_start"] == nothing and got["after"] == nothing
    assert got["added"] == []  # the line ran and imported nothing at all
    assert got["hook_first_after"] != "_DeepSpeedImportHook"
    print(f"\n.pth cost without the variables: {got['cost_s'] * 1e6:.1f} us (not asserted)")


def test_with_the_variable_the_pth_installs_the_hook_loading_only_its_module():
    got = _probe(variables_after_start={"DS_HILORE": "1"})
    assert got["after"] == {"torch": False, "deepspeed": False, "ds_hilore": False, "_ds_hilore_autoload": True}
    assert got["added"] == ["_ds_hilore_autoload"]  # nothing it imports was not loaded already
    assert got["hook_first_after"] == "_DeepSpeedImportHook"
    print(f"\n.pth cost with DS_HILORE=1 (hook module loaded and installed): "
          f"{got['cost_s'] * 1e3:.2f} ms (not asserted)")
    at_start = _probe(DS_HILORE="1")  # the real interpreter start
    assert at_start["at_start"]["_ds_hilore_autoload"] and not at_start["at_start"]["torch"]
    assert at_start["hook_first"] == "_DeepSpeedImportHook"


def test_ds_hilore_0_keeps_the_hook_out_even_with_a_config():
    got = _probe(DS_HILORE="0", DS_HILORE_CONFIG='{"force_plan": "H"}')
    assert got["hook_first"] != "_DeepSpeedImportHook" and not got["at_start"]["deepspeed"]


def test_importing_deepspeed_replaces_initialize_once():
    got = _python("""
        import importlib.util, importlib.machinery, json, sys
        hooks = lambda: sum(type(f).__name__ == "_DeepSpeedImportHook" for f in sys.meta_path)
        importlib.util.find_spec("deepspeed")  # availability checks load nothing ...
        before = hooks()  # ... and leave the hook in place
        import deepspeed
        from deepspeed import initialize
        print(json.dumps({"before": before, "after": hooks(), "type": type(deepspeed.initialize).__name__,
                          "same": initialize is deepspeed.initialize,
                          "loader": type(deepspeed.__loader__).__name__,
                          "spec_loader": type(deepspeed.__spec__.loader).__name__,
                          "wrapped": deepspeed.initialize.deepspeed_initialize.__module__,
                          "doc": deepspeed.initialize.__doc__.strip().splitlines()[0]}))
    """, DS_HILORE="1")
    assert got == {"before": 1, "after": 0, "type": "TrainingInitialize", "same": True,
                   "loader": "SourceFileLoader", "spec_loader": "SourceFileLoader", "wrapped": "deepspeed",
                   "doc": "Initialize the DeepSpeed Engine."}


# ---- switches and the block from the variables --------------------------------------------
@pytest.mark.parametrize("env,on", [
    ({}, False), ({"DS_HILORE": "1"}, True), ({"DS_HILORE": "true"}, True), ({"DS_HILORE": "0"}, False),
    ({"DS_HILORE": "off"}, False), ({"DS_HILORE": " "}, False), ({"DS_HILORE": "2"}, True),
    ({"DS_HILORE_CONFIG": "{}"}, True), ({"DS_HILORE": "0", "DS_HILORE_CONFIG": "{}"}, False),
])
def test_switched_on(env, on):
    assert autoload.switched_on(env) is on


@pytest.fixture
def variables(monkeypatch):
    for key in _VARIABLES:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_fallback_block_from_the_variables(tmp_path):
    assert autoload.fallback_block({"DS_HILORE": "1"}) == {}  # the defaults
    inline = ' {"force_plan": "H", "low_precision": "none"} '
    assert autoload.fallback_block({"DS_HILORE_CONFIG": inline}) == {"force_plan": "H", "low_precision": "none"}
    block = tmp_path / "hilore.json"
    block.write_text('{"force_plan": "R"}')
    assert autoload.fallback_block({"DS_HILORE_CONFIG": str(block)}) == {"force_plan": "R"}
    whole = tmp_path / "ds_config.json"
    whole.write_text(json.dumps({"zero_optimization": {"stage": 2}, "hilore": {"force_plan": "L"}}))
    assert autoload.fallback_block({"DS_HILORE_CONFIG": str(whole)}) == {"force_plan": "L"}


@pytest.mark.parametrize("env,pattern", [
    ({"DS_HILORE": "maybe"}, r"DS_HILORE='maybe' is not a switch\. Fix: set DS_HILORE=1"),
    ({"DS_HILORE_CONFIG": "/no/such/file.json"}, "neither inline JSON .* nor an existing file"),
    ({"DS_HILORE_CONFIG": '{"force_plan": '}, "its inline JSON does not parse"),
    ({"DS_HILORE_CONFIG": "[1]"}, "neither inline JSON"),
    ({"DS_HILORE_CONFIG": '{"hilore": 3}'}, 'holds 3; the "hilore" block must be a JSON object'),
])
def test_bad_variables_say_what_to_do(env, pattern):
    with pytest.raises(HiLoReConfigError, match=pattern):
        autoload.fallback_block(env)


def test_trains():
    base = dict(args=None, optimizer=None, model_parameters=None, config={"zero_optimization": {}},
                config_params=None)
    assert not engine_mod.trains(base)  # reference / reward / EMA engines
    assert engine_mod.trains({**base, "model_parameters": []})
    assert engine_mod.trains({**base, "optimizer": object()})
    assert engine_mod.trains({**base, "config": {"optimizer": {"type": "AdamW"}}})  # DeepSpeed builds it
    assert not engine_mod.trains({**base, "config": None})  # deepspeed.initialize reports that


# ---- python -m ds_hilore.run ----------------------------------------------------------------
@pytest.mark.parametrize("argv,expected", [
    (["train.py", "--lr", "1"], Command("train.py", False, ["--lr", "1"])),
    (["--local_rank=1", "train.py", "--lr", "1"], Command("train.py", False, ["--local_rank=1", "--lr", "1"])),
    (["--local-rank", "0", "train.py"], Command("train.py", False, ["--local-rank", "0"])),
    (["-m", "pkg.train", "--x"], Command("pkg.train", True, ["--x"])),
    (["--local_rank=0", "-m", "pkg.train", "--x"], Command("pkg.train", True, ["--local_rank=0", "--x"])),
])
def test_run_parses_launcher_arguments(argv, expected):
    assert parse(argv) == expected


@pytest.mark.parametrize("argv,pattern", [([], "no script given"), (["--lr", "1", "t.py"], "unknown option '--lr'")])
def test_run_refuses_what_it_cannot_run(argv, pattern):
    with pytest.raises(SystemExit, match=pattern):
        parse(argv)


def test_run_executes_the_script_as_main_with_initialize_replaced(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import deepspeed
        print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                          "type": type(deepspeed.initialize).__name__}))
    """))
    out = subprocess.run([sys.executable, "-m", "ds_hilore.run", "--local_rank=1", str(script), "--lr", "1"],
                         env={k: v for k, v in os.environ.items() if k not in _VARIABLES}, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"name": "__main__", "argv": [str(script), "--local_rank=1", "--lr", "1"],
                   "path0": str(tmp_path), "type": "TrainingInitialize"}


_RUN_PROBE = """
    import json, os, sys
    before = sorted(m for m in ("torch", "deepspeed") if m in sys.modules)
    import deepspeed
    print(json.dumps({"before_script": before, "type": type(deepspeed.initialize).__name__,
                      "switch": os.environ.get("DS_HILORE")}))
"""


def _run_probe(tmp_path, **env: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_RUN_PROBE))
    child_env = {k: v for k, v in os.environ.items() if k not in _VARIABLES}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-m", "ds_hilore.run", str(script)], env=child_env,
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_run_imports_neither_torch_nor_deepspeed_before_the_script(tmp_path):
    got = _run_probe(tmp_path)
    assert got["before_script"] == [] and got["type"] == "TrainingInitialize"


def test_run_sets_the_switch_for_the_processes_the_script_starts(tmp_path):
    """Ray workers of a local ray.init (and any subprocess) inherit it: the .pth installs there."""
    assert _run_probe(tmp_path)["switch"] == "1"


def test_run_honours_ds_hilore_0(tmp_path):
    got = _run_probe(tmp_path, DS_HILORE="0", DS_HILORE_CONFIG='{"force_plan": "H"}')
    assert got["type"] != "TrainingInitialize" and got["switch"] == "0"


# ---- deepspeed.initialize replaced, in this process -------------------------------------------
@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo group, as in tests/test_engine.py (the group stays for the session)."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def replaced(one_rank, variables):
    """``deepspeed.initialize`` replaced as ``python -m ds_hilore.run`` does; put back afterwards."""
    variables.setattr(deepspeed, "initialize", deepspeed.initialize)
    assert autoload.install(explicit=True)
    return variables


def _ds_config(hilore: dict | None = None, optimizer: bool = True) -> dict:
    config = json.loads((REPO_ROOT / "ds_configs" / "zero2_gc_baseline.json").read_text())
    if not optimizer:
        config.pop("optimizer")
        config["zero_optimization"]["stage"] = 0
    return config if hilore is None else {**config, "hilore": hilore}


def test_training_engines_get_hilore_the_others_stay_plain(replaced):
    policy = worker.build_model("full", gc=True)  # as the trainer left it: HF checkpointing on
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=list(policy.parameters()),
                                      config=_ds_config())
    assert type(engine).__name__ == "HiLoReDeepSpeedEngine" and engine.hilore.config.force_plan is None
    assert find_runtime(policy) is engine.hilore
    reference = worker.build_model("full", gc=False)
    ref_engine, ref_optimizer, *_ = deepspeed.initialize(model=reference, config=_ds_config(optimizer=False))
    assert type(ref_engine).__name__ == "DeepSpeedEngine" and ref_optimizer is None
    assert not hasattr(ref_engine, "hilore") and find_runtime(reference) is None
    engine.hilore.detach()


def test_block_of_the_ds_config_wins_over_the_variable(replaced):
    replaced.setenv("DS_HILORE_CONFIG", '{"force_plan": "H"}')
    lm = worker.build_model("full", gc=True)
    from_variable, *_ = deepspeed.initialize(model=lm, model_parameters=list(lm.parameters()), config=_ds_config())
    assert from_variable.hilore.config.force_plan == "H"
    from_variable.hilore.detach()
    lm = worker.build_model("full", gc=True)
    off, *_ = deepspeed.initialize(model=lm, model_parameters=list(lm.parameters()),
                                   config=_ds_config({"enabled": False}))
    assert type(off).__name__ == "DeepSpeedEngine" and off.hilore is None and find_runtime(lm) is None


def test_explicit_ds_hilore_initialize_does_not_nest(replaced):
    def through_the_replacement(self, *args, **kwargs):
        raise AssertionError("ds_hilore.initialize called the replaced deepspeed.initialize")

    replaced.setattr(autoload.TrainingInitialize, "__call__", through_the_replacement)
    lm = worker.build_model("full", gc=False)
    engine, *_ = engine_mod.initialize(model=lm, model_parameters=list(lm.parameters()),
                                       config=_ds_config({"force_plan": "R"}))
    assert engine.hilore.config.force_plan == "R" and find_runtime(lm) is engine.hilore
    engine.hilore.detach()


# ---- the script's checkpointing and settings per engine --------------------------------------
def _train_one_step(engine) -> dict:
    record = {"losses": [], "steps": []}
    worker.train(engine, "lm", 1, 1, 0, record)
    return engine.hilore.stats


@pytest.mark.parametrize("gc,activate,on", [
    (False, None, False),  # the script trains without checkpointing: as without ds_hilore
    (True, None, True),  # the script checkpoints: HiLoRe replaces it
    (False, "always", True),  # asked for in the block: HiLoRe on anyway
])
def test_zero_code_change_follows_the_scripts_checkpointing(replaced, gc, activate, on):
    block = {"force_plan": "R"} if activate is None else {"force_plan": "R", "activate": activate}
    replaced.setenv("DS_HILORE_CONFIG", json.dumps(block))
    lm = worker.build_model("full", gc=gc)
    engine, *_ = deepspeed.initialize(model=lm, model_parameters=list(lm.parameters()), config=_ds_config())
    stats = _train_one_step(engine)
    assert engine.hilore.enabled is on
    every_unit = len(stats["microbatches"]) * len(engine.hilore.units)  # force_plan R
    assert stats["recomputed_units"] == (every_unit if on else 0) and (every_unit > 0) is on
    engine.hilore.detach()


def test_explicit_initialize_turns_hilore_on_without_the_scripts_checkpointing(one_rank):
    lm = worker.build_model("full", gc=False)
    engine, *_ = engine_mod.initialize(model=lm, model_parameters=list(lm.parameters()),
                                       config=_ds_config({"force_plan": "R"}))
    stats = _train_one_step(engine)
    every_unit = len(stats["microbatches"]) * len(engine.hilore.units)
    assert engine.hilore.enabled and stats["recomputed_units"] == every_unit > 0
    engine.hilore.detach()


def test_engine_block_by_position_and_class(monkeypatch):
    monkeypatch.setenv("DS_HILORE_CONFIG", "{}")
    block = {"memory_budget": 1.3, "engines": {"RewardModel": {"force_plan": "R"}, "1": {"log_interval": 2}}}
    assert autoload.engine_block(block, 0, "OPTForCausalLM") == ({"memory_budget": 1.3}, "DS_HILORE_CONFIG")
    assert autoload.engine_block(block, 1, "RewardModel") == (
        {"memory_budget": 1.3, "force_plan": "R", "log_interval": 2},
        "DS_HILORE_CONFIG engines['RewardModel'] engines['1']")
    assert autoload.engine_block({"engines": {"0": {"memory_budget": 1.5}, "Actor": {"memory_budget": 2.0}}},
                                 0, "Actor")[0] == {"memory_budget": 1.5}  # the position wins


def test_an_engine_blocks_budget_replaces_the_budget_it_overrides(monkeypatch):
    """A budget of another kind in an engine's block replaces the shared one (the more
    specific wins), and the class and position blocks applying to one engine are checked
    together, named."""
    monkeypatch.setenv("DS_HILORE_CONFIG", "{}")
    block = {"memory_budget": 1.3, "engines": {"Qwen2ForCausalLM": {"memory_budget_bytes": 10**9},
                                               "1": {"memory_fraction": 0.5}}}
    assert autoload.engine_block(block, 0, "Qwen2ForCausalLM")[0] == {"memory_budget_bytes": 10**9}
    assert autoload.engine_block(block, 1, "Qwen2ForCausalLM")[0] == {"memory_fraction": 0.5}
    assert autoload.engine_block(block, 1, "RewardModel")[0] == {"memory_fraction": 0.5}
    with pytest.raises(HiLoReConfigError, match=r"""DS_HILORE_CONFIG "engines"\['1'\]: .*force_plan"""):
        autoload.engine_block({"engines": {"1": {"force_plan": "Q"}}}, 0, "OPTForCausalLM")


@pytest.mark.parametrize("engines,pattern", [
    ([1, 2], "must map an engine"),
    ({"1": "R"}, "must map an engine"),
    ({"1": {"force_plan": "Q"}}, "force_plan"),  # the second engine's typo stops the first's start
    ({"RewardModel": {"memory_budgt": 1.2}}, "memory_budget"),
])
def test_engine_blocks_are_checked_at_the_first_engine(engines, pattern):
    with pytest.raises(HiLoReConfigError, match=pattern):
        autoload.engine_block({"engines": engines}, 0, "OPTForCausalLM")


def test_settings_reach_each_training_engine_in_order(replaced, monkeypatch, capfd):
    monkeypatch.setattr(autoload, "_TRAINING_ENGINES", autoload._TrainingEngines())
    replaced.setenv("DS_HILORE_CONFIG", json.dumps(
        {"force_plan": "H", "engines": {"1": {"force_plan": "R"}}}))
    engines = []
    for _ in range(2):  # actor, then critic
        lm = worker.build_model("full", gc=True)
        engines.append(deepspeed.initialize(model=lm, model_parameters=list(lm.parameters()),
                                            config=_ds_config())[0])
        reference = worker.build_model("full", gc=False)  # not counted: it does not train
        deepspeed.initialize(model=reference, config=_ds_config(optimizer=False))
    assert [e.hilore.config.force_plan for e in engines] == ["H", "R"]
    lines = [line for line in capfd.readouterr().out.splitlines() if "HiLoRe engine" in line]
    assert len(lines) == 2
    assert "training engine 0" in lines[0] and "force_plan H" in lines[0] and \
        lines[0].endswith("settings: DS_HILORE_CONFIG")
    assert "training engine 1" in lines[1] and lines[1].endswith("settings: DS_HILORE_CONFIG engines['1']")
    for engine in engines:
        engine.hilore.detach()
