"""A DeepSpeed-Chat-style GRPO script, unchanged, under ``deepspeed --module ds_hilore.run``.

tests/workers/dschat_grpo_worker.py calls plain ``deepspeed.initialize`` for an actor (client
optimizer, ZeRO-2) and a reference model (no optimizer), and switches the actor's gradient
checkpointing off around generation and on for the update every iteration, as DeepSpeed-Chat's
step 3 does. It runs twice on 2 CPU ranks (3 iterations of 2 micro-steps each):

* ``deepspeed script.py``: transformers' gradient checkpointing, no ds_hilore;
* ``DS_HILORE_CONFIG='{"force_plan": "H"}' deepspeed --module ds_hilore.run script.py``.

The second keeps every activation, so every micro-step's loss, every reward and the final
parameters are bitwise those of the first. ~30-60 s per launch on 2 cores.
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

from tests.launch import _BIN, REPO_ROOT, _all_output, _environment, free_port
from tests.workers import dschat_grpo_worker as worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, UNITS = 3, 4  # iterations; 2 layers x (attn, mlp)


def launch(*, under_run: bool, env: dict[str, str], nprocs: int = 2, timeout: float = 300) -> list[dict]:
    """``deepspeed [--module ds_hilore.run] WORKER`` on ``nprocs`` CPU ranks; each rank's report."""
    work = Path(tempfile.mkdtemp(prefix="hilore_dschat_"))
    result_dir, log_dir = work / "results", work / "logs"
    result_dir.mkdir()
    log_dir.mkdir()
    target = ["--module", "ds_hilore.run", worker.__file__] if under_run else [worker.__file__]
    cmd = [str(_BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(free_port()),
           f"--enable_each_rank_log={log_dir}", *target, "--steps", str(STEPS), "--result_dir", str(result_dir)]
    environ = {k: v for k, v in _environment().items() if k not in ("DS_HILORE", "DS_HILORE_CONFIG")}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout:.0f} s\n{_all_output(output, log_dir)}")
    try:
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}\n{_all_output(output, log_dir)}")
        return [json.loads((result_dir / f"rank{rank}.json").read_text()) for rank in range(nprocs)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def runs():
    gc = launch(under_run=False, env={})
    hilore = launch(under_run=True, env={"DS_HILORE_CONFIG": '{"force_plan": "H"}'})
    return gc, hilore


def test_plain_launch_is_untouched(runs):
    for rank in runs[0]:
        assert rank["actor_class"] == "DeepSpeedEngine" and not rank["initialize_replaced"]
        assert not rank["ds_hilore_imported"] and rank["hilore_stats"] is None
        assert rank["toggles"] == [True] * STEPS


def test_under_ds_hilore_run_the_trajectory_is_bitwise_gc(runs):
    for gc, hilore in zip(*runs, strict=True):
        assert hilore["actor_class"] == "HiLoReDeepSpeedEngine" and hilore["initialize_replaced"]
        assert hilore["reference_class"] == "DeepSpeedEngine" and not hilore["reference_hilore"]
        assert hilore["toggles"] == [True] * STEPS  # re-enabled every iteration, HiLoRe still on
        assert hilore["losses"] == gc["losses"] and len(gc["losses"]) == STEPS * worker.GAS
        assert hilore["rewards"] == gc["rewards"]  # generation with checkpointing off: same samples
        assert hilore["param_sha"] == gc["param_sha"]
        stats = hilore["hilore_stats"]  # the last step: every unit H in both micro-steps
        assert stats["actions"]["H"] == worker.GAS * UNITS and stats["recomputed_units"] == 0
        assert stats["exposure_sources"] == ["hidden_grad"]  # the script's own loss
    assert runs[1][0]["param_sha"] == runs[1][1]["param_sha"]
