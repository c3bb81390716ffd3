"""TRL's GRPOTrainer gets HiLoRe from the environment or the ds_config, its script unchanged.

The distributed tests launch tests/workers/trl_grpo_worker.py (TRL's real GRPOTrainer, a tiny
Qwen2 and tokenizer built here, ZeRO-2, beta > 0 so a reference model exists, gradient
checkpointing on, 3 GRPO steps of 2 micro-steps) on 2 CPU ranks (``env_H`` through the deepspeed
runner, the others started directly), in these launches:

* ``gc``: no variable -- TRL with transformers' gradient checkpointing, ds_hilore not imported;
* ``env_H``: ``DS_HILORE_CONFIG='{"force_plan": "H"}'`` and a ds_config without a block;
* ``block``: the same variable, but the ds_config has ``"hilore": {"enabled": true}``, which
  wins: the allocator's defaults;

and three times more with ``beta = 0`` (``gc_beta0``, ``env_H_beta0``, and ``block_beta0``, the
allocator profiling one microbatch per shape): with no KL term every loss term is a multiple
of the advantage, so TRL's ``_compute_loss`` hands the exposure to HiLoRe before the forward
(ds_hilore/integrations/trl_exposure.py), which the stats count per step.

``env_H`` keeps every activation, so TRL's logged loss and grad norm, every micro-step's loss
and the final parameters are bitwise those of ``gc``. Each launch takes ~40-80 s on 2 cores
(most of it importing trl); the three with beta > 0 together stay under 4 minutes, the three
with beta = 0 (no reference model) under 3.

The fast tests check what TRL does to checkpointing: it switches it off around generation
and back on with its own ``gradient_checkpointing_kwargs`` (``use_reentrant=True`` under
PEFT + ZeRO-3); HiLoRe must stay the model's checkpointing through that.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from models import batch, loss_and_grads, tiny_model, with_lora

import ds_hilore
from tests.launch import run_distributed
from tests.workers import trl_grpo_worker as worker

STEPS, GAS, UNITS = 3, 2, 4  # optimizer steps, micro-steps per step, 2 layers x (attn, mlp)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
    "steps_per_print": 1_000_000,
}
LAUNCHES = {  # name -> (environment, "hilore" block of the ds_config or None)
    "gc": ({}, None),
    "env_H": ({"DS_HILORE_CONFIG": '{"force_plan": "H"}'}, None),
    "block": ({"DS_HILORE_CONFIG": '{"force_plan": "H"}'}, {"enabled": True}),
    # beta = 0: no KL term and no reference model, so the advantages predict the exposure
    "gc_beta0": ({}, None),
    "env_H_beta0": ({"DS_HILORE_CONFIG": '{"force_plan": "H"}'}, None),
    "block_beta0": ({"DS_HILORE": "1"}, {"enabled": True, "profile_microbatches": 1}),
}
WORKER_ARGS = {name: ["--beta", "0"] for name in ("gc_beta0", "env_H_beta0", "block_beta0")}
# through DeepSpeed's runner, as users launch: the variable reaches the ranks through it; the
# others start their ranks directly (NOTE [ Three ways to start ranks ] in tests/launch.py)
RUNNER_LAUNCHED = {"env_H"}


# ---- re-enabling checkpointing with new kwargs -----------------------------------------
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reenabling_checkpointing_with_new_kwargs_keeps_hilore_on(lora, use_reentrant):
    model = tiny_model("qwen2", dropout=False)
    model = with_lora(model) if lora else model
    inputs = batch()
    ref_loss, ref = loss_and_grads(model, inputs)  # no checkpointing at all
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    # TRL around generation (trl.models.utils.disable_gradient_checkpointing), then with the
    # kwargs it forces (use_reentrant=True under PEFT + ZeRO-3)
    model.gradient_checkpointing_disable()
    assert not runtime.enabled
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert runtime.enabled
    loss, grads = loss_and_grads(model, inputs)
    runtime.end_step()
    stats = runtime.stats
    assert stats["actions"]["H"] == UNITS and stats["recomputed_units"] == 0  # HiLoRe ran, not HF's
    assert torch.equal(loss, ref_loss)
    assert [n for n in ref if not torch.equal(ref[n], grads[n])] == []
    runtime.detach()


# ---- TRL's GRPOTrainer on 2 ranks --------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl_model")
    worker.build_model_dir(path)
    return path


_launched: dict[str, list[dict] | str] = {}


@pytest.fixture
def trl_run(model_dir, tmp_path_factory, monkeypatch):
    """``trl_run(name)``: the ranks' reports of launch ``name`` (each launch runs once)."""
    pytest.importorskip("trl", reason="trl is a test dependency: pip install -e '.[test]'")

    def get(name: str) -> list[dict]:
        if name not in _launched:
            env, block = LAUNCHES[name]
            config = dict(DS_CONFIG, **({} if block is None else {"hilore": block}))
            path = tmp_path_factory.mktemp(f"trl_{name}") / "ds_config.json"
            path.write_text(json.dumps(config))
            with monkeypatch.context() as m:  # the launch inherits this process's environment
                for key in ("DS_HILORE", "DS_HILORE_CONFIG"):
                    m.delenv(key, raising=False)
                for key, value in env.items():
                    m.setenv(key, value)
                try:
                    _launched[name] = run_distributed(
                        worker.__file__, ["--model_dir", str(model_dir), "--deepspeed", str(path),
                                          "--steps", str(STEPS), *WORKER_ARGS.get(name, [])],
                        nprocs=2, launcher="deepspeed" if name in RUNNER_LAUNCHED else "direct",
                        timeout=300)
                except pytest.fail.Exception as failure:
                    _launched[name] = str(failure)
        if isinstance(_launched[name], str):
            pytest.fail(_launched[name], pytrace=False)
        return _launched[name]

    return get


def _logged(rank: dict, key: str) -> list[float]:
    return [entry[key] for entry in rank["log_history"] if key in entry and "train_runtime" not in entry]


@pytest.mark.distributed
@pytest.mark.slow
def test_without_the_variable_trl_runs_untouched(trl_run):
    for rank in trl_run("gc"):
        assert rank["world_size"] == 2
        assert rank["engine_class"] == "DeepSpeedEngine" and rank["ref_engine_class"] == "DeepSpeedEngine"
        assert not rank["initialize_replaced"] and not rank["ds_hilore_imported"]
        assert len(_logged(rank, "loss")) == STEPS and len(rank["micro_losses"]) == STEPS * GAS
        assert all(math.isfinite(x) for x in _logged(rank, "grad_norm"))
        assert any(x != 0 for x in _logged(rank, "kl"))  # the reference model is in the loss


@pytest.mark.distributed
@pytest.mark.slow
def test_variable_with_force_plan_H_is_bitwise_gc(trl_run):
    for gc, env_h in zip(trl_run("gc"), trl_run("env_H"), strict=True):
        assert env_h["engine_class"] == "HiLoReDeepSpeedEngine" and env_h["initialize_replaced"]
        assert env_h["hilore_force_plan"] == "H"
        assert env_h["ref_engine_class"] == "DeepSpeedEngine" and env_h["ref_hilore"] is False
        for key in ("loss", "grad_norm", "reward", "kl"):
            assert _logged(env_h, key) == _logged(gc, key), key  # floats compared exactly
        assert env_h["micro_losses"] == gc["micro_losses"]  # float.hex of every micro-step
        assert env_h["param_sha"] == gc["param_sha"]
        stats = env_h["hilore_stats"]  # the last optimizer step
        assert stats["actions"]["H"] == GAS * UNITS and stats["recomputed_units"] == 0
        # TRL's dapo loss is not ds_hilore's: exposure comes from the last hidden state's gradient
        assert {mb["exposure_source"] for mb in stats["microbatches"]} == {"hidden_grad"}


@pytest.mark.distributed
@pytest.mark.slow
def test_block_in_ds_config_wins_and_defaults_train(trl_run):
    ranks = trl_run("block")
    for rank in ranks:
        assert rank["engine_class"] == "HiLoReDeepSpeedEngine"
        assert rank["hilore_force_plan"] is None  # the ds_config's block, not the variable's
        assert rank["ref_engine_class"] == "DeepSpeedEngine" and rank["ref_hilore"] is False
        stats = rank["hilore_stats"]
        assert sum(stats["actions"].values()) == GAS * UNITS and len(stats["microbatches"]) == GAS
        assert len(_logged(rank, "loss")) == STEPS
        assert all(math.isfinite(x) for x in _logged(rank, "loss") + _logged(rank, "grad_norm"))
    assert ranks[0]["param_sha"] == ranks[1]["param_sha"]  # data parallel: one model


@pytest.mark.distributed
@pytest.mark.slow
def test_beta0_prediction_reaches_hilore_before_the_forward(trl_run):
    """TRL's ``_compute_loss`` hands sum_t |A_i| m_{i,t} to HiLoRe before the model forward
    (NOTE [ TRL exposure ]): the microbatches planned after profiling are planned from it."""
    for rank in trl_run("block_beta0"):
        assert rank["engine_class"] == "HiLoReDeepSpeedEngine" and rank["ref_engine_class"] is None
        assert rank["loss_step_wrapped"] and len(rank["predicted_per_step"]) == STEPS
        assert sum(rank["predicted_per_step"]) >= 1, rank["predicted_per_step"]
        assert all(math.isfinite(x) for x in _logged(rank, "loss") + _logged(rank, "grad_norm"))
    for rank in trl_run("block"):  # beta > 0: a zero advantage is no zero coefficient, nothing predicted
        assert rank["predicted_per_step"] == [0] * STEPS


@pytest.mark.distributed
@pytest.mark.slow
def test_beta0_force_plan_H_with_the_loss_step_wrapped_is_bitwise_gc(trl_run):
    for gc, env_h in zip(trl_run("gc_beta0"), trl_run("env_H_beta0"), strict=True):
        assert env_h["engine_class"] == "HiLoReDeepSpeedEngine" and env_h["hilore_force_plan"] == "H"
        assert env_h["loss_step_wrapped"] and not gc["loss_step_wrapped"]
        assert gc["ref_engine_class"] is None and env_h["ref_engine_class"] is None  # beta = 0
        for key in ("loss", "grad_norm", "reward"):
            assert _logged(env_h, key) == _logged(gc, key), key  # floats compared exactly
        assert env_h["micro_losses"] == gc["micro_losses"]
        assert env_h["param_sha"] == gc["param_sha"]
        stats = env_h["hilore_stats"]
        assert stats["actions"]["H"] == GAS * UNITS and stats["recomputed_units"] == 0
