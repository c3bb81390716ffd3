"""ds_hilore.initialize on a 1-rank DeepSpeed engine in this process (DS_ACCELERATOR=cpu).

Errors and warnings of initialize, "enabled: false" = plain DeepSpeed, the step hook, the
checkpoint keying of HiLoRe's learned state, ZeRO stages 0/1 with bf16/fp16, and the
collective on one rank. The 2-rank runs are in test_engine_distributed.py.

Equality here is bitwise: the HiLoRe and GC runs use the same ds_config apart from the
"hilore" block, so DeepSpeed reduces in the same order; H stores what the forward saved and
R recomputes it with the forward's RNG state, so every saved tensor is bitwise the same.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

import ds_hilore.integrations.engine as engine_mod  # noqa: E402
from ds_hilore import HiLoReConfigError, HiLoReError  # noqa: E402
from tests.launch import free_port  # noqa: E402
from tests.workers import ds_engine_worker as worker  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """torch.distributed as a 1-rank gloo group (DeepSpeed initialises it on first use).

    The env vars are restored afterwards (NOTE [ Clean rank environment ] in tests/launch.py);
    the process group stays, as DeepSpeed cannot be re-initialised in one process.
    """
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def ds_config(name: str = "zero2_hilore", **hilore) -> dict:
    """A ds_config of ds_configs/ with ``hilore`` merged into its "hilore" block."""
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    if "memory_budget_bytes" in hilore:  # the two budgets exclude each other
        config["hilore"].pop("memory_budget")
    config.setdefault("hilore", {}).update(hilore)
    return config


def make(config: dict, model: str = "full", gc: bool = False, init=engine_mod.initialize):
    lm = worker.build_model(model, gc=gc)
    engine, *_ = init(model=lm, model_parameters=[p for p in lm.parameters() if p.requires_grad],
                      config=config)
    return engine


def run(engine, steps: int = 2, first: int = 1) -> tuple[list[str], dict[str, str]]:
    """Losses (float.hex) of every micro-step and the digest of every final parameter."""
    record = {"losses": [], "steps": []}
    worker.train(engine, "lm", first, first + steps - 1, 0, record)
    return record["losses"], {n: worker.digest(t) for n, t in worker.full_parameters(engine).items()}


@pytest.fixture(scope="module")
def gc_reference():
    """The HF gradient-checkpointing run (2 steps, ZeRO-2) every HiLoRe run must match."""
    config = ds_config()
    del config["hilore"]
    return run(make(config, gc=True))


# ---- the call itself ---------------------------------------------------------------------
def test_signature_is_deepspeeds():
    ours = inspect.signature(engine_mod.initialize).parameters
    theirs = inspect.signature(deepspeed.initialize).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()]


def test_configs_gc_baseline_is_hilore_config_without_its_block():
    hilore = json.loads((CONFIGS / "zero2_hilore.json").read_text())
    baseline = json.loads((CONFIGS / "zero2_gc_baseline.json").read_text())
    assert hilore.pop("hilore")["enabled"] is True
    assert hilore == baseline
    for name in ("zero3_hilore", "zero3_lora_hilore"):
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        assert config["zero_optimization"]["stage"] == 3 and config["hilore"]["enabled"] is True


@pytest.mark.parametrize("block", [None, {"enabled": False}], ids=["no_block", "enabled_false"])
def test_disabled_is_plain_deepspeed(block, gc_reference):
    config = ds_config()
    del config["hilore"]
    if block is not None:
        config["hilore"] = block
    engine = make(config, gc=True)
    assert type(engine) is deepspeed.DeepSpeedEngine and engine.hilore is None
    from ds_hilore.runtime import find_runtime
    assert find_runtime(engine.module) is None
    assert run(engine) == gc_reference  # bitwise: losses and every parameter


def test_config_from_args_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(force_plan="R")))
    lm = worker.build_model("full", gc=False)
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, *_ = engine_mod.initialize(args=args, model=lm, model_parameters=lm.parameters())
    assert engine.hilore is not None and engine.hilore.config.force_plan == "R"


# ---- errors and warnings -----------------------------------------------------------------
def test_memory_budget_below_one_is_rejected():
    with pytest.raises(HiLoReConfigError, match=r"memory_budget = 0\.5 .*>= 1\.0.*Fix"):
        make(ds_config(memory_budget=0.5))


def test_pipeline_module_is_unsupported():
    from deepspeed.pipe import PipelineModule

    pipe = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1)
    with pytest.raises(HiLoReError, match=r"does not support DeepSpeed pipeline parallelism.*Fix"):
        engine_mod.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_config())


def test_pipeline_block_is_unsupported():
    config = {**ds_config(), "pipeline": {"stages": 2}}
    with pytest.raises(HiLoReError, match=r'"pipeline" block.*"enabled": false'):
        make(config)


def test_activation_checkpointing_block_warns_and_hilore_wins(gc_reference):
    config = {**ds_config(force_plan="R"), "activation_checkpointing": {"partition_activations": False}}
    with pytest.warns(UserWarning, match="HiLoRe wins"):
        engine = make(config)
    assert run(engine) == gc_reference
    assert engine.hilore.stats["recomputed_units"] == 2 * len(engine.hilore.units)  # GAS 2


@pytest.fixture
def plan_H_before_the_budget_check(monkeypatch):
    """A fresh runtime is all R until the allocator decides: store everything first, so that
    only the fallback itself can make the plan all R."""
    check = engine_mod._check_budget

    def stored_then_checked(runtime, hilore_config):
        runtime.set_plan("H")
        check(runtime, hilore_config)

    monkeypatch.setattr(engine_mod, "_check_budget", stored_then_checked)


def test_budget_below_gc_falls_back_to_gc(gc_reference, plan_H_before_the_budget_check):
    with pytest.warns(UserWarning, match="falls back to gradient checkpointing"):
        engine = make(ds_config(memory_budget_bytes=1))
    units = len(engine.hilore.units)
    assert engine.hilore.plan_actions() == ["R"] * units
    assert run(engine) == gc_reference
    assert engine.hilore.stats["actions"] == {"H": 0, "L": 0, "R": 2 * units, "E": 0}  # GAS 2


def test_budget_above_in_use_keeps_the_plan(plan_H_before_the_budget_check):
    engine = make(ds_config(memory_budget_bytes=2**50))  # the fallback's control: no warning
    assert engine.hilore.plan_actions() == ["H"] * len(engine.hilore.units)


def test_budget_below_gc_keeps_force_plan():
    with pytest.warns(UserWarning, match="force_plan is set and overrides the budget"):
        engine = make(ds_config(memory_budget_bytes=1, force_plan="H"))
    assert engine.hilore.plan_actions() == ["H"] * len(engine.hilore.units)


# ---- the step hook -----------------------------------------------------------------------
def test_end_step_once_per_optimizer_step(gc_reference):
    engine = make(ds_config(force_plan="H"))
    calls = []
    original = engine.hilore.end_step
    engine.hilore.end_step = lambda **kw: (calls.append(engine.global_steps), original(**kw))[1]
    assert run(engine) == gc_reference  # 2 steps x GAS 2 micro-steps
    assert calls == [1, 2]
    stats = engine.hilore.stats  # the step it describes: DeepSpeed's, each micro-step's place
    assert stats["step"] == engine.global_steps == 2
    assert [m["position"] for m in stats["microbatches"]] == [0, 1]
    assert engine.hilore.stats["actions"] == {"H": 8, "L": 0, "R": 0, "E": 0}  # last step: 2 x 4 units
    assert engine.hilore.stats["recomputed_units"] == 0


def _said(capfd) -> list[str]:
    """ds_hilore's lines on DeepSpeed's logger (or printed by it, at its default level)."""
    return [line for line in capfd.readouterr().out.splitlines() if "ds_hilore" in line]


def test_start_line_and_step_lines_are_said_on_rank_0(capfd):
    engine = make(ds_config(log_interval=1))
    start = [line for line in _said(capfd) if "HiLoRe engine" in line]
    assert len(start) == 1 and "[Rank 0]" in start[0]
    assert "Qwen2ForCausalLM: 4 units in 2 decoder layers " \
        "(model.layers.0.attn .. model.layers.1.mlp)" in start[0]
    assert "budget hilore.memory_budget = 1.1" in start[0] and "; on;" in start[0]
    assert start[0].endswith('settings: the ds_config\'s "hilore" block')
    run(engine)
    steps = [line for line in _said(capfd) if "ds_hilore step" in line]
    assert [line.split("ds_hilore step ")[1].split(" ")[0] for line in steps] == ["1", "2"]
    for line in steps:  # the step's mix (2 micro-steps x 4 units), peak vs budget, error
        mix = re.search(r": actions H (\d+) L (\d+) R (\d+) E (\d+) \(units x microbatches\)", line)
        assert mix and sum(map(int, mix.groups())) == 8, line
        assert re.search(r"; peak [\d.]+ MiB (of budget [\d.]+ MiB|\(budget: once the shape is "
                         r"profiled\)); est\. error ", line), line


def test_step_lines_follow_log_interval(capfd):
    engine = make(ds_config(force_plan="H", log_interval=2))
    run(engine)
    assert [line.split("ds_hilore step ")[1].split(" ")[0] for line in _said(capfd)
            if "ds_hilore step" in line] == ["2"]


def test_deepspeeds_info_level_logs_the_lines(capfd):
    """With "log_level": "info" DeepSpeed's logger lets INFO through: the lines are logged
    there (and not printed as well)."""
    from deepspeed.utils import logger as ds_logger

    records: list[logging.LogRecord] = []
    recorder = logging.Handler(logging.INFO)
    recorder.emit = records.append
    level = ds_logger.level
    ds_logger.addHandler(recorder)
    try:
        ds_logger.setLevel(logging.INFO)
        make(ds_config(force_plan="H"))
    finally:
        ds_logger.setLevel(level)
        ds_logger.removeHandler(recorder)
    start = [r for r in records if "HiLoRe engine" in r.getMessage()]
    assert len(start) == 1 and start[0].levelno == logging.INFO and "force_plan H" in start[0].getMessage()
    assert not [line for line in _said(capfd) if "HiLoRe engine" in line and "[INFO]" not in line]


def _precision_param(stage: int, precision: str):
    """(stage, precision), skipped where DeepSpeed's accelerator lacks the type.

    DeepSpeed refuses such a config itself ("Type fp16 is not supported on your device"); its
    CPU accelerator asks oneDNN (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16
    or AMX-FP16), so e.g. an AMD EPYC or an Intel CPU without those runs no fp16.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = getattr(accelerator, f"is_{precision}_supported")()
    reason = (f"DeepSpeed's {accelerator.device_name()} accelerator reports no {precision} support "
              f"on this machine (is_{precision}_supported() is {supported!r})")
    return pytest.param(stage, precision, id=f"{stage}-{precision}",
                        marks=pytest.mark.skipif(not supported, reason=reason))


@pytest.mark.parametrize("stage,precision", [_precision_param(0, "bf16"), _precision_param(1, "fp16")])
def test_zero_stage_and_precision_match_gc(stage, precision):
    def config(**hilore):
        c = ds_config(**hilore)
        c["zero_optimization"] = {"stage": stage}
        c[precision] = {"enabled": True}
        return c

    baseline = config()
    del baseline["hilore"]
    reference = run(make(baseline, gc=True))
    for plan in ("H", "R"):
        assert run(make(config(force_plan=plan))) == reference, plan


# ---- checkpoints -------------------------------------------------------------------------
def _marked_state(engine) -> dict:
    """A learned state that differs from a fresh runtime's, to see whether it was restored:
    a plan and a calibration sample of the allocator."""
    engine.hilore.apply_plan({"model.layers.0.*": "H"})
    engine.hilore.policy.risk.add("attn:low", 0.004, 0.01)
    return engine.hilore.state_dict()


def test_checkpoint_restores_state_on_same_setup(tmp_path, caplog):
    saver = make(ds_config())
    run(saver, steps=1)
    saved = _marked_state(saver)
    saver.save_checkpoint(str(tmp_path), tag="t", client_state={"user": 7})
    loader = make(ds_config())
    assert loader.hilore.state_dict() != saved
    with caplog.at_level(logging.INFO, logger="ds_hilore.integrations.engine"):
        path, client_state = loader.load_checkpoint(str(tmp_path), tag="t")
    assert path is not None and client_state["user"] == 7
    assert engine_mod.CHECKPOINT_KEY not in client_state  # HiLoRe's entry is taken out
    assert loader.hilore.state_dict() == saved
    assert "no recalibration" in caplog.text


def test_checkpoint_drops_state_on_other_setup(tmp_path, caplog, monkeypatch):
    saver = make(ds_config())
    run(saver, steps=1)
    saved = _marked_state(saver)
    saver.save_checkpoint(str(tmp_path), tag="t")
    loader = make(ds_config())
    fresh = loader.hilore.state_dict()
    other = {**engine_mod.setup_key(), "torch_version": "0.0.0"}
    monkeypatch.setattr(engine_mod, "setup_key", lambda: other)
    with caplog.at_level(logging.INFO, logger="ds_hilore.integrations.engine"):
        path, client_state = loader.load_checkpoint(str(tmp_path), tag="t")
    assert path is not None and engine_mod.CHECKPOINT_KEY not in client_state
    assert loader.hilore.state_dict() == fresh != saved
    assert "dropped; HiLoRe profiles and calibrates again" in caplog.text
    assert "'torch_version': '0.0.0'" in caplog.text


def test_checkpoint_of_plain_deepspeed_loads(tmp_path, caplog):
    config = ds_config()
    del config["hilore"]
    make(config).save_checkpoint(str(tmp_path), tag="t")
    loader = make(ds_config())
    fresh = loader.hilore.state_dict()
    with caplog.at_level(logging.INFO, logger="ds_hilore.integrations.engine"):
        path, _ = loader.load_checkpoint(str(tmp_path), tag="t")
    assert path is not None and loader.hilore.state_dict() == fresh
    assert "has no HiLoRe state" in caplog.text


def test_checkpoint_keeps_a_plan_chosen_by_hand(tmp_path):
    """A plan the script chose (set_plan: the allocator stopped deciding) is not replaced by
    the saver's plan."""
    saver = make(ds_config())
    run(saver, steps=1)
    _marked_state(saver)  # the saver's plan keeps layer 0 whole
    saver.save_checkpoint(str(tmp_path), tag="t")
    loader = make(ds_config())
    loader.hilore.set_plan("R")
    loader.load_checkpoint(str(tmp_path), tag="t")
    assert set(loader.hilore.plan_actions()) == {"R"}


def test_checkpoint_of_other_recovery_units_is_dropped(tmp_path, caplog):
    saver = make(ds_config())
    run(saver, steps=1)
    saved = _marked_state(saver)
    saver.save_checkpoint(str(tmp_path), tag="t")
    loader = make(ds_config(layer_pattern="model.layers.0"))
    fresh = loader.hilore.state_dict()
    with caplog.at_level(logging.WARNING, logger="ds_hilore.integrations.engine"):
        loader.load_checkpoint(str(tmp_path), tag="t")
    assert loader.hilore.state_dict() == fresh != saved
    assert "was learned for 4 recovery units" in caplog.text and "this run has 2" in caplog.text


def test_one_runtime_per_model_and_a_destroyed_engine_lets_another_attach():
    from ds_hilore import attach, find_runtime

    lm = worker.build_model("full", gc=False)
    params = [p for p in lm.parameters() if p.requires_grad]
    engine, *_ = engine_mod.initialize(model=lm, model_parameters=params, config=ds_config())
    with pytest.raises(HiLoReError, match="already attached to this model.*engine.destroy"):
        engine_mod.initialize(model=lm, model_parameters=params, config=ds_config())
    with pytest.raises(HiLoReError, match="already attached"):
        attach(lm)
    assert find_runtime(lm) is engine.hilore
    engine.destroy()
    assert find_runtime(lm) is None
    again, *_ = engine_mod.initialize(model=lm, model_parameters=params, config=ds_config())
    assert find_runtime(lm) is again.hilore
    again.destroy()


def test_a_failed_initialize_leaves_the_model_as_it_was():
    from ds_hilore import find_runtime
    from ds_hilore._errors import HiLoReNameError

    lm = worker.build_model("full", gc=False)
    before = {name: dict(m.__dict__) for name, m in lm.named_modules()}
    with pytest.raises(HiLoReNameError, match="force_plan patterns"):
        engine_mod.initialize(model=lm, model_parameters=list(lm.parameters()),
                              config=ds_config(force_plan={"model.layers.9.*": "H"}))
    assert find_runtime(lm) is None
    for name, module in lm.named_modules():  # no wrapper, flag or hook left behind
        assert module.__dict__.keys() == before[name].keys(), name
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        assert not [h for h in hooks if getattr(h, "__module__", "").startswith("ds_hilore")], name


def test_coefficients_of_a_loss_given_the_engine_reach_its_runtime():
    from ds_hilore.grpo import policy_loss

    engine = make(ds_config(force_plan="H", elide_zero_rows=True))
    ids = torch.randint(3, worker.VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    logits = engine(input_ids=ids).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    policy_loss(logp, logp.detach(), torch.tensor([1.0, 0.0, -1.0, 0.5]),
                torch.ones_like(logp, dtype=torch.bool), model=engine)
    assert engine.hilore._mb.zero_rows == [1]
    engine.destroy()


def test_deepspeeds_default_pipeline_block_is_accepted():
    engine = make({**ds_config(), "pipeline": {"stages": "auto", "partition": "best"}})
    assert engine.hilore.attached
    engine.destroy()


def test_checkpoint_key_collision_is_an_error(tmp_path):
    engine = make(ds_config())
    with pytest.raises(HiLoReError, match="rename your key"):
        engine.save_checkpoint(str(tmp_path), client_state={engine_mod.CHECKPOINT_KEY: 1})


class _Block(torch.nn.Module):
    """A decoder-layer-like block of no transformers class: its units are found at the first
    training forward (``layer_pattern``)."""

    def __init__(self):
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def _blocks_engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block()).train()
    config = ds_config(layer_pattern="[0-9]", low_precision="none", profile_microbatches=1,
                       plan_validation_microbatches=0)
    engine, *_ = engine_mod.initialize(model=model, model_parameters=model.parameters(),
                                       config=config)
    return engine


def _blocks_step(engine, seed: int) -> None:
    for micro in range(2):  # gradient_accumulation_steps
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(10 * seed + micro))
        engine.backward(engine(x).square().sum())
        engine.step()


def test_checkpoint_restores_state_where_units_are_found_at_the_first_forward(tmp_path, caplog):
    """Units found at the first training forward (no probe): the loaded state is compared with
    them once they are known, and restored -- no "dropped", no profiling again; a save before
    then writes the loaded state."""
    saver = _blocks_engine()
    for seed in range(3):
        _blocks_step(saver, seed)
    saved = saver.hilore.state_dict()
    assert len(saved["plan"]) == 4 and len(saved["policy"]["profiles"]) == 1
    saver.save_checkpoint(str(tmp_path), tag="t")
    loader = _blocks_engine()
    assert loader.hilore.units == ()
    with caplog.at_level(logging.INFO, logger="ds_hilore.integrations.engine"):
        loader.load_checkpoint(str(tmp_path), tag="t")
        loader.save_checkpoint(str(tmp_path), tag="again")  # before the units are found
        loader.load_checkpoint(str(tmp_path), tag="again")
        _blocks_step(loader, 7)  # finds the units; the restore comes at the next forward
        assert "dropped" not in caplog.text and "restored once the recovery units" in caplog.text
    bucket, = saved["policy"]["profiles"]
    restored = loader.hilore.policy.buckets[tuple(bucket["key"])]
    assert restored.profile.to_dict() == bucket and restored.plan is not None
    assert "no recalibration" in caplog.text
    assert loader.hilore.state_dict()["policy"]["profiles"] == [bucket]  # profiled nothing again


def test_setup_key_names_device_world_and_torch():
    key = engine_mod.setup_key()
    assert key == {"device_type": "cpu", "device_name": "cpu", "world_size": 1,
                   "torch_version": torch.__version__}


# ---- the collective ----------------------------------------------------------------------
def test_collective_agrees_host_values_over_a_gloo_group_where_the_backend_is_not_a_cpu_one(
        monkeypatch):
    """NOTE [ One decision for every rank ]: under NCCL the collective makes one gloo group
    when it is made (at attach) and reduces host values over it, never over NCCL."""
    import torch.distributed as dist

    from ds_hilore.runtime import collective as collective_mod

    make(ds_config(enabled=False))  # makes sure the process group exists
    made, reduced = [], []
    new_group, all_reduce, all_gather = dist.new_group, dist.all_reduce, dist.all_gather
    monkeypatch.setattr(collective_mod.dist, "new_group", lambda ranks=None, backend=None: (
        made.append(backend), new_group(backend="gloo"))[1])
    monkeypatch.setattr(collective_mod.dist, "all_reduce", lambda tensor, op=None, group=None: (
        reduced.append((tensor.device.type, group)), all_reduce(tensor, op=op, group=group))[1])
    monkeypatch.setattr(collective_mod.dist, "all_gather", lambda parts, tensor, group=None: (
        reduced.append((tensor.device.type, group)), all_gather(parts, tensor, group=group))[1])
    with monkeypatch.context() as nccl:
        nccl.setattr(collective_mod.dist, "get_backend", lambda group=None: "nccl")
        collective = collective_mod.TorchDistCollective()
    assert made == ["gloo"] and collective.host_group is not None and collective.device == "cpu"
    assert collective.all_reduce_max([3, 2**40]) == [3, 2**40]
    grad = torch.ones(3)
    collective.all_reduce_sum_tensor(grad)  # a host tensor: the host group too
    assert reduced == [("cpu", collective.host_group)] * 2 and made == ["gloo"]


def test_host_sums_are_added_rank_by_rank(monkeypatch):
    """NOTE [ Host values gathered ]: a gathered sum adds the ranks' values in rank order, one
    addition at a time, whatever the reduction kernels would do with the (world, n) table:
    (1e16 + 1) + 1 is 1e16 in float64, 1e16 + (1 + 1) is not (torch's sum over the rows of
    a table of five or more gives the latter). Six ranks' values, as the all-gather fills the
    table on every rank."""
    import torch.distributed as dist

    from ds_hilore.runtime import collective as collective_mod

    make(ds_config(enabled=False))  # makes sure the process group exists
    collective = collective_mod.TorchDistCollective()
    table = [[1e16, 0.1, -2.0], [1.0, 0.2, 3.0], [1.0, 0.3, -1.0], [1.0, 0.7, 0.25],
             [1.0, 0.9, 1.5], [-1e16, 0.4, 0.5]]
    monkeypatch.setattr(collective, "world_size", len(table))
    monkeypatch.setattr(collective_mod.dist, "all_gather", lambda parts, tensor, group=None: [
        part.copy_(torch.tensor(row, dtype=part.dtype)) for part, row in zip(parts, table)])
    expected = [0.0] * 3
    for row in table:
        expected = [a + b for a, b in zip(expected, row)]
    assert expected[0] == 0.0  # the four ones were lost, in rank order
    assert collective.all_reduce_sum([0.0] * 3) == expected
    assert collective.all_reduce_max_float([0.0] * 3) == [1e16, 0.9, 3.0]
    assert dist.get_world_size() == 1  # nothing left the process


def test_collective_on_one_rank():
    make(ds_config(enabled=False))  # makes sure the process group exists
    collective = engine_mod.TorchDistCollective()
    assert (collective.rank, collective.world_size, collective.device) == (0, 1, "cpu")
    assert collective.broadcast_actions(["H", "R"]) == ["H", "R"]
    assert collective.all_reduce_max([3, 2**40]) == [3, 2**40]
    assert collective.all_reduce_sum([0.25]) == [0.25]
