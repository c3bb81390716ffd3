"""HiLoRe in the engines real stacks build: forwards that bypass the model's ``__call__``, the
script's own checkpointing choice, per-engine settings, and what is logged.

DeepSpeed-Chat trains its critic through ``forward_value`` (the backbone is called, the top
module never is); TRL's fused-loss paths call ``model.model(...)``. Every such forward must be
planned as a full-model forward of the same shape is.
"""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import ds_hilore  # noqa: E402
from tests.models import VOCAB, equal_utilities, tiny_model  # noqa: E402

# Plans from H and R only (no codec), measured but never timed into L: every choice is exact.
PLANNING = {"low_precision": "none", "profile_microbatches": 2, "calibration_microbatches": 0,
            "plan_validation_microbatches": 0, "memory_budget": 1.6}


def _ids(step: int, batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(step))


def _backbone_step(model, runtime, step: int, batch: int = 4, seq: int = 16) -> None:
    """One optimizer step whose loss comes from the backbone's hidden states (no LM head call)."""
    ids = _ids(step, batch, seq)
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, H)
    logits = hidden[:, :-1] @ model.lm_head.weight.t()  # (B, T-1, V): a fused head's stand-in
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    runtime.end_step()
    model.zero_grad(set_to_none=True)


# ---- forwards through the backbone -------------------------------------------------------
def test_a_forward_through_the_backbone_is_planned():
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, PLANNING)
    for step in range(4):
        _backbone_step(model, runtime, step)
    plans = runtime.stats["plans"]
    assert list(plans) == ["4x16"] and plans["4x16"] is not None  # profiled (2), then planned
    last = runtime.stats["microbatches"][-1]
    planned = plans["4x16"]["actions"]
    assert sum(last["actions"].values()) == len(runtime.units) == len(planned)
    assert last["actions"]["H"] == sum(1 for a in planned.values() if a in ("H", "S"))


def test_backbone_and_full_forwards_of_one_shape_share_the_bucket():
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, PLANNING)
    _backbone_step(model, runtime, 0)
    ids = _ids(1)
    logits = model(input_ids=ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    runtime.end_step()
    _backbone_step(model, runtime, 2)  # the two profiled microbatches made the plan
    assert list(runtime.stats["plans"]) == ["4x16"] and runtime.stats["plans"]["4x16"] is not None


def test_backbone_forward_gradients_match_no_checkpointing_under_the_plan():
    """The plan started at the first layer is exact (H and R only): gradients bitwise equal."""
    reference = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, PLANNING)
    for step in range(3):
        _backbone_step(model, runtime, step)
    for m in (reference, model):
        ids = _ids(7)
        hidden = m.model(input_ids=ids, use_cache=False).last_hidden_state
        logits = hidden[:, :-1] @ m.lm_head.weight.t()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert runtime.stats["plans"]["4x16"] is not None
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_never_planned_warns_once(caplog):
    """Every microbatch a new shape: no bucket is ever profiled to a plan; said once."""
    model = tiny_model("qwen2", layers=1, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {**PLANNING, "profile_microbatches": 1})
    with caplog.at_level(logging.WARNING, logger="ds_hilore"):
        for step in range(40):  # batch sizes 1..40: 40 buckets, each seen once
            _backbone_step(model, runtime, step, batch=step + 1, seq=4)
    lines = [r.getMessage() for r in caplog.records if "no shape has been planned" in r.getMessage()]
    assert len(lines) == 1 and "profile_microbatches" in lines[0]
    assert all(plan is None for plan in runtime.stats["plans"].values())


def test_planned_runs_do_not_warn(caplog):
    model = tiny_model("qwen2", layers=1, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, PLANNING)
    with caplog.at_level(logging.WARNING, logger="ds_hilore"):
        for step in range(40):
            _backbone_step(model, runtime, step, seq=4)
    assert not [r for r in caplog.records if "no shape has been planned" in r.getMessage()]


# ---- the script's checkpointing choice ------------------------------------------------------
def _full_step(model, step: int = 0) -> None:
    ids = _ids(step)
    logits = model(input_ids=ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()


def test_attach_turns_hilore_on_for_a_model_without_checkpointing():
    """The contract of ``attach``: attaching makes HiLoRe the checkpointing and turns it on."""
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {"force_plan": "R"})
    _full_step(model)
    assert runtime.enabled and runtime.stats["recomputed_units"] == len(runtime.units) == 4


def test_with_checkpointing_leaves_a_model_without_checkpointing_plain():
    reference = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {"force_plan": "R", "activate": "with_checkpointing"})
    for m in (reference, model):
        _full_step(m)
    assert not runtime.enabled and runtime.stats["recomputed_units"] == 0
    assert runtime.stats["microbatches"] == []
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    model.gradient_checkpointing_enable()  # the script turns checkpointing on later: HiLoRe's
    model.zero_grad(set_to_none=True)
    _full_step(model)
    assert runtime.enabled and runtime.stats["recomputed_units"] == 4


def test_with_checkpointing_replaces_the_scripts_checkpointing():
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    model.gradient_checkpointing_enable()
    runtime = ds_hilore.attach(model, {"force_plan": "R", "activate": "with_checkpointing"})
    _full_step(model)
    assert runtime.enabled and runtime.stats["recomputed_units"] == 4


# ---- what is said -----------------------------------------------------------------------------
def test_a_shapes_plan_is_said_once_at_info_and_replans_at_debug(caplog, monkeypatch):
    """Validation every step replans every step (OpenRLHF sets INFO: one line per step before).
    H pays for every unit whatever the load: the plan keeps something, so the bucket does not
    run as GC and validation runs."""
    equal_utilities(monkeypatch)
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {**PLANNING, "validation_interval": 1})
    with caplog.at_level(logging.DEBUG, logger="ds_hilore"):
        for step in range(6):
            _full_step(model, step)
            runtime.end_step()
            model.zero_grad(set_to_none=True)
    levels = [r.levelno for r in caplog.records if "plan for 4x16" in r.getMessage()]
    assert runtime.stats["grad_error_measured"] is not None  # validation ran, hence replans
    assert levels[0] == logging.INFO and levels[1:] and set(levels[1:]) == {logging.DEBUG}


class _NeedsMask(type(tiny_model("qwen2", layers=1))):
    """A model whose forward asserts on an argument the probe does not pass (OpenRLHF's critic
    asserts ``return_output`` when no ``action_mask`` is given)."""

    def forward(self, input_ids=None, action_mask=None, **kwargs):
        if action_mask is None:
            raise AssertionError()  # as a bare assert raises it outside pytest: no message
        return super().forward(input_ids=input_ids, **kwargs)


def test_a_failed_probe_says_what_failed_once(caplog):
    torch.manual_seed(0)
    model = _NeedsMask(tiny_model("qwen2", layers=2, hidden=32, dropout=False).config)
    model.config._attn_implementation = "eager"
    model.train()
    with caplog.at_level(logging.DEBUG, logger="ds_hilore"):
        runtime = ds_hilore.attach(model, {"force_plan": "R"})
        ids = _ids(0)
        model(input_ids=ids, action_mask=torch.ones_like(ids)).logits.sum().backward()
    lines = [r for r in caplog.records if "probe forward" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    message = lines[0].getMessage()
    assert "_NeedsMask" in message and "AssertionError" in message
    assert "raise AssertionError()" in message and "test_engines_logging.py" in message
    assert len(runtime.units) == 4  # found at the first training forward


# ---- a partial force_plan -----------------------------------------------------------------------
def test_units_a_force_plan_mapping_does_not_match_are_left_to_the_allocator(monkeypatch):
    equal_utilities(monkeypatch)  # H pays for every unit whatever the load: with room, H is kept
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {**PLANNING, "memory_budget": 4.0,
                                       "force_plan": {"model.layers.0.*": "R"}})
    assert runtime.policy is not None  # the allocator decides what the mapping leaves open
    for step in range(3):
        _full_step(model, step)
        runtime.end_step()
        model.zero_grad(set_to_none=True)
    planned = runtime.stats["plans"]["4x16"]["actions"]
    assert set(planned) == {u.name for u in runtime.units}
    ran = {u.name: u.action for u in runtime.units}
    assert ran["model.layers.0.attn"] == ran["model.layers.0.mlp"] == "R"  # pinned
    assert all(ran[n] == ("H" if planned[n] in ("H", "S") else planned[n])
               for n in ran if n.startswith("model.layers.1."))  # as the allocator planned
    assert "H" in {ran[n] for n in ran if n.startswith("model.layers.1.")}  # 4x GC's peak: room


def test_a_force_plan_string_still_fixes_every_unit():
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    assert ds_hilore.attach(model, {"force_plan": "H"}).policy is None


# ---- the GRPO example's loss types ------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo", "luspo"])
def test_every_loss_type_the_example_accepts_gets_what_it_needs(loss_type):
    """The example's gradient check forms each loss as its update does; a loss type that needs
    the step's token count (the loss table's ``needs``) gets it instead of failing mid-run."""
    from types import SimpleNamespace

    from examples.grpo.rollout import Rollout
    from examples.grpo.update import gradient_error

    model = tiny_model("qwen2", layers=1, hidden=32, dropout=False)
    ids = _ids(0, batch=4, seq=12)
    completion = torch.ones(4, 8, dtype=torch.bool)
    rollout = Rollout(ids, torch.ones_like(ids), 4, completion, torch.zeros(4),
                      torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.full((4, 8), -4.0), None)
    args = SimpleNamespace(loss_type=loss_type, drop_zero_rows=False, beta=0.0, epsilon=0.2,
                           epsilon_high=5.0 if loss_type == "cispo" else None,
                           max_answer_seq_len=8, per_device_training_batch_size=4)
    engine = SimpleNamespace(module=model, hilore=None)
    assert gradient_error(engine, rollout, args) == 0.0  # no HiLoRe: the same gradient twice


def test_cispo_without_its_cap_is_a_usage_error_at_start():
    from examples.grpo.arguments import UsageError, parse_args

    with pytest.raises(UsageError, match="--epsilon_high"):
        parse_args(["--loss_type", "cispo"])
    assert parse_args(["--loss_type", "cispo", "--epsilon_high", "5.0"]).epsilon_high == 5.0


# ---- the loss coefficients with actor and critic both attached -----------------------------
def test_coefficients_reach_the_runtime_their_log_probs_came_from():
    """DeepSpeed-Chat's actor and critic are both HiLoRe's: a GRPO loss given no ``model=``
    still hands ω to the actor's runtime (found from the log-probs' graph), not to none."""
    actor = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    critic = tiny_model("qwen2", layers=2, hidden=32, dropout=False, seed=1)
    actor_rt = ds_hilore.attach(actor, {"force_plan": "H"})
    critic_rt = ds_hilore.attach(critic, {"force_plan": "H"})
    ids = _ids(0)
    logits = actor(input_ids=ids, use_cache=False).logits  # (B, T, V)
    values = critic.model(input_ids=ids, use_cache=False).last_hidden_state.sum(-1)  # (B, T)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    mask = torch.ones_like(logp)
    loss = ds_hilore.grpo.policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0, 0.0, 0.5]), mask).loss
    (loss + values.pow(2).mean()).backward()
    assert actor_rt.stats["microbatches"][-1]["exposure_source"] == "analytic"
    assert critic_rt.stats["microbatches"][-1]["exposure_source"] != "analytic"
    for runtime in (actor_rt, critic_rt):
        runtime.detach()


def test_coefficients_of_a_model_without_hilore_go_nowhere_without_a_walk(monkeypatch):
    """A GRPO loss naming a model that has no runtime (a baseline beside a HiLoRe model, as in
    the bench) hands its ω to no runtime and walks no graph to look for one: the walk is what a
    loss naming no model needs."""
    from ds_hilore.runtime import registry

    plain = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    hilore = tiny_model("qwen2", layers=2, hidden=32, dropout=False, seed=1)
    runtime = ds_hilore.attach(hilore, {"force_plan": "H"})
    walks = []
    walk = registry.first_reached
    monkeypatch.setattr(registry, "first_reached", lambda *a: walks.append(1) or walk(*a))
    try:
        ids = _ids(0)
        kept = hilore(input_ids=ids, use_cache=False).logits  # a HiLoRe forward alive
        logits = plain(input_ids=ids, use_cache=False).logits  # (B, T, V)
        logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
        loss = ds_hilore.grpo.policy_loss(logp, logp.detach(), torch.tensor(
            [1.0, -1.0, 0.0, 0.5]), torch.ones_like(logp), model=plain).loss
        assert walks == []
        (loss + kept.sum()).backward()
        assert runtime.stats["microbatches"][-1]["exposure_source"] != "analytic"
    finally:
        runtime.detach()


def test_whose_loss_is_answered_once_per_model_until_a_runtime_attaches(monkeypatch):
    """The runtime of a loss's model is found by walking modules once (NOTE [ Whose loss, once
    per model ]): later losses naming the same model walk nothing; a runtime attaching or
    detaching asks again, and the coefficients go where they belong each time."""
    from ds_hilore.runtime import registry

    plain = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    hilore = tiny_model("qwen2", layers=2, hidden=32, dropout=False, seed=1)
    runtime = ds_hilore.attach(hilore, {"force_plan": "H"})
    asked = []
    find = registry.find_runtime
    monkeypatch.setattr(registry, "find_runtime", lambda *a: asked.append(a[0]) or find(*a))
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.5])

    def loss_of(model, step):
        ids = _ids(step)
        logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
        logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
        return ds_hilore.grpo.policy_loss(logp, logp.detach(), advantages, torch.ones_like(logp),
                                          model=model).loss

    second = None
    try:
        for step in range(3):
            loss_of(plain, step).backward()
            loss_of(hilore, step).backward()
            assert runtime.stats["microbatches"][-1]["exposure_source"] == "analytic"
        assert asked == [plain, hilore]  # once per model
        second = ds_hilore.attach(plain, {"force_plan": "H"})  # the plain model gets its own
        loss_of(plain, 3).backward()
        assert second.stats["microbatches"][-1]["exposure_source"] == "analytic"
        assert asked == [plain, hilore, plain]
        second.detach()
        second = None
        loss_of(plain, 4).backward()  # nowhere again
        assert asked == [plain, hilore, plain, plain]
    finally:
        runtime.detach()
        if second is not None:
            second.detach()


@pytest.mark.parametrize("detached", [True, False], ids=["detached", "dropped"])
def test_a_model_named_by_its_losses_is_freed_with_its_runtime(detached):
    """The answer kept per model (NOTE [ Whose loss, once per model ]) holds its runtime weakly:
    a model whose losses named it (``policy_loss(model=...)``) is freed once the script lets go
    of it and of its runtime, detached or not -- an engine rebuilt in the same process (a
    sweep, a reload) no longer keeps every earlier one's weights."""
    import gc
    import weakref

    def one_run(seed):
        model = tiny_model("qwen2", layers=2, hidden=32, dropout=False, seed=seed)
        runtime = ds_hilore.attach(model, {"force_plan": "R"})
        ids = _ids(seed)
        logp = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        ds_hilore.grpo.policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0, 0.0, 0.5]),
                                   torch.ones_like(logp), model=model).loss.backward()
        assert runtime.stats["microbatches"][-1]["exposure_source"] == "analytic"
        runtime.end_step()
        if detached:
            runtime.detach()
        return weakref.ref(model), weakref.ref(runtime)

    refs = [one_run(seed) for seed in range(3)]
    gc.collect()
    assert [(model(), runtime()) for model, runtime in refs] == [(None, None)] * 3


def test_coefficients_that_name_no_forward_are_warned_about_once(caplog):
    """Two forwards alive and no ``logp=``: said once, not at every step (nothing is elided)."""
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    with caplog.at_level(logging.DEBUG, logger="ds_hilore"):
        for step in range(3):
            first, second = model(input_ids=_ids(step)).logits, model(input_ids=_ids(step + 9)).logits
            runtime.set_coefficients(torch.ones(4, 15))
            (first.sum() + second.sum()).backward()
            runtime.end_step()
            model.zero_grad(set_to_none=True)
    said = [r for r in caplog.records if "forwards are alive" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def _logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)


@pytest.mark.parametrize("seq_a", [16, 32])
def test_a_loss_of_a_forward_run_as_gc_goes_to_no_later_forward(caplog, seq_a):
    """Two forwards before their losses, the first run as GC (its bucket's), the second
    planned (NOTE [ Which forward a loss is of ]): the first's coefficients go nowhere (nothing
    of it to elide) and the second keeps its own. They went to the second forward: of another
    length, it raised that they did not fit; of the same length, it took them silently."""
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    try:
        with caplog.at_level(logging.WARNING, logger="ds_hilore"):
            for step in range(2):
                ids_a, ids_b = _ids(step, seq=seq_a), _ids(step + 9)
                runtime.gc_forward = True  # as a bucket run as GC runs (plan/scheduler.py)
                logp_a = _logp(model(input_ids=ids_a, use_cache=False).logits, ids_a)
                first = runtime._mb
                runtime.gc_forward = False
                logp_b = _logp(model(input_ids=ids_b, use_cache=False).logits, ids_b)
                second = runtime._mb
                assert first.as_gc and not second.as_gc
                ours = torch.full((4, 15), 3.0)
                runtime.set_coefficients(ours, logp=logp_b)
                runtime.set_coefficients(torch.full((4, seq_a - 1), 2.0), logp=logp_a)
                assert torch.equal(second.coefficients, ours)
                (logp_a.sum() + logp_b.sum()).backward()
                runtime.end_step()
                model.zero_grad(set_to_none=True)
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    finally:
        runtime.detach()



def test_coefficients_without_logp_go_to_the_planned_forward_beside_one_run_as_gc(caplog):
    """Without ``logp`` nothing names the forward: the one alive with HiLoRe's frames is meant,
    whatever forwards run as GC are alive beside it (nothing of theirs to elide), and nothing
    is said (NOTE [ Which forward a loss is of ])."""
    model = tiny_model("qwen2", layers=2, hidden=32, dropout=False)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    try:
        with caplog.at_level(logging.WARNING, logger="ds_hilore"):
            runtime.gc_forward = True
            first = model(input_ids=_ids(0), use_cache=False).logits
            runtime.gc_forward = False
            second = model(input_ids=_ids(1), use_cache=False).logits
            ours = torch.full((4, 15), 3.0)
            runtime.set_coefficients(ours)
            assert torch.equal(runtime._mb.coefficients, ours)
            (first.sum() + second.sum()).backward()
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    finally:
        runtime.detach()
