"""Exposure decides: risk in the step's units, exposure known before the forward, freed memory spent.

A tiny Qwen2 (2 layers: 4 units) trained on GRPO microbatches whose advantages are set by hand
(on-policy: the ratio is 1, nothing clipped unless a test clips), under a plan resumed from a
profile (NOTE [ Risk in step units ] in ds_hilore/plan/risk.py; NOTE [ Freed memory is spent ]
in ds_hilore/plan/scheduler.py). Decisions that depend on timings use a profile whose times
are fixed (``_timed``): 1 s of recompute per unit, packing nearly free; bytes are either the
profile's own measured ones or fixed too. Decisions are asserted, never speed.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from models import VOCAB, one_torch_thread, planner_model, tiny_model

import ds_hilore
from ds_hilore.grpo import exposure, group_advantages, policy_loss
from ds_hilore.plan.profile import BucketProfile, UnitCost
from ds_hilore.plan.risk import RiskModel, StepExposure
from ds_hilore.runtime.memory import PeakMeter

B, T = 4, 64
BUCKET = (4, 64)
PROMPT = 8
BASE = {"codec_backend": "eager", "min_pack_numel": 1024, "profile_microbatches": 2,
        "calibration_microbatches": 0, "plan_validation_microbatches": 0}
HIGH_01 = torch.tensor([2.0, -2.0, 0.1, -0.1])  # large |A| in rows 0-1
HIGH_23 = torch.tensor([0.1, -0.1, 2.0, -2.0])  # large |A| in rows 2-3
TINY = torch.tensor([0.01, -0.01, 0.01, -0.01])  # tiny everywhere


_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)
_model = planner_model


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1000 + seed))


def _mask() -> torch.Tensor:
    mask = torch.ones(B, T - 1)
    mask[:, :PROMPT] = 0  # the prompt
    return mask


def _microbatch(model, seed: int, advantages: torch.Tensor, runtime=None, predict=False,
                step_exposure=None, clip=False):
    """Forward (after ``expect`` when ``predict``), GRPO loss handed to the runtime, backward."""
    ids, mask = _ids(seed), _mask()
    if predict:
        runtime.expect(exposure.predicted(advantages, mask), step_exposure)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    old = logp.detach() + (1.0 if clip else 0.0)  # clip: ratio e^-1 < 1 - eps everywhere
    policy_loss(logp, old, advantages, mask, model=model).loss.backward()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters() if p.requires_grad]


def _rel_error(got, ref) -> float:
    num = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(got, ref))
    den = sum(float(b.double().pow(2).sum()) for b in ref)
    return math.sqrt(num / den)


def _fixed_profile(runtime, h_bytes=1_000_000, rel_error=0.01, gc_peak=1 << 30) -> BucketProfile:
    """Every unit: 1 s of recompute, packing nearly free, L keeps a quarter of H."""
    layers = sorted({u.layer_index for u in runtime.units})
    costs = [UnitCost(u.name, u.kind, layers.index(u.layer_index), u.pos, recompute_s=1.0,
                      capture_s=0.0, pack_s=0.01, unpack_s=0.01, h_bytes=h_bytes,
                      l_bytes=h_bytes // 4, ff_bytes=0, rel_error=rel_error, rows=B,
                      sliceable=True) for u in runtime.units]
    return BucketProfile(BUCKET, costs, gc_peak_bytes=gc_peak, baseline_bytes=gc_peak // 2,
                         repeats=1, seconds=0.0)


def _resume(runtime, profile: BucketProfile) -> None:
    runtime.load_state_dict({"version": 1, "policy": {
        "risk": RiskModel().to_dict(), "tighten": 1.0, "calibrated": 0,
        "profiles": [profile.to_dict()]}})


def _record(runtime) -> list:
    """Per planned microbatch: (actions the plan captured with, rows, units as they ran)."""
    calls = []
    apply_plan = runtime.apply_plan

    def recording(plan, rows=None):
        calls.append((dict(plan) if not isinstance(plan, str) else plan, dict(rows or {})))
        return apply_plan(plan, rows)

    runtime.apply_plan = recording
    return calls


def _packed(actions: dict, rows: dict) -> int:
    """Units holding at least one packed sequence."""
    return sum(1 for n, a in actions.items() if a == "L" or "L" in rows.get(n, ()))


# ---------------------------------------------------------------------------- (a) one step, three ω

def _three_microbatches(predict: bool):
    """Two optimizer steps of three microbatches each (gradient accumulation 3): large |A| in
    rows 0-1, in rows 2-3, tiny everywhere; the second step is returned. Headroom 1.9 h: the
    bucket's plan (an average microbatch) is H + S + L + R (1.875 h, risk 0.015)."""
    model = _model()
    h = 1_000_000
    runtime = ds_hilore.attach(model, dict(BASE, memory_budget_bytes=(1 << 30) + int(1.9 * h)))
    _resume(runtime, _fixed_profile(runtime, h_bytes=h))
    plan = dict(runtime.policy.buckets[BUCKET].plan.actions)
    calls = _record(runtime)
    advantages = (HIGH_01, HIGH_23, TINY)
    step = sum(sum(exposure.predicted(a, _mask())) for a in advantages)
    try:
        out = []
        for k in range(2):
            out = []
            for j, adv in enumerate(advantages):
                _microbatch(model, j, adv, runtime, predict=predict, step_exposure=step)
                executed = {u.name: u.action for u in runtime.units}
                out.append((*calls[-1], executed, runtime.policy.step_exposure.risks[-1]))
            runtime.end_step()
        stats = runtime.stats
    finally:
        runtime.detach()
    return plan, out, stats


def test_three_microbatches_of_one_step_decide_by_their_exposure_before_the_forward():
    """Predicted exposure with the step's total: the microbatches carrying most of the step's
    |A| (rho = 1.5) pack less than the bucket's plan, the tiny one (rho ~ 0) packs more; the
    splits keep the large-|A| rows H and pack the small-|A| ones, whatever their index."""
    plan, out, stats = _three_microbatches(predict=True)
    assert sorted(plan.values()) == ["H", "L", "R", "S"], plan
    (a1, r1, e1, _), (a2, r2, e2, _), (a3, r3, e3, _) = out
    planned = sum(1 for a in plan.values() if a in "LS")  # the bucket's plan packs 2 units
    assert _packed(a1, r1) < planned and _packed(a2, r2) < planned, out
    assert _packed(a3, r3) > planned, out
    for actions, rows, first_rows in ((a1, r1, ("H", "H", "L", "L")), (a2, r2, ("L", "L", "H", "H"))):
        split = [n for n, r in rows.items() if "L" in r and "H" in r]
        assert split and all(rows[n] == first_rows for n in split), rows
    for actions, executed in ((a1, e1), (a2, e2), (a3, e3)):
        assert all(executed[n] == ("H" if a == "S" else a) or executed[n] == "L"
                   for n, a in actions.items() if a != "R"), (actions, executed)
    assert stats["grad_error_est"] <= stats["risk_budget"] + 1e-12
    assert stats["predicted_microbatches"] == 3
    where = stats["exposure_quartiles"]  # the splits: H on the most exposed rows, L on the least
    assert where["H"]["top"] > where["H"]["bottom"] and where["L"]["bottom"] > where["L"]["top"], where


def test_three_microbatches_of_one_step_decide_by_their_exposure_after_the_forward():
    """No prediction: the same plan for all three (the split packs rows 0-1). Once ω is known,
    the microbatch whose packed rows carry its large |A| sends a unit to R; the one whose
    packed rows carry small |A| keeps the plan, and so does the tiny one, whose risk in the
    step's units is a small fraction of the others'."""
    plan, out, _ = _three_microbatches(predict=False)
    (a1, r1, e1, est1), (a2, r2, e2, est2), (a3, r3, e3, est3) = out
    assert a1 == a2 == a3 and r1 == r2 == r3  # the same plan before the forward
    recomputed = [sum(1 for n in e if e[n] == "R") for e in (e1, e2, e3)]
    planned_r = list(plan.values()).count("R")
    assert recomputed[0] > planned_r and recomputed[1] == recomputed[2] == planned_r, (out, plan)
    assert est3 < 0.1 * est2, (est1, est2, est3)  # sum_u s eps E_{u,S}: the step's units


# ---------------------------------------------------------------------------- (b) predicted zeros

def _profiled(budget_over_gc: int, **config):
    """A runtime that profiled its bucket itself (real bytes, GC's peak of this process), then
    resumed from that profile with its times fixed so that every action pays (``_timed``) and
    its budget ``budget_over_gc`` bytes above GC's peak."""
    model = _model()
    runtime = ds_hilore.attach(model, dict(BASE, memory_budget_bytes=1 << 40, **config))  # set below
    for k in range(BASE["profile_microbatches"]):
        _microbatch(model, 100 + k, HIGH_01)
        runtime.end_step()
    profile = runtime.policy.buckets[BUCKET].profiler.result()
    # GC's peak read 4 MiB high: the headroom planned for is budget_over_gc all the same, and
    # the plan's peak check (NOTE [ The plan's peak, checked ]) passes whatever else this
    # process's memory does between the profile and the check (these headrooms are a few
    # hundred KB; an overshoot of any size would send every unit to R)
    profile.gc_peak_bytes += 4 << 20
    runtime.config.memory_budget_bytes = profile.gc_peak_bytes + budget_over_gc
    _resume(runtime, _timed(profile))
    return model, runtime


def _timed(profile: BucketProfile) -> BucketProfile:
    # priced as GC's peak plus every kept byte: the headrooms these tests set (a few hundred
    # KB) are in those terms (a plan priced phase by phase has tests of its own)
    profile.top_room_bytes, profile.layer_room_bytes = 0, []
    for cost in profile.units:
        cost.recompute_s, cost.capture_s, cost.derive_s = 1.0, 0.0, 0.0
        cost.pack_s = cost.unpack_s = 0.01
    return profile


def _captured(runtime) -> dict:
    """Per kept unit at the end of the forward: (row states of every storage, H bytes, L
    bytes, bytes of each storage whole)."""
    out = {}
    mb = runtime._mb
    for frame in mb.live_frames():
        for pos, unit in enumerate(frame.layer.units):
            if frame.plan.actions[pos] == "R":
                continue
            stored = frame.units[pos].stored
            out[unit.name] = ([s.row_states() for s in stored],
                              sum(s.bytes_by_action().get("H", 0) for s in stored),
                              sum(s.bytes_by_action().get("L", 0) for s in stored),
                              [s.nbytes for s in stored])
    return out


def _predicted_step(model, runtime, seed, advantages):
    """One microbatch with its exposure predicted: (plan actions, rows, captured at the end
    of the forward, peak bytes of the microbatch)."""
    calls = _record(runtime)
    ids, mask = _ids(seed), _mask()
    runtime.expect(exposure.predicted(advantages, mask))
    with PeakMeter("cpu") as meter:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        captured = _captured(runtime)
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        policy_loss(logp, logp.detach(), advantages, mask, model=model).loss.backward()
    runtime.end_step()
    runtime.apply_plan = type(runtime).apply_plan.__get__(runtime)
    return calls[-1][0], calls[-1][1], captured, meter.peak_bytes


def test_sequences_predicted_zero_are_never_captured_and_their_memory_is_spent():
    """Rows 2-3 with A = 0, predicted: they run the layers apart, without autograd (NOTE [ Kept
    rows only ] in runtime/rows.py), so every storage of every kept unit holds rows 0-1 only,
    from the capture on (two rows, H or L, its H bytes those rows'); the plan, re-solved for
    the two rows kept, keeps more units H or L than the same microbatch without zero rows; the
    peak stays within the budget on both."""
    model, runtime = _profiled(budget_over_gc=1_000_000)
    bucket = runtime.policy.buckets[BUCKET]
    try:
        full = _predicted_step(model, runtime, 7, torch.tensor([1.5, -1.5, 0.7, -0.7]))
        zero = _predicted_step(model, runtime, 7, torch.tensor([1.5, -1.5, 0.0, 0.0]))
        budget = bucket.budget_bytes
    finally:
        runtime.detach()
    kept = {n for n, a in full[0].items() if a != "R"}
    kept_zero = {n for n, a in zero[0].items() if a != "R"}
    assert len(kept_zero) > len(kept), (full[0], zero[0])
    assert set(zero[2]) == kept_zero
    for name, (states, h_bytes, l_bytes, whole) in zero[2].items():
        assert states and all(len(s) == 2 for s in states), (name, states)  # rows 0-1 only
        assert all(x in ("H", "L") for s in states for x in s), (name, states)
        kept_h = sum(w // 2 * s.count("H") for s, w in zip(states, whole))  # rows are equal
        assert h_bytes == kept_h, (name, h_bytes, kept_h)
    for name, (states, _, _, _) in full[2].items():
        assert all("E" not in s for s in states), (name, states)
    assert full[3] <= budget and zero[3] <= budget, (full[3], zero[3], budget)


def test_under_matched_calls_the_freed_memory_keeps_the_buckets_recompute_set():
    """NOTE [ One recompute set under ZeRO-3 ]: where the ranks' module calls must match
    (ZeRO-3), the plan re-solved for rows 0-1 recomputes exactly the units the bucket's plan
    recomputes (so DeepSpeed's trace of module calls repeats) and spends the zero rows'
    memory storing more of the others in high precision; without matched calls the same
    microbatch recomputes fewer units (the test above)."""
    model, runtime = _profiled(budget_over_gc=1_000_000)
    runtime.matched_calls = True
    bucket = runtime.policy.buckets[BUCKET]
    try:
        full = _predicted_step(model, runtime, 7, torch.tensor([1.5, -1.5, 0.7, -0.7]))
        zero = _predicted_step(model, runtime, 7, torch.tensor([1.5, -1.5, 0.0, 0.0]))
        budget = bucket.budget_bytes
        recomputed = {n for n, a in bucket.plan.actions.items() if a == "R"}
    finally:
        runtime.detach()
    assert recomputed and len(recomputed) < len(bucket.plan.actions), bucket.plan.actions
    assert {n for n, a in full[0].items() if a == "R"} == recomputed, full[0]
    assert {n for n, a in zero[0].items() if a == "R"} == recomputed, zero[0]
    high = [sum(a == "H" for a in plan.values()) for plan in (full[0], zero[0])]
    assert high[1] > high[0], (full[0], zero[0])
    assert set(zero[2]) == set(zero[0]) - recomputed
    assert all(len(s) == 2 for states, *_ in zero[2].values() for s in states)  # rows 0-1
    assert full[3] <= budget and zero[3] <= budget, (full[3], zero[3], budget)


def test_a_microbatch_predicted_zero_everywhere_captures_nothing_and_skips_its_recompute():
    """NOTE [ A microbatch predicted zero ]: A = 0 on every sequence, predicted. Before any ω
    has come from the loss, the plan re-solved for no rows keeps every unit with each of its
    rows elided at capture (E), as before; once one has, nothing is captured (every unit R,
    no per-sequence rows), the recompute is skipped when ω shows the zeros (nor counted in
    ``exposure_quartiles``: it has none), and a step of it and a microbatch with ω has
    bitwise the gradient of no checkpointing (H and R only here)."""
    model, reference = _model(), _model()
    runtime = ds_hilore.attach(model, dict(BASE, low_precision="none",
                                           memory_budget_bytes=(1 << 30) + 1_500_000))
    _resume(runtime, _fixed_profile(runtime))  # one unit H (1 MB of 1.5), the rest R
    zero = torch.zeros(B)
    try:
        actions, rows, _, _ = _predicted_step(model, runtime, 3, zero)  # no ω seen yet
        assert rows.keys() == {n for n, a in actions.items() if a != "R"} and rows, actions
        assert all(set(r) == {"E"} for r in rows.values()), rows
        model.zero_grad(set_to_none=True)
        actions, rows, captured, _ = _predicted_step(model, runtime, 4, zero)
        stats = runtime.stats
        zero_stats, quartiles = stats["microbatches"][-1], stats["exposure_quartiles"]
        _predicted_step(model, runtime, 5, HIGH_01)
        planned = runtime.stats["microbatches"][-1]["actions"]
    finally:
        runtime.detach()
    assert set(actions.values()) == {"R"} and rows == {} and captured == {}, (actions, rows)
    assert zero_stats["recomputed_units"] == 0 and zero_stats["actions"]["E"] == 0, zero_stats
    assert quartiles is None, quartiles  # no exposure: no quartiles, R not counted in them
    assert planned["H"] == 1, planned  # the other microbatch kept its plan
    for seed, advantages in ((4, zero), (5, HIGH_01)):
        ids, mask = _ids(seed), _mask()
        logits = reference(input_ids=ids, use_cache=False).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        policy_loss(logp, logp.detach(), advantages, mask, model=reference).loss.backward()
    got, ref = _grads(model), _grads(reference)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), _rel_error(got, ref)


def test_plans_for_a_predicted_risk_factor_are_solved_rarely_and_never_under_priced(monkeypatch):
    """NOTE [ Freed memory is spent ]: after a step (N = 2), microbatches predicted at rho =
    P_m / (P_step / N) = 2, 0.8 and 0.83. At 2 the bucket's plan still fits the risk budget
    (its risk 0.003 x 2): it is applied, nothing solved; 0.8 and 0.83 share one solve, for rho
    rounded up to 2^(-1/4) = 0.84 (never below the predicted factor)."""
    from ds_hilore.plan import prediction

    model = _model()
    runtime = ds_hilore.attach(model, dict(BASE, memory_budget_bytes=(1 << 30) + int(1.9e6)))
    _resume(runtime, _fixed_profile(runtime, h_bytes=1_000_000, rel_error=0.001))
    bucket = runtime.policy.buckets[BUCKET]
    solves = []  # the knapsack solves for a microbatch (the bucket's plan is solved above)
    allocate = prediction.allocate
    monkeypatch.setattr(prediction, "allocate",
                        lambda *a, **k: solves.append(a[1]) or allocate(*a, **k))
    calls = _record(runtime)
    try:
        for j in range(2):
            _microbatch(model, j, HIGH_01)
        runtime.end_step()
        assert runtime.policy.step_exposure.previous_count == 2 and bucket.plan.risk <= 0.004
        for j, step in enumerate((4.0, 10.0, 8 / 0.83)):  # P_m = 4: rho 2, 0.8, 0.83
            runtime.expect([1.0] * B, step)
            _microbatch(model, 10 + j, HIGH_01)
        keys = list(runtime.policy.row_plans)
    finally:
        runtime.detach()
    assert calls[-3][0] == bucket.plan.actions, (calls[-3], bucket.plan.actions)
    assert len(solves) == 1 and [k[2] for k in keys] == [2 ** -0.25], (solves, keys)


def test_the_step_tolerance_is_shared_by_its_exposed_microbatches_only():
    """NOTE [ The tolerance of a step, shared by its exposed microbatches ]: after a step of
    N = 2 microbatches, the next step's other microbatch is predicted zero (P_m = P_step = 4).
    Read against N = 2 this one is twice the step's mean (rho = 2): the bucket's plan (risk
    0.009, three units packed) no longer fits the 0.015 budget and a unit goes to R. Told that
    one microbatch of the step is exposed (K = 1: it carries the step's whole error), it
    runs the bucket's plan, and the check after the forward keeps every packed unit."""
    model = _model()
    runtime = ds_hilore.attach(model, dict(BASE, memory_budget_bytes=(1 << 30) + int(1.9e6)))
    _resume(runtime, _fixed_profile(runtime, h_bytes=1_000_000, rel_error=0.003))
    bucket = runtime.policy.buckets[BUCKET]
    calls = _record(runtime)
    try:
        for j in range(2):
            _microbatch(model, j, HIGH_01)
        runtime.end_step()
        assert runtime.policy.step_exposure.previous_count == 2
        assert 0.0075 < bucket.plan.risk <= 0.015  # fits at rho 1, not at rho 2
        runtime.expect([1.0] * B, 4.0)  # N = 2: rho 2
        _microbatch(model, 10, HIGH_01)
        by_n = calls[-1][0]
        runtime.expect([1.0] * B, 4.0, exposed_microbatches=1)  # K = 1: rho 1
        _microbatch(model, 11, HIGH_01)
        by_k, executed = calls[-1][0], {u.name: u.action for u in runtime.units}
        with pytest.raises(ValueError, match="exposed_microbatches"):
            runtime.expect([1.0] * B, 4.0, exposed_microbatches=0)
    finally:
        runtime.detach()
    packed = [n for n, a in bucket.plan.actions.items() if a == "L"]
    assert len(packed) == 3 and by_k == bucket.plan.actions, (by_k, bucket.plan.actions)
    assert sum(a == "L" for a in by_n.values()) < 3 and "R" in by_n.values(), by_n
    assert executed == bucket.plan.actions  # nothing sent to R after the forward


# ---------------------------------------------------------------------------- (c) the step's error

def test_risk_estimate_tracks_the_measured_error_of_the_steps_gradient():
    """20 optimizer steps of gradient accumulation 4, validated every step; headroom 0.4 MB
    (no unit fits H, packing pays: the plan holds L and a split); calibration on the first 4.
    The step's estimate (the sum of its risks, NOTE [ Risk in step units ]) over the 16
    validated steps averages within a factor 2 of the measured relative error of the step's
    accumulated gradient (measured here: 0.0079 estimated, 0.0044 measured), and every
    measured step error is within ``grad_error_tolerance``; each microbatch's own error is
    reported too."""
    model, runtime = _profiled(400_000, calibration_microbatches=4, validation_interval=1)
    plan = runtime.policy.buckets[BUCKET].plan.actions
    g = torch.Generator().manual_seed(0)
    estimates, measured = [], []
    try:
        for step in range(20):
            for j in range(4):
                scale = 2 * torch.rand(1, generator=g)  # microbatches of different exposure
                advantages = group_advantages(torch.rand(4, generator=g), group_size=2) * scale
                _microbatch(model, 10 * step + j, advantages)
            runtime.end_step()
            stats = runtime.stats
            if stats["grad_error_measured"] is not None:
                estimates.append(stats["grad_error_est"])
                measured.append(stats["grad_error_measured"])
                assert len(stats["grad_error_measured_microbatch"]) == 4
                assert len(stats["grad_error_est_microbatch"]) == 4
        tolerance = runtime.config.grad_error_tolerance
    finally:
        runtime.detach()
    assert "L" in plan.values(), plan
    assert len(measured) == 16 and all(0 < m <= tolerance for m in measured), measured
    ratio = (sum(estimates) / len(estimates)) / (sum(measured) / len(measured))
    assert 0.5 <= ratio <= 2.0, (ratio, estimates, measured)


# ---------------------------------------------------------------------------- (d, e) ranking, where

def test_profile_ranking_check_ranks_slices_and_shows_where_actions_went(tmp_path, capsys, monkeypatch):
    """``hilore profile --spearman`` on fixed seeds: the risk model's prediction (complete
    exposure: |ω| weighted by the unit's activations, over the microbatch's mass) ranks the
    measured single-slice errors with Spearman >= 0.6; the advantage-only ranking (|A_i| x
    response tokens, what is known before the forward) is reported next to it; and the report
    says where H, L and R went by exposure."""
    from ds_hilore import cli

    from models import equal_utilities

    from ds_hilore.plan.validate import LeaveOneOut
    # fixed times: the knapsack's plan does not follow the load, and leave-one-out keeps it (a
    # bucket found no faster than GC, or with every layer dropped, runs as GC: nothing held out)
    equal_utilities(monkeypatch)
    monkeypatch.setattr(LeaveOneOut, "gc_not_slower", lambda self: False)
    monkeypatch.setattr(LeaveOneOut, "dropped", lambda self: set())
    path = tmp_path / "profile.json"
    assert cli.main(["profile", "--model", "qwen2", "--layers", "2", "--seq-len", "64",
                     "--micro-batch", "4", "--calibrate", "2", "--threads", "1", "--spearman",
                     "--json", str(path)]) == 0
    out = capsys.readouterr().out
    import json
    report = json.loads(path.read_text())
    ranking = report["ranking"]
    assert ranking["spearman"] >= 0.6, ranking
    assert ranking["spearman_advantage"] is not None and -1 <= ranking["spearman_advantage"] <= 1
    assert "advantage-only exposure: " in out
    quartiles = report["exposure_quartiles"]
    assert quartiles and set(quartiles) <= {"H", "L", "R"}, quartiles
    for shares in quartiles.values():
        assert 0 <= shares["bottom"] <= 1 and 0 <= shares["top"] <= 1
    assert "share on the most / least exposed quarter" in out


# ---------------------------------------------------------------------------- one decision, all ranks

class _PairedCollective:
    """A stand-in for ``runtime.collective`` of one of two ranks run one after the other:
    every call returns the element-wise max (or sum) of this rank's values and what the other
    rank sent in the same call (same method, same call number), recorded from its own run."""

    world_size = 2

    def __init__(self, other: "_PairedCollective | None" = None, strict: bool = True):
        self.other, self.sent, self.strict = other, [], strict
        self.rank = 1 - other.rank if other is not None else 0

    def _reduce(self, method: str, values: list, combine):
        k = len(self.sent)
        self.sent.append((method, list(values)))
        if self.other is None:
            return list(values)
        theirs = self.other.sent[k] if k < len(self.other.sent) else (None, [])
        if not self.strict and (theirs[0] != method or len(theirs[1]) != len(values)):
            return list(values)  # while recording: the other's calls differ so far
        assert theirs[0] == method and len(theirs[1]) == len(values), (k, method, theirs)
        return [combine(a, b) for a, b in zip(values, theirs[1])]

    def all_reduce_max(self, values):
        return self._reduce("max", values, max)

    def all_reduce_max_float(self, values):
        return self._reduce("max_float", values, max)

    def all_reduce_sum(self, values):
        return self._reduce("sum", values, lambda a, b: a + b)

    def broadcast_object(self, obj):
        return obj

    def broadcast_actions(self, actions):
        return list(actions)


def _recorded_pair(run_a, run_b) -> tuple[_PairedCollective, _PairedCollective]:
    """What each of two ranks sends, recorded beside what the other sent: what a rank sends can
    depend on what came back (e.g. whether a plan's check is repeated), so each is run again
    beside the other's latest recording until the calls agree (a fixed point, as two ranks
    running together reach at once). Each round settles the calls up to the next one whose
    presence depends on an agreed value (the top of the backward's all-reduce is made only
    where some rank elides a sequence), so a few rounds may be needed."""
    a = _PairedCollective()
    run_a(a)  # alone first
    for _ in range(8):
        b = _PairedCollective(a, strict=False)
        run_b(b)
        again = _PairedCollective(b, strict=False)
        run_a(again)
        if [m for m, _ in again.sent] == [m for m, _ in b.sent] == [m for m, _ in a.sent]:
            return again, b
        a = again
    raise AssertionError("the two ranks' collective calls never agreed")


def _rank(advantages, collective, model):
    """Two microbatches of one step on one "rank" (refresh_interval 2: the second reuses the
    first's decision): the units each ran as, after the decision."""
    h = 1_000_000
    runtime = ds_hilore.attach(model, dict(BASE, memory_budget_bytes=(1 << 30) + int(1.9 * h),
                                           refresh_interval=2))
    _resume(runtime, _fixed_profile(runtime, h_bytes=h))
    runtime.collective = collective
    ran = []
    try:
        for j in range(2):
            _microbatch(model, j, advantages)
            ran.append({u.name: u.action for u in runtime.units})
        runtime.end_step()
    finally:
        runtime.detach()
    return ran


def test_units_sent_to_recompute_after_the_forward_are_one_decision_for_all_ranks():
    """Same plan, different advantages per rank: rank A's packed rows carry its large |A| (alone
    it would send a unit to R), rank B's carry small |A| (alone it would send none). With the
    per-unit risks all-reduced before the decision, both ranks send the same units to R, on
    the microbatch that read exposure and on the one that reused the decision."""
    base = _model()
    alone_a = _rank(HIGH_01, None, copy.deepcopy(base))
    alone_b = _rank(HIGH_23, None, copy.deepcopy(base))
    assert alone_a[0] != alone_b[0]  # rank-local decisions would differ (ZeRO-3 would hang)
    first_a, first_b = _recorded_pair(lambda c: _rank(HIGH_01, c, copy.deepcopy(base)),
                                      lambda c: _rank(HIGH_23, c, copy.deepcopy(base)))
    ran_a = _rank(HIGH_01, _PairedCollective(first_b), copy.deepcopy(base))
    ran_b = _rank(HIGH_23, _PairedCollective(first_a), copy.deepcopy(base))
    recomputed = [{n for n, a in ran.items() if a == "R"} for ran in (*ran_a, *ran_b)]
    assert recomputed[0] == recomputed[2] and recomputed[1] == recomputed[3], recomputed
    assert recomputed[0] == {n for n, a in alone_a[0].items() if a == "R"}  # the riskier rank's
    assert recomputed[1] == recomputed[0]  # reused between refreshes


def _calibrating_rank(advantages, collective, model, matched: bool = False) -> tuple[dict, list]:
    """Three steps of one microbatch on one "rank", calibrating until 2 samples are taken
    (matched passes): its risk model afterwards and the samples taken after each step;
    ``matched``: the ranks' module calls must match (ZeRO-3); ``advantages`` None: a loss
    that hands HiLoRe no coefficients (no token weights)."""
    runtime = ds_hilore.attach(model, dict(BASE, memory_budget_bytes=(1 << 30) + int(1.9e6),
                                           calibration_microbatches=2))
    _resume(runtime, _fixed_profile(runtime))
    runtime.collective, runtime.matched_calls = collective, matched
    runtime.policy.passes.SETTLE = None  # every sample asked for is taken
    calibrated = []
    try:
        for j in range(3):
            if advantages is None:
                model(input_ids=_ids(j), use_cache=False).logits.float().mean().backward()
            else:
                _microbatch(model, j, advantages)
            runtime.end_step()
            calibrated.append(runtime.policy.calibrated)
        return runtime.policy.risk.to_dict(), calibrated
    finally:
        runtime.detach()


def test_calibration_leaves_every_rank_the_same_risk_model():
    """A calibration sample divides the agreed error by the exposure of the units packed; with
    each rank's own exposure the ranks' risk models drift apart (and with them the plans each
    re-solves for its microbatch's rows); agreed, every rank holds the same model."""
    base = _model()
    alone = [_calibrating_rank(a, None, copy.deepcopy(base)) for a in (HIGH_01, HIGH_23)]
    assert alone[0][1][-1] > 0 and alone[0][0] != alone[1][0], alone  # would drift apart
    # every rank calibrating the same group (ZeRO-3; else NOTE [ Calibration spread over ranks ])
    first_a, first_b = _recorded_pair(
        lambda c: _calibrating_rank(HIGH_01, c, copy.deepcopy(base), matched=True),
        lambda c: _calibrating_rank(HIGH_23, c, copy.deepcopy(base), matched=True))
    ran_a = _calibrating_rank(HIGH_01, _PairedCollective(first_b), copy.deepcopy(base), True)
    ran_b = _calibrating_rank(HIGH_23, _PairedCollective(first_a), copy.deepcopy(base), True)
    assert ran_a[1][-1] > 0 and ran_a == ran_b, (ran_a, ran_b)


@pytest.mark.parametrize("matched", [False, True])
def test_ranks_calibrate_a_group_each_where_their_module_calls_need_not_match(matched):
    """NOTE [ Calibration spread over ranks ]: on 2 ranks under ZeRO 0-2 the first calibrating
    step takes both samples due, one per rank, of two groups, each its rank's own error over
    its own exposure; every rank folds in both, in rank order: the same risk model. Where the
    module calls must match (ZeRO-3) both ranks calibrate the same group, one sample a step."""
    base = _model()
    alone = [_calibrating_rank(a, None, copy.deepcopy(base)) for a in (HIGH_01, HIGH_23)]
    assert [c for _, c in alone] == [[1, 2, 2]] * 2, alone  # one rank: one sample a step
    first_a, first_b = _recorded_pair(
        lambda c: _calibrating_rank(HIGH_01, c, copy.deepcopy(base), matched),
        lambda c: _calibrating_rank(HIGH_23, c, copy.deepcopy(base), matched))
    ran_a = _calibrating_rank(HIGH_01, _PairedCollective(first_b), copy.deepcopy(base), matched)
    ran_b = _calibrating_rank(HIGH_23, _PairedCollective(first_a), copy.deepcopy(base), matched)
    assert ran_a == ran_b, (ran_a, ran_b)
    samples = ran_a[0]["samples"]
    if matched:
        assert ran_a[1] == [1, 2, 2], ran_a
        return
    assert ran_a[1] == [2, 2, 2], ran_a  # both samples in the first step
    # rank 0 sampled the first group, rank 1 the second: each its own microbatch's sample
    first, second = (alone[k][0]["samples"] for k in (0, 1))
    assert len(samples) == 2 and all(len(v) == 1 for v in samples.values()), samples
    groups = sorted(samples)
    assert samples[next(iter(first))] == first[next(iter(first))], (samples, first)
    assert sorted(set(first) | set(second)) == groups, (samples, first, second)


@pytest.mark.parametrize("case", ["a rank without loss mass", "no token weights"])
def test_a_spread_calibration_counts_the_samples_taken(case):
    """NOTE [ Calibration spread over ranks ]: a rank whose microbatch has no loss mass (every
    advantage 0) adds no sample, the other rank's counts, and the last sample due is taken by
    both ranks on one group; a loss that hands no coefficients is taken as exposed (as a
    calibration without ranks takes it), so both ranks' samples count."""
    base = _model()
    a, b = (HIGH_01, torch.zeros(B)) if case == "a rank without loss mass" else (None, None)
    first_a, first_b = _recorded_pair(lambda c: _calibrating_rank(a, c, copy.deepcopy(base)),
                                      lambda c: _calibrating_rank(b, c, copy.deepcopy(base)))
    ran_a = _calibrating_rank(a, _PairedCollective(first_b), copy.deepcopy(base))
    ran_b = _calibrating_rank(b, _PairedCollective(first_a), copy.deepcopy(base))
    assert ran_a == ran_b, (ran_a, ran_b)
    samples = ran_a[0]["samples"]
    assert ran_a[1] == ([1, 2, 2] if b is not None else [2, 2, 2]), ran_a
    assert len(samples) == 2 and all(len(v) == 1 for v in samples.values()), samples


def _predicting_rank(advantages, collective, model) -> dict:
    """One step on one "rank": a microbatch whose ω comes from the loss, then one predicted
    from ``advantages``; the actions the second was captured with."""
    runtime = ds_hilore.attach(model, dict(BASE, memory_budget_bytes=(1 << 30) + int(1.9e6)))
    _resume(runtime, _fixed_profile(runtime))
    runtime.collective = collective
    calls = _record(runtime)
    try:
        _microbatch(model, 0, HIGH_01)
        _microbatch(model, 1, advantages, runtime, predict=True)
        runtime.end_step()
    finally:
        runtime.detach()
    return calls[-1][0]


def test_a_microbatch_predicted_zero_on_one_rank_only_runs_the_plan_of_every_rank():
    """NOTE [ A microbatch predicted zero ] is one decision for all ranks: alone, a rank whose
    microbatch is predicted zero everywhere captures nothing (all R); paired with a rank whose
    microbatch is not, both capture with the same actions (a rank-local R hangs ZeRO-3)."""
    base, zero = _model(), torch.zeros(B)
    assert set(_predicting_rank(zero, None, copy.deepcopy(base)).values()) == {"R"}
    first_a, first_b = _recorded_pair(lambda c: _predicting_rank(zero, c, copy.deepcopy(base)),
                                      lambda c: _predicting_rank(HIGH_01, c, copy.deepcopy(base)))
    ran_a = _predicting_rank(zero, _PairedCollective(first_b), copy.deepcopy(base))
    ran_b = _predicting_rank(HIGH_01, _PairedCollective(first_a), copy.deepcopy(base))
    assert ran_a == ran_b and set(ran_a.values()) != {"R"}, (ran_a, ran_b)


# ---------------------------------------------------------------------------- TRL's loss step

class _Trainer:
    """What ``predicted_exposure`` reads of a GRPOTrainer (TRL 1.16's attribute names)."""

    def __init__(self, **changes):
        self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = 0.0, False, False
        self.loss_type = "grpo"
        vars(self).update(changes)


@pytest.mark.parametrize("changes", [{}, {"beta": 0.04}, {"_entropy_bonus_enabled": True},
                                     {"aux_loss_enabled": True}, {"loss_type": "sapo"}])
def test_trl_loss_step_hands_its_advantages_before_the_forward_only_when_exact(changes):
    from ds_hilore.integrations import trl_exposure

    model = _model()
    runtime = ds_hilore.attach(model, BASE)
    inputs = {"advantages": torch.tensor([1.0, 0.0, -0.5, 0.0]),
              "completion_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]),
              "tool_mask": torch.tensor([[1, 1, 0, 0]] * 4)}
    try:
        trl_exposure._hand(_Trainer(**changes), model, inputs)
        expected = runtime.policy.expected
    finally:
        runtime.detach()
    if changes:  # a zero advantage might not be a zero coefficient: nothing predicted
        assert expected is None
    else:
        assert expected == [2.0, 0.0, 1.0, 0.0]  # |A_i| x response tokens outside tools


def test_trl_grpo_trainer_compute_loss_is_wrapped_once_when_its_shape_is_known():
    pytest.importorskip("trl", reason="trl is a test dependency: pip install -e '.[test]'")
    import trl.trainer.grpo_trainer as grpo_trainer

    from ds_hilore.integrations import trl_exposure

    original = grpo_trainer.GRPOTrainer.__dict__["_compute_loss"]
    try:
        assert trl_exposure.install() and trl_exposure.install()
        wrapped = grpo_trainer.GRPOTrainer.__dict__["_compute_loss"]
        assert wrapped is not original and wrapped.__wrapped__ is original
    finally:
        grpo_trainer.GRPOTrainer._compute_loss = original


# ---------------------------------------------------------------------------- the reference, pure

def test_reference_mass_is_the_steps_mean_microbatch_as_far_as_known():
    """NOTE [ Risk in step units ]: M_ref = E_step / N. Without a prediction and N = 1 (one
    rank, no accumulation) it is the microbatch's own mass; with N = 4 the masses seen so far
    plus the previous step's mean for the rest; with a prediction, M_m x mean P / P_m. The
    step's estimate is its summed risk over its total mass; ranks add theirs."""
    ref = StepExposure()
    assert ref.reference(3.0) == 3.0  # nothing known: its own
    ref.add(3.0, 0.03)
    assert ref.close() == {"step": 0.01, "microbatches": [0.01]}
    assert ref.reference(0.5) == 0.5  # N = 1: the step is this microbatch
    for mass in (2.0, 2.0, 2.0, 2.0):
        ref.add(mass, 0.01)
    ref.close()
    assert (ref.previous_mean, ref.previous_count) == (2.0, 4)
    assert ref.reference(0.4) == (0.4 + 3 * 2.0) / 4
    ref.add(0.4, 0.0)
    assert ref.reference(6.0) == (0.4 + 6.0 + 2 * 2.0) / 4
    assert ref.reference(1.0, predicted=5.0, predicted_step=40.0) == 1.0 * (40.0 / 4) / 5.0
    # K = 2 of the step's microbatches predicted non-zero: they share the tolerance
    assert ref.reference(1.0, predicted=5.0, predicted_step=40.0, exposed=2) == 40.0 / 2 / 5.0

    class Sum:  # the other rank brought the same again
        def all_reduce_sum(self, values):
            return [2 * v for v in values]
    assert ref.close(Sum()) == {"step": 0.0, "microbatches": [0.0]}
    assert (ref.previous_mean, ref.previous_count) == (0.4, 2)


# ---------------------------------------------------------------- later PPO epochs, the example
def test_example_predicts_a_later_epoch_from_the_previous_epochs_ratios():
    """NOTE [ Exposure at later PPO epochs ]: examples/grpo's update hands HiLoRe |A_i| x
    response tokens at epoch 1, and at epoch 2 the same less the tokens epoch 1 clipped (the
    optimizer here changes nothing, so epoch 1's ratios are epoch 2's)."""
    import argparse

    from examples.grpo.rollout import Rollout, sequence_logprobs
    from examples.grpo.update import actor_update

    class Recorder:  # stands in for engine.hilore
        calls: list[tuple[list[float], float]] = []
        stats = {"microbatches": []}

        def expect(self, values, step_exposure=None):
            self.calls.append((list(values), step_exposure))

    class Engine(torch.nn.Module):  # the DeepSpeed engine's surface the update uses
        def __init__(self, module):
            super().__init__()
            self.module, self.hilore, self.device = module, Recorder(), torch.device("cpu")

        def forward(self, **kw):
            return self.module(**kw)

        def backward(self, loss):
            loss.backward()

        def step(self):
            self.module.zero_grad(set_to_none=True)

    model = tiny_model("qwen2", layers=2, dropout=False)
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (4, PROMPT + 6))
    attention = torch.ones_like(ids)
    completion = torch.ones(4, 6, dtype=torch.bool)
    completion[3, 4:] = False
    with torch.no_grad():
        logp = sequence_logprobs(model, ids, attention, PROMPT)  # (4, 6)
    shift = torch.zeros(4, 6)
    shift[0, :3] = 0.5  # ratio e^0.5 > 1.2 with A > 0: clipped
    shift[1, :] = -0.5  # ratio e^-0.5 < 0.8 with A < 0: every token clipped
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0])
    rollout = Rollout(ids, attention, PROMPT, completion, torch.zeros(4), advantages, logp - shift, None)
    args = argparse.Namespace(ppo_epochs=2, per_device_training_batch_size=2, gradient_accumulation_steps=2,
                              loss_type="grpo", drop_zero_rows=False, beta=0.0, epsilon=0.2,
                              epsilon_high=None, max_answer_seq_len=6)
    actor_update(Engine(model), rollout, args)
    calls = Recorder.calls
    assert len(calls) == 4  # 2 epochs x 2 micro-batches
    first = exposure.predicted(advantages, completion)
    assert calls[0][0] + calls[1][0] == first and calls[0][1] == pytest.approx(sum(first))
    ratios = torch.exp(shift)
    second = exposure.predicted_after_clip(advantages, completion, ratios, 0.2)
    got = calls[2][0] + calls[3][0]
    assert got == pytest.approx(second, rel=1e-5)
    assert got[0] == pytest.approx(3 * math.exp(0.0), rel=1e-5)  # 3 of 6 tokens clipped
    assert 0 < got[1] < 1e-3 and got[2] == pytest.approx(first[2], rel=1e-5)  # all clipped; none
    assert got[3] == 0.0  # A = 0: the only exact zero, the only one elided
    assert calls[2][1] == pytest.approx(sum(second), rel=1e-5)


# ---------------------------------------------------------- validation: the step's error over ranks
class _OtherRank:
    """Stands in for ``runtime.collective`` on rank 0 of 2: each sum adds what the other rank
    brought for the same tensor, in the order the tensors are reduced (``tensor=False``: the
    collective has only the list form ``all_reduce_sum``)."""

    def __init__(self, other: list[torch.Tensor], tensor: bool = True):
        self.other, self.calls = list(other), 0
        if not tensor:
            self.all_reduce_sum_tensor = None

    def all_reduce_sum_tensor(self, t: torch.Tensor) -> None:  # in place, as torch.distributed
        t += self.other[self.calls].to(t.dtype)
        self.calls += 1

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        flat = torch.cat([o.flatten().double() for o in self.other])
        assert len(values) == flat.numel()
        self.calls += 1
        return [v + o for v, o in zip(values, flat.tolist())]

    def all_reduce_max_float(self, values):
        return values


@pytest.mark.parametrize("tensor", [True, False], ids=["tensor", "list"])
def test_step_error_is_the_summed_gradients_not_the_worst_rank(tensor):
    """The step's gradient is the sum over ranks: its error is ||sum_r d_r|| / ||sum_r g_r||,
    which neither the max nor the sum of the ranks' own errors is. Here rank 1's error cancels
    rank 0's: each rank alone measures 1/sqrt(2), the step 0; then they add up."""
    from ds_hilore.plan.calibrate import step_error

    def grads(*values):  # one fp64 tensor per parameter (summed in place by step_error)
        f64 = torch.float64
        return [torch.tensor(values[:2], dtype=f64), torch.tensor([[values[2]]], dtype=f64)]

    def d0():
        return grads(1.0, 0.0, 0.0)

    def g0():
        return grads(1.0, 1.0, 0.0)

    assert step_error(d0(), g0(), None) == pytest.approx(2 ** -0.5)  # one process: its own
    assert step_error(d0(), g0(), _OtherRank(grads(-1.0, 0.0, 0.0) + g0(), tensor)) == 0.0
    expected = (8.0 / 8.0) ** 0.5  # ||(2, 0, 2)|| / ||(2, 2, 0)||; each rank alone: 1/sqrt(2), sqrt(5/2)
    assert step_error(d0(), g0(), _OtherRank(grads(1.0, 0.0, 2.0) + g0(), tensor)) == pytest.approx(expected)


def _step_error_rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from ds_hilore.integrations.engine import TorchDistCollective
    from ds_hilore.plan.calibrate import step_error

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        f64 = torch.float64
        diff = [torch.tensor([1.0, 0.0], dtype=f64), torch.tensor([[2.0 * rank]], dtype=f64)]
        exact = [torch.tensor([1.0, 1.0], dtype=f64), torch.tensor([[0.0]], dtype=f64)]
        error = step_error(diff, exact, TorchDistCollective())
        torch.save(error, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_step_error_over_two_gloo_ranks(tmp_path):
    """The same through ``TorchDistCollective`` on 2 processes: D = (2, 0, 2), G = (2, 2, 0)."""
    import torch.multiprocessing as mp

    from tests.launch import free_port

    mp.spawn(_step_error_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)] == [pytest.approx(1.0)] * 2


# ------------------------------------------------------------------- the reference across a resume
def test_reference_exposure_survives_a_resume():
    """The running reference (the last step's mean microbatch mass and count) is in the
    state dict: a resumed run reads its first microbatch against the same step as before."""
    model = tiny_model("qwen2", layers=2, dropout=False)
    runtime = ds_hilore.attach(model, BASE)
    runtime.policy.step_exposure.add(2.0, 0.02)
    runtime.policy.step_exposure.add(4.0, 0.01)
    runtime.policy.step_exposure.close()  # M_ref 3.0 over N = 2
    state = runtime.state_dict()
    runtime.detach()
    fresh = ds_hilore.attach(tiny_model("qwen2", layers=2, dropout=False), BASE)
    assert fresh.policy.step_exposure.reference(1.0) == 1.0  # a fresh run knows nothing
    fresh.load_state_dict(state)
    ref = fresh.policy.step_exposure
    assert (ref.previous_mean, ref.previous_count) == (3.0, 2)
    assert ref.reference(1.0) == (1.0 + 3.0) / 2 and (ref.masses, ref.risks) == ([], [])
    fresh.detach()
