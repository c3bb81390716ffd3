"""Kept rows only (NOTE [ Kept rows only ] in ds_hilore/runtime/rows.py): the sequences a
prediction says are zero run their layers without autograd, the others under the plan.

Asserted: against the model without HiLoRe on the whole batch, the loss, the logits and every
gradient but the decoder layers' weights bitwise, those within fp32 rounding (their sums skip
the zero rows); against the model without HiLoRe run on the kept rows alone (what a trainer
that drops the zero sequences computes), the decoder layers' gradients bitwise; the rows kept;
a wrong prediction raising before any step; the layers' recompute and backward FLOPs halved.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from models import VOCAB, equal_utilities, one_torch_thread, planner_model, tiny_model
from torch.utils.flop_counter import FlopCounterMode

import ds_hilore
from ds_hilore.config import HiLoReConfig

B, T, PROMPT = 4, 48, 8
PART = torch.tensor([1.0, 0.0, -0.5, 0.0])  # rows 1 and 3 zero
PLANS = {"R": "R", "H": "H", "mixed": {"*": "R", "model.layers.0.*": "H"}}
LAYERS = "model.layers."

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def _data(seed: int, advantages: torch.Tensor, batch: int = B):
    """(token ids (B, T), ω (B, T-1)): ω zero on the prompt and on the rows whose advantage is."""
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(3, VOCAB, (batch, T), generator=g)
    omega = torch.rand(batch, T - 1, generator=g) * advantages[:, None]
    omega[:, :PROMPT] = 0
    return ids, omega


def _step(model, ids, omega, runtime=None, position_ids=None, extra=None):
    """Forward, loss sum(ω logp) (its coefficients handed to ``runtime``), backward: (loss,
    logits, gradient of every trainable parameter by name)."""
    model.zero_grad(set_to_none=True)
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    out = model(input_ids=ids, use_cache=False, output_hidden_states=extra is not None, **kwargs)
    logits = out.logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    loss = (omega * logp).sum()
    if runtime is not None:
        runtime.set_coefficients(omega, logp=logp)
    if extra is not None:
        loss = loss + extra(out, logits)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logits.detach(), grads


def _attached(plan, model=None):
    """(model, a copy without HiLoRe, the runtime running ``plan`` on every microbatch)."""
    model = planner_model() if model is None else model
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"low_precision": "none"})
    runtime.set_plan(plan)  # the allocator steps aside
    return model, ref, runtime


def _first(runtime, model):
    """A first microbatch, whole: each layer's safety for a split is learnt there."""
    ids, omega = _data(0, PART)
    _step(model, ids, omega, runtime)
    runtime.end_step()


def _predicted(runtime, model, ids, omega, **kwargs):
    runtime.expect(omega.abs().sum(1).tolist())
    got = _step(model, ids, omega, runtime, **kwargs)
    runtime.end_step()
    return got, runtime.stats


def _deviation(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("plan", list(PLANS))
def test_kept_rows_are_exact(plan):
    model, ref, runtime = _attached(PLANS[plan])
    try:
        _first(runtime, model)
        ids, omega = _data(1, PART)
        (loss, logits, grads), stats = _predicted(runtime, model, ids, omega)
        assert stats["microbatches"][0]["kept_rows"] == [0, 2]
        assert stats["microbatches"][0]["exact_zero_sequences"] == 2
        # the whole batch, without HiLoRe: the forward bitwise; every gradient outside the
        # decoder layers bitwise (the embedding's too: the layers' input gradient is exact
        # row by row); the layers' within fp32 rounding of sums over other rows
        ref_loss, ref_logits, ref_grads = _step(ref, ids, omega)
        assert torch.equal(loss, ref_loss) and torch.equal(logits, ref_logits)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            if LAYERS in name:
                assert _deviation(g, ref_grads[name]) < 1e-5, name
            else:
                assert torch.equal(g, ref_grads[name]), name
        # the kept rows alone, without HiLoRe (a trainer that drops the zero sequences):
        # the decoder layers' gradients and the embedding's bitwise
        kept = torch.tensor([0, 2])
        _, _, alone = _step(copy.deepcopy(ref), ids[kept], omega[kept])
        for name, g in grads.items():
            if LAYERS in name or "embed" in name:
                assert torch.equal(g, alone[name]), name
        expected_r = {"R": 4, "H": 0, "mixed": 2}[plan]
        assert stats["recomputed_units"] == expected_r
    finally:
        runtime.detach()


def test_packed_rows_keep_a_row_where_any_of_its_sequences_is_kept():
    """Two rows of two sequences each (position ids restart): row 0 all zero, row 1 with one
    zero sequence. Row 1 is kept whole, row 0 runs without autograd."""
    model, ref, runtime = _attached("H")
    try:
        _first(runtime, model)
        ids, omega = _data(2, torch.tensor([0.0, 1.0]), batch=2)
        omega[1, :T // 2] = 0  # row 1's first sequence zero
        position_ids = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)])[None].repeat(2, 1)
        (loss, _, grads), stats = _predicted(runtime, model, ids, omega, position_ids=position_ids)
        assert stats["microbatches"][0]["kept_rows"] == [1]
        ref_loss, _, ref_grads = _step(ref, ids, omega, position_ids=position_ids)
        assert torch.equal(loss, ref_loss)
        for name, g in grads.items():
            assert (_deviation(g, ref_grads[name]) < 1e-5) if LAYERS in name else \
                torch.equal(g, ref_grads[name]), name
    finally:
        runtime.detach()


def test_a_wrong_prediction_raises_before_the_backward():
    model, _, runtime = _attached("R")
    try:
        _first(runtime, model)
        ids, omega = _data(3, PART)
        runtime.expect([1.0, 0.0, 1.0, 1.0])  # row 3 is zero, row 1 is not
        with pytest.raises(ds_hilore.HiLoReError, match="expect"):
            _step(model, ids, omega.flip(0), runtime)
    finally:
        runtime.detach()


class Ranks:
    """A stand-in for ``runtime.collective`` under ZeRO 0-2 (set after attach: module calls
    are each rank's own): records its callers; ``others`` is what the other ranks bring to the
    late read (late leak, disproved), OR-ed in."""

    def __init__(self, others=(0, 0)):
        self.calls, self.others = [], list(others)

    def all_reduce_max(self, values):
        import sys

        self.calls.append(sys._getframe(1).f_code.co_name)
        if self.calls[-1] == "flush":
            return [max(v, o) for v, o in zip(values, self.others)]
        return list(values)

    all_reduce_max_float = all_reduce_sum = all_reduce_max


@pytest.mark.parametrize("here", [True, False])
def test_a_wrong_prediction_of_a_microbatch_of_its_own_raises_on_every_rank_before_the_step(here):
    """Under ZeRO 0-2 with a plan set by hand, a microbatch's decisions are its rank's own and
    it agrees nothing (NOTE [ A microbatch of its own ] in ds_hilore/runtime/agreement.py): a
    row predicted zero with coefficients is found here at the coefficients (``here``) or on
    another rank, and raises at the late read before the optimizer step, on every rank."""
    model, _, runtime = _attached("R")
    try:
        _first(runtime, model)
        runtime.collective = ranks = Ranks(others=(0, 0) if here else (0, 1))
        ids, omega = _data(3, PART)
        runtime.expect([1.0, 0.0, 1.0, 1.0] if here else omega.abs().sum(1).tolist())
        _step(model, ids, omega.flip(0) if here else omega, runtime)  # row 1 is not zero
        assert ranks.calls == [] and runtime._mb.local_checks and runtime._mb.split is not None
        with pytest.raises(ds_hilore.HiLoReError, match="expect"):
            runtime.check_late()
        assert ranks.calls == ["flush"]
        runtime.end_step()  # read: nothing left
        assert ranks.calls == ["flush"]
    finally:
        runtime.detach()


@pytest.mark.parametrize("where", ["entropy", "hidden_state"])
def test_gradient_a_prediction_does_not_see_stops_the_step(where):
    """A loss term that reaches a row predicted zero -- an entropy bonus on the logits, a loss
    on an intermediate layer's hidden states -- is caught at the layers' merges: an error
    before the optimizer steps on the wrong gradient."""
    model, _, runtime = _attached("H")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    try:
        _first(runtime, model)
        ids, omega = _data(4, PART)
        if where == "entropy":
            def extra(out, logits):
                return 1e-3 * (logits.softmax(-1) * logits.log_softmax(-1)).sum()
        else:
            def extra(out, logits):
                return 1e-3 * out.hidden_states[1][1].sum()
        runtime.expect(omega.abs().sum(1).tolist())
        _step(model, ids, omega, runtime, extra=extra)
        with pytest.raises(ds_hilore.HiLoReError, match="zero"):
            optimizer.step()
    finally:
        runtime.detach()


def test_layers_that_draw_random_numbers_keep_their_rows_whole(caplog):
    """Dropout in training mode: the masks over the kept rows alone would not be the whole
    batch's, so nothing is split (said once), and the gradients are the model's."""
    model, ref, runtime = _attached("H", model=tiny_model("llama", dropout=True))
    try:
        with caplog.at_level(logging.WARNING, logger="ds_hilore"):
            _first(runtime, model)
        assert "draws random numbers" in caplog.text
        ids, omega = _data(5, PART)
        torch.manual_seed(7)
        (loss, _, grads), stats = _predicted(runtime, model, ids, omega)
        assert stats["microbatches"][0]["kept_rows"] is None
        torch.manual_seed(7)
        ref_loss, _, ref_grads = _step(ref, ids, omega)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    finally:
        runtime.detach()


def _backward_flops(model, runtime, advantages, predict: bool) -> int:
    ids, omega = _data(6, advantages)
    if predict:
        runtime.expect(omega.abs().sum(1).tolist())
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    runtime.set_coefficients(omega, logp=logp)
    with FlopCounterMode(display=False) as counter:
        (omega * logp).sum().backward()
    runtime.end_step()
    return counter.get_total_flops()


def test_half_the_rows_zero_halves_the_layers_recompute_and_backward():
    """All R: a microbatch's backward FLOPs are the LM head's (``head``: what a microbatch of
    zeros, whose layers' backward is skipped, runs) plus the layers' recompute and backward.
    With half its rows predicted zero, the layers' part is exactly half the whole one's."""
    model, _, runtime = _attached("R")
    try:
        _first(runtime, model)
        whole = _backward_flops(model, runtime, PART, predict=False)
        half = _backward_flops(model, runtime, PART, predict=True)
        head = _backward_flops(model, runtime, torch.zeros(B), predict=False)
        assert runtime.stats["backward_skipped"] == 1
        assert 0 < head < half < whole
        assert 2 * (half - head) == whole - head
    finally:
        runtime.detach()


def test_the_planner_runs_kept_rows_and_spends_what_the_zero_rows_leave(monkeypatch):
    """Under the allocator, short of memory: a predicted microbatch's kept rows run a plan
    re-solved for them (two of four rows: per-sequence bytes priced for two), and the
    gradients are exact."""
    equal_utilities(monkeypatch)
    model = planner_model()
    ref = copy.deepcopy(model)
    config = {"low_precision": "none", "profile_microbatches": 2, "calibration_microbatches": 0,
              "plan_validation_microbatches": 0}
    runtime = ds_hilore.attach(model, config)
    try:
        kept = []
        for seed in range(5):
            if seed == 3:  # planned: now under the least budget that stores some units, not all
                _short_of_memory(runtime, config)
            ids, omega = _data(10 + seed, PART)
            (loss, _, grads), stats = _predicted(runtime, model, ids, omega)
            kept.append(stats["microbatches"][0]["kept_rows"])
            ref_loss, _, ref_grads = _step(ref, ids, omega)
            assert torch.equal(loss, ref_loss)
            for name, g in grads.items():
                assert (_deviation(g, ref_grads[name]) < 1e-5) if LAYERS in name else \
                    torch.equal(g, ref_grads[name]), name
        assert kept[:2] == [None, None]  # profiled: measured whole
        assert kept[2:] == [[0, 2]] * 3
        assert {key[1] for key in runtime.policy.row_plans} == {2}  # solved for 2 rows
    finally:
        runtime.detach()


def test_a_microbatch_a_matched_pass_replays_runs_whole(monkeypatch):
    """A calibration whose exact gradient is taken by a second pass (the two-pass form) replays
    its microbatch's forward: that microbatch runs whole even where the prediction would run its
    kept rows only, so the gradient the pass starts from has every row (it had the kept rows', and
    the pass raised a shape mismatch), and the steady microbatches around it split."""
    from ds_hilore.plan.calibrate import MatchedPasses

    equal_utilities(monkeypatch)
    monkeypatch.setattr(MatchedPasses, "_capture_fits", lambda self, bucket: False)  # two passes
    monkeypatch.setattr(MatchedPasses, "SETTLE", None)
    model = planner_model()
    runtime = ds_hilore.attach(model, {"codec_backend": "eager", "min_pack_numel": 1024,
                                       "profile_microbatches": 2, "calibration_microbatches": 2,
                                       "plan_validation_microbatches": 0})
    try:
        kept, calibrated = [], []
        for seed in range(5):
            ids, omega = _data(20 + seed, PART)
            _, stats = _predicted(runtime, model, ids, omega)
            kept.append(stats["microbatches"][0]["kept_rows"])
            calibrated.append("calibration" in stats["warm_up"])
        samples = sum(len(v) for v in runtime.policy.risk.samples.values())
    finally:
        runtime.detach()
    assert calibrated == [False, False, True, True, False] and samples == 2
    assert kept == [None, None, None, None, [0, 2]]


def _short_of_memory(runtime, config) -> None:
    """The bucket planned under the least absolute budget with room for some of its units."""
    policy = runtime.policy
    bucket, = policy.buckets.values()
    step = max(u.h_bytes for u in bucket.profile.units) // 4
    for k in range(1, 400):
        policy.config = HiLoReConfig(**dict(
            config, memory_budget_bytes=bucket.profile.gc_peak_bytes + k * step))
        policy._plan_bucket(bucket, profiled=False)
        if "H" in bucket.plan.actions.values():
            break
    assert 0 < list(bucket.plan.actions.values()).count("H") < 4, bucket.plan


def test_zero_sequences_found_late_are_said_once_with_the_line_that_hands_the_prediction_over(
        caplog):
    """NOTE [ Zero sequences found late ] in ds_hilore/runtime/unpredicted.py: without a
    prediction, the first step that finds zero sequences after their forward says how many,
    and the line that hands the prediction over; once per run, and never for a step that had
    a prediction."""
    model, _, runtime = _attached("R")
    try:
        with caplog.at_level(logging.WARNING, logger="ds_hilore"):
            ids, omega = _data(20, PART)
            runtime.expect(omega.abs().sum(1).tolist())
            _step(model, ids, omega, runtime)
            runtime.end_step()  # predicted: nothing said
            said = [r.getMessage() for r in caplog.records if "found only after" in r.getMessage()]
            assert said == []
            for seed in (21, 22):
                _step(model, *_data(seed, PART), runtime)
                runtime.end_step()
        said = [r.getMessage() for r in caplog.records if "found only after" in r.getMessage()]
        assert len(said) == 1 and "2 of this optimizer step's 4 sequences" in said[0], said
        assert "expect(ds_hilore.grpo.exposure.predicted(advantages, response_mask))" in said[0]
    finally:
        runtime.detach()


def test_zero_sequences_found_late_in_packed_rows_are_said_without_a_prediction_to_hand_over(
        caplog):
    """Sequences packed into one row (position ids restarting) run the row's layers whole: a
    prediction cannot run one of them apart, so the line said once for zero sequences found
    late says that instead of asking for one."""
    model, _, runtime = _attached("R")
    try:
        ids, omega = _data(23, torch.tensor([1.0]), batch=1)
        omega[0, T // 2:] = 0  # the second sequence of the row zero
        position_ids = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)])[None]
        with caplog.at_level(logging.WARNING, logger="ds_hilore"):
            _step(model, ids, omega, runtime, position_ids=position_ids)
            runtime.end_step()
        said = [r.getMessage() for r in caplog.records if "found only after" in r.getMessage()]
        assert len(said) == 1 and "1 of this optimizer step's 2 sequences" in said[0], said
        assert "in packed rows" in said[0] and "cannot run part of a row apart" in said[0]
    finally:
        runtime.detach()


def test_a_prediction_of_another_length_than_the_forwards_rows_is_said_not_used(caplog):
    """``expect`` takes one value per row of the next training forward: one of another length
    (a value per sequence of a packed row, a stale one) is not used -- the rows run whole,
    exactly -- and that is said once, with why where the forward is a packed row."""
    model, ref, runtime = _attached("H")
    try:
        _first(runtime, model)
        ids, omega = _data(24, torch.tensor([1.0]), batch=1)
        omega[0, T // 2:] = 0
        position_ids = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)])[None]
        with caplog.at_level(logging.DEBUG, logger="ds_hilore"):
            runtime.expect([1.0, 0.0])  # one value per packed sequence
            loss, _, grads = _step(model, ids, omega, runtime, position_ids=position_ids)
            runtime.end_step()
            assert runtime.stats["microbatches"][0]["kept_rows"] is None
            ref_loss, _, ref_grads = _step(ref, ids, omega, position_ids=position_ids)
            assert torch.equal(loss, ref_loss)
            assert all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
            ids, omega = _data(25, PART)
            runtime.expect([1.0, 0.0, 1.0])  # three values for four rows
            _step(model, ids, omega, runtime)
            runtime.end_step()
            runtime.expect(omega.abs().sum(1).tolist())  # four: used, nothing said
            _step(model, ids, omega, runtime)
            runtime.end_step()
        said = [r for r in caplog.records if "was handed" in r.getMessage()]
        assert [(r.levelno, r.getMessage().split(":")[1].strip()[:60]) for r in said] == [
            (logging.WARNING, "expect() was handed 2 values before a forward of 1 rows"),
            (logging.DEBUG, "expect() was handed 3 values before a forward of 4 rows")]
        assert "cannot run part of a row apart" in said[0].getMessage()
        assert "packed" not in said[1].getMessage()
    finally:
        runtime.detach()
