"""A microbatch whose loss coefficients are all exactly zero skips its layers' backward
(NOTE [ A backward of zeros ] in ds_hilore/runtime/elision.py): asserted on the ops the
backward runs, on gradients bitwise equal to the model without HiLoRe, and on an optimizer
step after a step of zeros only."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from models import VOCAB, CountOps, equal_utilities, one_torch_thread, planner_model, tiny_model

import ds_hilore
from ds_hilore.config import HiLoReConfig
from ds_hilore.grpo import policy_loss
from ds_hilore.runtime import bundle, storage

B, T, PROMPT = 4, 48, 8
SPREAD = torch.tensor([1.0, -1.0, 0.5, -0.5])
ZERO = torch.zeros(B)
PART = torch.tensor([1.0, 0.0, -0.5, 0.0])  # two sequences with zero coefficients
MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten._scaled_dot_product")

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def _microbatch(model, seed: int, advantages: torch.Tensor, entropy: float = 0.0,
                before_backward=None) -> int:
    """Forward, GRPO loss (its coefficients to the runtime of ``model``, if any), backward;
    the matmuls the backward ran."""
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1000 + seed))
    mask = torch.ones(B, T - 1)
    mask[:, :PROMPT] = 0
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    loss = policy_loss(logp, logp.detach(), advantages, mask, model=model).loss
    if entropy:  # a loss term the coefficients do not see
        loss = loss - entropy * -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    if before_backward is not None:
        before_backward()
    counter = CountOps(MATMULS)
    with counter:
        loss.backward()
    return counter.count


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters() if p.requires_grad]


def _same(got: list, ref: list) -> bool:
    return all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(got, ref))


@pytest.mark.parametrize("plan", ["R", "H"])
def test_a_microbatch_of_zeros_skips_its_layers_backward_and_the_gradients_are_exact(plan):
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": plan, "low_precision": "none"})
    try:
        _microbatch(model, 0, SPREAD)  # discovery
        model.zero_grad(set_to_none=True)
        runtime.end_step()
        matmuls = {}
        for skip in (False, True):
            runtime.zero_backward_skip = skip
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            matmuls[skip] = _microbatch(model, 1, ZERO)  # a step of a zero microbatch, then one with spread
            _microbatch(model, 2, SPREAD)
            runtime.end_step()
            stats = runtime.stats  # the step's
            _microbatch(ref, 1, ZERO)
            _microbatch(ref, 2, SPREAD)
            assert _same(_grads(model), _grads(ref)), skip
            assert stats["backward_skipped"] == int(skip), stats
        # the layers' matmuls, forward and backward, are gone: what is left is the LM head's
        assert matmuls[True] < matmuls[False] / 3, matmuls
    finally:
        runtime.detach()


def test_a_step_of_zeros_steps_the_optimizer_as_without_the_skip():
    """Every microbatch of the step zero: the parameters below still get their zero gradient
    (not None), so AdamW's momentum and weight decay move them as they would have."""
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": "R", "low_precision": "none"})
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (model, ref)]
    try:
        for step, advantages in enumerate((SPREAD, SPREAD, ZERO, ZERO)):
            for m, opt in zip((model, ref), opts):
                opt.zero_grad(set_to_none=True)
                _microbatch(m, step, advantages)
            assert _same(_grads(model), _grads(ref)), step
            for opt in opts:
                opt.step()
            runtime.end_step()
            assert runtime.stats["backward_skipped"] == (step >= 2), step
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.equal(a, b)
    finally:
        runtime.detach()


def test_gradient_from_a_term_the_coefficients_miss_is_not_skipped():
    """An entropy bonus reaches the zero sequences: the read at the top sees it, the layers
    fall back to R, nothing is skipped, gradients exact."""
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    try:
        _microbatch(model, 0, SPREAD)
        runtime.end_step()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        _microbatch(model, 1, ZERO, entropy=0.01)
        runtime.end_step()
        stats = runtime.stats
        _microbatch(ref, 1, ZERO, entropy=0.01)
        assert stats["backward_skipped"] == 0
        assert _same(_grads(model), _grads(ref))
        assert any(g is not None and g.abs().sum() > 0 for g in _grads(model))
    finally:
        runtime.detach()


# NOTE [ Stand-ins on accelerators ]: "whole" elides only microbatches whose layers' backward
# is skipped, so no backward reads a stand-in. Stand-ins of NaN make any read visible: a
# backward that meets one turns its zero gradient into NaN.
@pytest.fixture
def nan_stand_ins(monkeypatch):
    def nan(dtype):
        return float("nan") if dtype.is_floating_point else 0
    monkeypatch.setattr(storage, "stand_in_value", nan)
    monkeypatch.setattr(bundle, "stand_in_value", nan)


def _finite(grads: list) -> bool:
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("plan", ["R", "H"])
def test_whole_microbatch_elision_reads_no_stand_in(plan, nan_stand_ins):
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": plan, "low_precision": "none",
                                       "elide_zero_rows": "whole"})
    try:
        _microbatch(model, 0, SPREAD)  # discovery
        runtime.end_step()
        for skip in (True, False):  # False: as under ZeRO 1-3, whose hooks see every gradient
            runtime.zero_backward_skip = skip
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            for seed, advantages in ((1, ZERO), (2, PART)):
                _microbatch(model, seed, advantages)
                _microbatch(ref, seed, advantages)
            runtime.end_step()
            stats = runtime.stats
            assert _same(_grads(model), _grads(ref)) and _finite(_grads(model)), skip
            assert stats["backward_skipped"] == int(skip), stats
            # the zero microbatch's H units elided only when its backward was skipped; the
            # partly zero one's sequences never
            assert stats["actions"]["E"] == (2 * 2 if skip and plan == "H" else 0), stats
    finally:
        runtime.detach()


def test_whole_elision_recomputes_when_the_skip_does_not_happen_after_all(nan_stand_ins):
    """A microbatch elided for a skip that then does not happen (here the switch turned off
    between the loss and the backward) recomputes its units instead of reading stand-ins."""
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none",
                                       "elide_zero_rows": "whole"})
    try:
        _microbatch(model, 0, SPREAD)  # discovery
        runtime.end_step()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)

        def no_skip():
            runtime.zero_backward_skip = False
        _microbatch(model, 1, ZERO, before_backward=no_skip)
        runtime.end_step()
        stats = runtime.stats
        _microbatch(ref, 1, ZERO)
        assert _same(_grads(model), _grads(ref)) and _finite(_grads(model))
        # summarised as elided at the coefficients, recomputed in the backward
        assert stats["backward_skipped"] == 0, stats
        assert stats["microbatches"][0]["recomputed_units"] == 4, stats
    finally:
        runtime.detach()


def test_whole_elision_skips_nothing_whose_forward_was_not_gated(nan_stand_ins, monkeypatch):
    """The opposite switch: off at the forward (no gate on the last layer's output), on by the
    loss. Nothing is elided for a skip that cannot happen: the backward runs the plan."""
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none",
                                       "elide_zero_rows": "whole"})
    try:
        _microbatch(model, 0, SPREAD)  # discovery
        runtime.end_step()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        runtime.zero_backward_skip = False
        loss = policy_loss

        def switched_on(*args, **kwargs):
            runtime.zero_backward_skip = True
            return loss(*args, **kwargs)
        monkeypatch.setattr(sys.modules[__name__], "policy_loss", switched_on)
        _microbatch(model, 1, ZERO)
        monkeypatch.undo()
        runtime.end_step()
        stats = runtime.stats
        _microbatch(ref, 1, ZERO)
        assert _same(_grads(model), _grads(ref)) and _finite(_grads(model))
        assert stats["backward_skipped"] == 0 and stats["actions"]["E"] == 0, stats
    finally:
        runtime.detach()


@pytest.mark.parametrize("mode", ["whole", True])
def test_a_packed_row_of_zero_sequences_skips_its_layers_backward(mode):
    """A packed row (three sequences in one row) whose every sequence is zero skips its layers'
    backward as a batch of rows does: the skip counts no rows, only what the ranks agreed."""
    model = tiny_model("llama", dropout=False)
    ref = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(n) for n in (8, 10, 6)])[None]

    def microbatch(m, advantage: float) -> None:
        logits = m(input_ids=ids, position_ids=position_ids, use_cache=False).logits.float()
        logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = torch.ones_like(logp, dtype=torch.bool)
        policy_loss(logp, logp.detach(), torch.tensor([advantage]), mask, model=m).loss.backward()

    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none",
                                       "elide_zero_rows": mode})
    try:
        microbatch(model, 1.0)  # discovery
        runtime.end_step()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            microbatch(m, 0.0)
        runtime.end_step()
        stats = runtime.stats
        assert stats["microbatches"][0]["exact_zero_sequences"] == 3, stats  # the segments
        assert stats["backward_skipped"] == 1, stats
        assert _same(_grads(model), _grads(ref))
    finally:
        runtime.detach()


def test_elided_rows_read_stand_ins_where_whole_elision_reads_none(nan_stand_ins):
    """The control for the two tests above: with every zero sequence elided (true, CPU's
    default) the partly zero microbatch's backward reads its stand-ins."""
    model = planner_model()
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none",
                                       "elide_zero_rows": True})
    try:
        _microbatch(model, 0, SPREAD)  # discovery
        runtime.end_step()
        model.zero_grad(set_to_none=True)
        _microbatch(model, 1, PART)
        assert not _finite(_grads(model))
        with pytest.raises(ds_hilore.HiLoReError, match="elide_zero_rows"):  # caught, as ever
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    finally:
        runtime.detach()


def _planned_short_of_memory(model, mode, monkeypatch, **planning):
    """(runtime, its bucket, the rows of every plan the policy applies from now on): ``model``
    profiled under ``elide_zero_rows`` ``mode``, then planned (with ``planning`` settings) under
    the least absolute budget with room for some of its four units, not all: memory is short
    (a plan storing every unit whole never elides: nothing to free)."""
    config = {"low_precision": "none", "profile_microbatches": 2, "calibration_microbatches": 0,
              "plan_validation_microbatches": 0, "elide_zero_rows": mode}
    runtime = ds_hilore.attach(model, config)
    applied = []
    apply_plan = runtime.apply_plan
    monkeypatch.setattr(runtime, "apply_plan",
                        lambda plan, rows=None: (applied.append(rows), apply_plan(plan, rows))[1])
    try:
        for seed in range(3):  # discovery, then profiled
            _microbatch(model, seed, SPREAD)
            runtime.end_step()
        policy = runtime.policy
        bucket, = policy.buckets.values()
        step = max(u.h_bytes for u in bucket.profile.units) // 4
        for k in range(1, 400):
            policy.config = HiLoReConfig(**dict(
                config, **planning, memory_budget_bytes=bucket.profile.gc_peak_bytes + k * step))
            policy._plan_bucket(bucket, profiled=False)
            if "H" in bucket.plan.actions.values():
                break
    except BaseException:
        runtime.detach()
        raise
    return runtime, bucket, applied


def test_a_timed_leave_one_out_variant_runs_as_planned_under_whole_elision(monkeypatch):
    """Leave-one-out times its variants on the microbatches that come (NOTE [ Leave-one-out ]),
    and a timed microbatch never skips its backward: under "whole" one predicted zero is not
    elided at capture (its E would be sent to R at the coefficients, and the time measured
    would not be the variant's). Gradients exact."""
    equal_utilities(monkeypatch)
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime, bucket, applied = _planned_short_of_memory(model, "whole", monkeypatch,
                                                        plan_validation_microbatches=1)
    try:
        runtime.policy._start_loo(bucket)
        assert bucket.loo is not None
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        applied.clear()
        runtime.expect([0.0] * B)
        _microbatch(model, 3, ZERO)
        runtime.end_step()
        stats = runtime.stats
        _microbatch(ref, 3, ZERO)
        assert _same(_grads(model), _grads(ref))
        assert not any("E" in r for rows in applied if rows for r in rows.values()), applied
        assert stats["backward_skipped"] == 0 and stats["actions"]["E"] == 0, stats
    finally:
        runtime.detach()


@pytest.mark.parametrize("mode", [True, "whole"])
def test_the_plan_elides_at_capture_what_the_setting_allows(mode, monkeypatch):
    """The allocator's plan from a prediction, in both settings: the sequences predicted zero
    run apart, without autograd (NOTE [ Kept rows only ] in ds_hilore/runtime/rows.py), never
    elided at capture; a microbatch predicted zero in every sequence is planned all R and its
    backward skipped where that backward can be skipped, and elsewhere (as under ZeRO-3) runs
    one of its rows with autograd. Gradients exact either way."""
    equal_utilities(monkeypatch)
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime, bucket, applied = _planned_short_of_memory(model, mode, monkeypatch)
    try:
        assert 0 < list(bucket.plan.actions.values()).count("H") < 4, bucket.plan
        for seed, advantages, skip in ((3, PART, True), (4, ZERO, True), (5, ZERO, False)):
            runtime.zero_backward_skip = skip  # False: as under ZeRO-3
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            applied.clear()
            runtime.expect([float(a != 0) for a in advantages])
            _microbatch(model, seed, advantages)
            runtime.end_step()
            stats = runtime.stats
            _microbatch(ref, seed, advantages)
            assert _same(_grads(model), _grads(ref)), (mode, seed)
            assert not any("E" in r for rows in applied if rows for r in rows.values()), applied
            kept = stats["microbatches"][0]["kept_rows"]
            if advantages is PART:
                assert kept == [0, 2], stats
            elif skip:  # predicted zero: all R, its backward skipped, in both settings
                assert kept is None and stats["actions"]["R"] == 4, stats
                assert stats["backward_skipped"] == 1, stats
            else:  # its backward runs, over one row
                assert kept == [0] and stats["backward_skipped"] == 0, stats
    finally:
        runtime.detach()
