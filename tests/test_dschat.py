"""A DeepSpeed-Chat-step-3-shaped script, unchanged, under ``deepspeed --module ds_hilore.run``.

tests/workers/dschat_grpo_worker.py builds what DeepSpeed-Chat's ``DeepSpeedRLHFEngine`` builds
with plain ``deepspeed.initialize`` calls: an actor and a critic that train (the critic a
``RewardModel`` trained through ``forward_value``, which never calls the critic module), and a
reference, a reward and an EMA engine that do not; it switches the actor's checkpointing off
around generation and on for the update every iteration, and updates the EMA with
DeepSpeed-Chat's ``moving_average``. Each launch runs 2 CPU ranks, 3 iterations of 2 micro-steps:

* ZeRO-2: the script alone (critic checkpointing on) against ``force_plan: "H"`` with a block
  for the critic alone, and against the planner with the critic's checkpointing left off;
* ZeRO-3 with DeepSpeed-Chat-style LoRA on the actor: the script alone against the planner
  (``low_precision: "none"``: every plan is H/R, exact), the critic asked in for HiLoRe.

Every plan here keeps or recomputes exactly, so every loss, reward and final weight (EMA
included) is bitwise that of the script alone, and under ZeRO-3 so is every parameter's status
after every micro-step. ~1-2 min per launch on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.launch import _BIN, REPO_ROOT, _all_output, _command, _environment, free_port
from tests.workers import dschat_grpo_worker as worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, UNITS = 3, 4  # iterations; 2 layers x (attn, mlp)


def launch(*, under_run: bool, env: dict[str, str], args: tuple[str, ...] = (), nprocs: int = 2,
           timeout: float = 300, said: list | None = None) -> list[dict]:
    """``deepspeed --module ds_hilore.run WORKER ARGS`` on ``nprocs`` CPU ranks (``under_run``),
    else the script alone, its ranks started directly (NOTE [ Three ways to start ranks ] in
    tests/launch.py: it is the reference); each rank's report (the launcher's and the ranks'
    output appended to ``said``)."""
    work = Path(tempfile.mkdtemp(prefix="hilore_dschat_"))
    result_dir, log_dir = work / "results", work / "logs"
    result_dir.mkdir()
    log_dir.mkdir()
    script_args = ["--steps", str(STEPS), *args, "--result_dir", str(result_dir)]
    port = free_port()
    if under_run:
        cmd = [str(_BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(port),
               f"--enable_each_rank_log={log_dir}", "--module", "ds_hilore.run", worker.__file__,
               *script_args]
    else:
        cmd = _command(Path(worker.__file__), script_args, nprocs, "direct", port, log_dir)
    environ = {k: v for k, v in _environment().items() if k not in ("DS_HILORE", "DS_HILORE_CONFIG")}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout:.0f} s\n{_all_output(output, log_dir)}")
    if said is not None:
        said.append(_all_output(output, log_dir))
    try:
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}\n{_all_output(output, log_dir)}")
        return [json.loads((result_dir / f"rank{rank}.json").read_text()) for rank in range(nprocs)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


ZERO3 = ("--zero_stage", "3", "--actor_lora_dim", "4")
EXACT_PLANNER = {"low_precision": "none"}  # the planner, H and R only


def _said(output: str, what: str) -> list[str]:
    return [line for line in output.splitlines() if what in line]


@pytest.fixture(scope="module")
def zero2():
    said: list[str] = []
    gc = launch(under_run=False, env={}, args=("--critic_gradient_checkpointing",))
    forced = launch(under_run=True, args=("--critic_gradient_checkpointing",), said=said, env={
        "DS_HILORE_CONFIG": json.dumps({"force_plan": "H", "engines": {"RewardModel": {"log_interval": 1}}})})
    planned = launch(under_run=True, env={"DS_HILORE_CONFIG": json.dumps(EXACT_PLANNER)})
    return gc, forced, planned, said[0]


@pytest.fixture(scope="module")
def zero3():
    gc = launch(under_run=False, env={}, args=ZERO3)
    planned = launch(under_run=True, args=ZERO3, env={"DS_HILORE_CONFIG": json.dumps(
        {**EXACT_PLANNER, "engines": {"RewardModel": {"activate": "always"}}})})
    return gc, planned


def _bitwise(gc: dict, hilore: dict) -> None:
    for key in ("losses", "critic_losses", "rewards", "param_sha"):
        assert hilore[key] == gc[key], key
    assert len(gc["losses"]) == STEPS * worker.GAS


def test_plain_launch_is_untouched(zero2):
    for rank in zero2[0]:
        assert set(rank["classes"].values()) == {"DeepSpeedEngine"} and not rank["initialize_replaced"]
        assert not rank["ds_hilore_imported"] and set(rank["hilore"].values()) == {None}
        assert rank["toggles"] == [True] * STEPS


def test_training_engines_get_hilore_the_others_stay_plain(zero2):
    for rank in zero2[1]:
        assert rank["initialize_replaced"]
        assert rank["classes"] == {"actor": "HiLoReDeepSpeedEngine", "critic": "HiLoReDeepSpeedEngine",
                                   "reference": "DeepSpeedEngine", "ema": "DeepSpeedEngine",
                                   "reward": "DeepSpeedEngine"}
        assert rank["toggles"] == [True] * STEPS  # re-enabled every iteration, HiLoRe still on


def test_force_plan_h_is_bitwise_the_script_alone_ema_included(zero2):
    gc, forced, _, _ = zero2
    for plain, hilore in zip(gc, forced, strict=True):
        _bitwise(plain, hilore)
        for name in ("actor", "critic"):  # the last step: every unit H in both micro-steps
            stats = hilore["hilore"][name]
            assert stats["actions"]["H"] == worker.GAS * UNITS and stats["recomputed_units"] == 0, name
    assert forced[0]["param_sha"] == forced[1]["param_sha"]


def test_settings_per_engine_reach_the_engine_they_name(zero2):
    _, forced, _, said = zero2
    for rank in forced:
        assert rank["hilore"]["critic"]["config"]["log_interval"] == 1
        assert rank["hilore"]["actor"]["config"]["log_interval"] == 0
        assert {rank["hilore"][name]["config"]["force_plan"] for name in ("actor", "critic")} == {"H"}
    start = _said(said, "ds_hilore: HiLoRe engine")
    assert len(start) == 2 and all("[Rank 0]" in line for line in start)  # rank 0 only
    assert "Qwen2ForCausalLM (training engine 0): 4 units in 2 decoder layers" in start[0]
    assert start[0].endswith("settings: DS_HILORE_CONFIG")
    assert "RewardModel (training engine 1): 4 units in 2 decoder layers " \
        "(rwtransformer.layers.0.attn" in start[1]
    assert start[1].endswith("settings: DS_HILORE_CONFIG engines['RewardModel']")
    steps = _said(said, "ds_hilore step")  # the critic's log_interval 1: one line per step, rank 0
    assert [line.split("ds_hilore step ")[1].split(" (")[0] for line in steps] == ["1", "2", "3"]
    assert all("RewardModel (training engine 1)" in line for line in steps)


def test_a_critic_without_checkpointing_recomputes_nothing(zero2):
    gc, _, planned, _ = zero2
    for plain, hilore in zip(gc, planned, strict=True):
        _bitwise(plain, hilore)  # the script alone checkpointed its critic: the same numbers
        critic = hilore["hilore"]["critic"]
        assert not critic["enabled"] and critic["recomputed_units"] == 0 and critic["actions"] == {}
        assert hilore["hilore"]["actor"]["planned"] == ["4x16"]


def test_zero3_planned_actor_and_critic_are_bitwise_the_script_alone(zero3):
    gc, planned = zero3
    for plain, hilore in zip(gc, planned, strict=True):
        _bitwise(plain, hilore)
        for name in ("actor", "critic"):  # the critic through forward_value: planned too
            assert hilore["hilore"][name]["planned"] == ["4x16"], name
        assert hilore["hilore"]["critic"]["enabled"]


@pytest.fixture(scope="module")
def zero3_one_rank():
    gc = launch(under_run=False, env={}, args=ZERO3, nprocs=1)
    planned = launch(under_run=True, args=ZERO3, nprocs=1, env={"DS_HILORE_CONFIG": json.dumps(
        {**EXACT_PLANNER, "engines": {"RewardModel": {"activate": "always"}}})})
    return gc, planned


def test_zero3_parameter_states_after_every_micro_step_are_deepspeeds(zero3):
    """The plan changes (profiling, then the plan, leave-one-out) re-record ZeRO-3's trace; the
    persistent parameters must still be where DeepSpeed alone leaves them."""
    _same_parameter_states(*zero3)


def test_zero3_parameter_states_on_one_rank_are_deepspeeds(zero3_one_rank):
    gc, planned = zero3_one_rank
    for plain, hilore in zip(gc, planned, strict=True):
        _bitwise(plain, hilore)
        assert hilore["hilore"]["actor"]["planned"] == ["4x16"]
    _same_parameter_states(gc, planned)


def _same_parameter_states(gc: list[dict], planned: list[dict]) -> None:
    for plain, hilore in zip(gc, planned, strict=True):
        assert len(plain["ds_status"]) == STEPS * worker.GAS
        for micro, (expected, got) in enumerate(zip(plain["ds_status"], hilore["ds_status"], strict=True)):
            for engine in ("actor", "critic", "ema"):
                differ = {n: (expected[engine][n], got[engine][n]) for n in expected[engine]
                          if expected[engine][n] != got[engine][n]}
                assert not differ, (micro, engine, differ)
