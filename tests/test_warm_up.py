"""HiLoRe's warm-up, per run rather than per shape (NOTE [ A bucket learns from the others ] in
ds_hilore/plan/profile.py, NOTE [ Warm-up, counted ] in ds_hilore/plan/scheduler.py).

A run whose lengths vary per step meets several shape buckets. The first is profiled on
``profile_microbatches`` microbatches; every later one on a single microbatch of its own (its
bytes and GC's peak measured there, its times the run's per token), is planned within its
budget at its own longest length, and takes leave-one-out's verdict from the first instead of
timing variants again. Each step says what it spent on learning (``stats["warm_up"]``).

Times are never asserted: the plans are made on fixed profile times where a choice is checked.
"""

from __future__ import annotations

import json

import pytest
import torch
from models import VOCAB, equal_utilities, one_torch_thread, planner_model, tiny_model

import ds_hilore
from ds_hilore.grpo import group_advantages, policy_loss
from ds_hilore.plan.profile import UnitCost, per_token_times
from ds_hilore.plan.validate import LeaveOneOut
from ds_hilore.runtime.memory import PeakMeter

B = 4
CONFIG = {"codec_backend": "eager", "min_pack_numel": 1024, "profile_microbatches": 3,
          "calibration_microbatches": 0, "plan_validation_microbatches": 1,
          "memory_budget": 1.2}

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def _microbatch(model, step: int, length: int) -> None:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(3, VOCAB, (B, length), generator=g)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25]), group_size=2)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    policy_loss(logp, logp.detach(), advantages, torch.ones_like(logp), model=model).loss.backward()


def _step(runtime, model, step: int, length: int) -> dict:
    _microbatch(model, step, length)
    runtime.end_step()
    model.zero_grad(set_to_none=True)
    return runtime.stats


LENGTHS = (32,) * 9 + (64,) * 5
METERED = 10  # 4x64's first planned microbatch


@pytest.fixture(scope="module")
def run():
    """Bucket 4x32 profiled on three microbatches, planned at the fourth and timed by
    leave-one-out (the warm-up run, then the plan, GC and a variant per layer it keeps, two),
    which ends at the ninth; then 4x64: profiled on its first microbatch, planned at its second
    (at its longest length, 64, metered here), its plan timed against GC on the next two, then
    steady. Neither GC nor a layer's variant is faster here, whatever was timed (NOTE [ Never
    slower than GC ])."""
    mp = pytest.MonkeyPatch()
    equal_utilities(mp)  # every plan keeps what fits, whatever the load
    mp.setattr(LeaveOneOut, "gc_not_slower", lambda self: False)
    mp.setattr(LeaveOneOut, "dropped", lambda self: set())  # every layer pays
    model = planner_model()
    runtime = ds_hilore.attach(model, CONFIG)
    scheduler = runtime.policy
    got = {"warm_up": []}
    try:
        for step, length in enumerate(LENGTHS):
            if step == METERED:
                got["timed"] = scheduler._timed()
                with PeakMeter("cpu") as meter:  # the long bucket's plan, at its longest length
                    got["warm_up"].append(_step(runtime, model, step, length)["warm_up"])
                got["peak"] = meter.peak_bytes
            else:
                got["warm_up"].append(_step(runtime, model, step, length)["warm_up"])
        got["short"], got["long"] = scheduler.buckets[(B, 32)], scheduler.buckets[(B, 64)]
    finally:
        runtime.detach()
        mp.undo()
    return got


def test_a_later_bucket_is_profiled_on_one_microbatch_of_its_own(run):
    short, long = run["short"], run["long"]
    assert len(short.profiler.samples) == 3 and len(long.profiler.samples) == 1
    assert long.plan is not None and long.profile.key == (B, 64)
    # its bytes are its own: every unit's at least twice the short bucket's (MLPs are per
    # token; eager attention's scores grow like T^2)
    mine = {c.name: c for c in long.profile.units}
    for cost in short.profile.units:
        assert mine[cost.name].h_bytes >= 2 * cost.h_bytes > 0
    # the run's timed samples: the short bucket's 2nd and 3rd
    assert [n for n, _ in run["timed"]] == [B * 32, B * 32]


def test_times_are_the_runs_per_token_at_the_buckets_tokens():
    cost = UnitCost("layers.0.mlp", "mlp", 0, 1, recompute_s=9.0, pack_s=9.0, h_bytes=64)
    timed = [(100, [UnitCost("layers.0.mlp", "mlp", 0, 1, recompute_s=1.0, pack_s=0.1)]),
             (200, [UnitCost("layers.0.mlp", "mlp", 0, 1, recompute_s=3.0, pack_s=0.3)]),
             (400, [UnitCost("layers.0.mlp", "mlp", 0, 1, recompute_s=4.0, pack_s=0.2)])]
    (got,) = per_token_times([cost], timed, tokens=1000)
    assert got.recompute_s == pytest.approx(1000 * 0.01)  # median of 0.01, 0.015, 0.01
    assert got.pack_s == pytest.approx(1000 * 0.001)
    assert got.h_bytes == 64  # bytes are the bucket's own, never scaled


def test_a_later_bucket_plans_within_its_budget_at_its_longest_length(run):
    long = run["long"]
    assert long.budget_bytes is not None and any(a != "R" for a in long.plan.actions.values())
    assert run["peak"] <= long.budget_bytes


def test_leave_one_out_runs_once_per_run(run):
    short, long = run["short"], run["long"]
    assert short.validated and short.loo is None and short.loo_utilities is not None
    assert long.source == short.key and long.validated and long.loo_utilities == {}
    assert short.excluded <= long.excluded
    kept = {c.layer for c in short.profile.units if short.plan.actions[c.name] != "R"}
    variants = sum(w.get("leave-one-out", 0) for w in run["warm_up"][:9])
    assert variants == 3 + len(kept | short.excluded)  # the warm-up run, the plan, GC, a layer each
    assert sum(w.get("leave-one-out", 0) for w in run["warm_up"][9:]) == 3  # warm-up, plan, GC


def test_each_step_says_what_it_spent_on_learning(run):
    work = run["warm_up"]
    assert work[0]["profiling"] == 1 and work[0]["compile"] >= 0
    assert work[1] == work[2] == {"profiling": 1}
    assert work[3]["planning"] >= 1 and work[3]["leave-one-out"] == 1
    assert work[9] == {"profiling": 1}  # 4x64's own microbatch
    assert work[10]["planning"] >= 1 and work[10]["leave-one-out"] == 1
    assert not {"profiling", "leave-one-out", "calibration", "planning"} & set(work[13])


# ---- calibrated where cheap (NOTE [ Calibrated where cheap ] in ds_hilore/plan/calibrate.py) ---
@pytest.mark.parametrize("defer_at_most", [16, 1])
def test_calibration_waits_for_a_bucket_of_the_shortest_length(monkeypatch, defer_at_most):
    """4x32 is profiled on three microbatches and planned at the fourth, which calibrates; 4x64
    is profiled on its first and planned at its second, which puts its calibration off to the
    next 4x32 -- unless the deferrals one calibration allows are spent."""
    from ds_hilore.plan.calibrate import MatchedPasses

    equal_utilities(monkeypatch)
    monkeypatch.setattr(LeaveOneOut, "gc_not_slower", lambda self: False)
    monkeypatch.setattr(MatchedPasses, "DEFER_AT_MOST", defer_at_most)
    monkeypatch.setattr(MatchedPasses, "SETTLE", None)  # every calibration runs
    model = planner_model()
    runtime = ds_hilore.attach(model, dict(CONFIG, calibration_microbatches=2,
                                           plan_validation_microbatches=0))
    scheduler = runtime.policy
    lengths = (32, 32, 32, 32, 64, 64, 64, 32)
    calibrating, deferred = [], []
    try:
        for step, length in enumerate(lengths):
            if "calibration" in _step(runtime, model, step, length)["warm_up"]:
                calibrating.append(length)
            deferred.append(scheduler.passes.deferred)
        long = scheduler.buckets[(B, 64)]
    finally:
        runtime.detach()
    assert long.plan is not None and scheduler.calibrated == 2
    if defer_at_most == 16:
        assert calibrating == [32, 32] and deferred == [0, 0, 0, 0, 0, 1, 2, 0]
    else:  # one deferral, then the long bucket calibrates
        assert calibrating == [32, 64] and deferred == [0, 0, 0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("tolerance,settle,calibrations", [
    (0.9, 4.0, 2),  # the error budget is far from any plan: a sample of each kind, no more
    (0.9, None, 4),  # (hilore profile) every calibration asked for
])
def test_calibration_stops_where_no_sample_could_change_a_plan(monkeypatch, tolerance, settle,
                                                              calibrations):
    """NOTE [ Calibration that cannot change a plan ]: with four calibrations allowed, a run
    whose plan sits far under the error budget calibrates once per kind of unit (attention,
    MLP), then validates as after a full calibration; its plan is the one the knapsack chooses
    without any error budget."""
    from ds_hilore.plan.allocate import allocate
    from ds_hilore.plan.buckets import priced_rooms
    from ds_hilore.plan.calibrate import MatchedPasses

    equal_utilities(monkeypatch)
    monkeypatch.setattr(LeaveOneOut, "gc_not_slower", lambda self: False)
    monkeypatch.setattr(MatchedPasses, "SETTLE", settle)
    model = planner_model()
    runtime = ds_hilore.attach(model, dict(CONFIG, calibration_microbatches=4, grad_error_tolerance=tolerance,
                                           plan_validation_microbatches=0, validation_interval=1))
    scheduler = runtime.policy
    try:
        stats = [_step(runtime, model, step, 32) for step in range(10)]
        warm_up = [s["warm_up"] for s in stats]
        validated = [s["grad_error_measured"] is not None for s in stats]
        bucket = scheduler.buckets[(B, 32)]
        unbounded = allocate(bucket.profile, scheduler.risk, bucket.plan.headroom_bytes, float("inf"),
                             True, excluded=frozenset(bucket.excluded), byte_scale=bucket.byte_scale,
                             rooms=priced_rooms(bucket))
    finally:
        runtime.detach()
    assert scheduler.calibrated == calibrations
    assert sum("calibration" in w for w in warm_up) == calibrations
    assert sorted(scheduler.risk.samples) == sorted(
        ["attn:low", "mlp:low", "attn:high", "mlp:high"][:calibrations])
    assert any(validated[3 + calibrations:])  # validation follows the calibrations
    assert bucket.error_slack == (settle is not None)
    assert unbounded.actions == bucket.plan.actions


# ---- never slower than GC (NOTE [ Never slower than GC ] in ds_hilore/plan/validate.py) -------
def test_gc_is_timed_with_the_plan_and_wins_when_it_is_no_slower():
    loo = LeaveOneOut([0], repeats=2, gc=True)
    order = [loo.next_variant() for _ in range(7)]
    assert order == [LeaveOneOut.WARM_UP, None, LeaveOneOut.GC, 0, None, LeaveOneOut.GC, 0]
    seconds = {LeaveOneOut.WARM_UP: 9.0, None: 1.0, LeaveOneOut.GC: 1.1, 0: 1.2}
    for variant in order:
        loo.record(variant, seconds[variant])
    assert not loo.gc_not_slower() and loo.utilities() == pytest.approx({0: 0.2})  # GC: no layer
    loo.times[LeaveOneOut.GC] = [1.3, 1.0]  # as fast as the plan's fastest, slower in a round
    assert not loo.gc_not_slower()
    loo.times[LeaveOneOut.GC] = [0.9, 1.0]  # no slower in any round: GC
    assert loo.gc_not_slower()
    assert not LeaveOneOut([0], repeats=2).gc_not_slower()  # not timed: the plan holds


def _gc_grads(model, length: int, step: int) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(77)  # dropout
    _microbatch(model, step, length)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_bucket_no_faster_than_gc_runs_as_gc_with_gcs_gradients(monkeypatch):
    equal_utilities(monkeypatch)
    monkeypatch.setattr(LeaveOneOut, "gc_not_slower", lambda self: True)  # whatever was timed
    monkeypatch.setattr(LeaveOneOut, "dropped", lambda self: set())  # every layer pays
    model, reference = tiny_model("qwen2", layers=2, hidden=64, intermediate=128), \
        tiny_model("qwen2", layers=2, hidden=64, intermediate=128)
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runtime = ds_hilore.attach(model, dict(CONFIG, profile_microbatches=1))
    scheduler = runtime.policy
    try:
        step = 0
        while scheduler.buckets.get((B, 32)) is None or not scheduler.buckets[(B, 32)].validated:
            _gc_grads(model, 32, step)  # profiled, planned, leave-one-out with GC timed in it
            runtime.end_step()
            step += 1
            assert step < 12
        bucket = scheduler.buckets[(B, 32)]
        assert bucket.gc_faster and any(a != "R" for a in bucket.plan.actions.values())
        got, expected = _gc_grads(model, 32, 99), _gc_grads(reference, 32, 99)
        runtime.end_step()
        state = json.loads(json.dumps(runtime.state_dict()))  # a checkpoint's round trip
    finally:
        runtime.detach()
    assert sorted(got) == sorted(expected)
    assert [n for n in got if not torch.equal(got[n], expected[n])] == []
    last = runtime.stats["microbatches"][-1]
    assert last["actions"] == {"H": 0, "L": 0, "R": 4, "E": 0} and last["exact_zero_sequences"] == 0
    assert runtime.stats["warm_up"] == {}
    # resumed, the shape still runs as GC: nothing profiled or timed again, GC's gradients
    monkeypatch.undo()
    resumed = tiny_model("qwen2", layers=2, hidden=64, intermediate=128)
    runtime = ds_hilore.attach(resumed, dict(CONFIG, profile_microbatches=1))
    try:
        runtime.load_state_dict(state)
        bucket = runtime.policy.buckets[(B, 32)]
        assert bucket.gc_faster and bucket.validated and bucket.loo is None
        got = _gc_grads(resumed, 32, 99)
        runtime.end_step()
    finally:
        runtime.detach()
    assert [n for n in got if not torch.equal(got[n], expected[n])] == []
    assert runtime.stats["microbatches"][-1]["actions"] == {"H": 0, "L": 0, "R": 4, "E": 0}
    assert not {"profiling", "leave-one-out"} & set(runtime.stats["warm_up"])


@pytest.fixture(scope="module")
def gc_fallback():
    import os

    from tests.launch import run_distributed
    from tests.workers import gc_fallback_worker as worker

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load()  # built once here, not concurrently in two ranks
    cases = ["zero2:gc", "zero2:hilore", "zero2:predict", "zero3:gc", "zero3:hilore", "zero3:predict"]
    ranks = run_distributed(worker.__file__, [a for c in cases for a in ("--case", c)], timeout=420)
    for rank in ranks:
        for case in cases:
            if "error" in rank["cases"][case]:
                pytest.fail(f"rank {rank['rank']}, case {case} raised:\n"
                            f"{rank['cases'][case]['error']}", pytrace=False)
    return ranks


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_gc_wins_the_same_on_every_rank_and_trains_as_gc_bitwise(gc_fallback, stage):
    for rank in gc_fallback:
        got, ref = rank["cases"][f"{stage}:hilore"], rank["cases"][f"{stage}:gc"]
        assert got["gc_faster"] and got["kept"]  # rank 1 alone timed the plan faster
        assert got["as_gc"][-4:] == [True] * 4 and not any(got["as_gc"][:2])
        assert got["losses"] == ref["losses"]  # H and R are exact, and GC is GC
        assert got["param_sha"] == ref["param_sha"]
        # NOTE [ A steady step agrees nothing before its forwards ]: once the verdict holds
        # (step 5), the steps after it agree nothing before their forwards -- not under ZeRO-3
        assert got["steady"] == [False] * 5 + [stage == "zero2"] * 2, got["steady"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_bucket_run_as_gc_splits_rows_all_r_on_every_rank(gc_fallback, stage):
    """A prediction with a zero row on rank 0 alone, in a bucket that runs as GC: the ranks
    agree to split rows, rank 1 has none of its own to split, and every rank runs the split's
    plan all R (one with something kept on rank 1 alone gave its backward a check, and a
    collective, that rank 0 never made: gloo's "collective mismatch"). Exact: GC's losses and
    parameters, bitwise."""
    for rank in gc_fallback:
        got, ref = rank["cases"][f"{stage}:predict"], rank["cases"][f"{stage}:gc"]
        assert got["gc_faster"]
        # the rows split: not run as GC, all R -- under ZeRO-2 from step 7: step 6 is steady
        # (NOTE [ A steady step agrees nothing before its forwards ]), a prediction's rows are
        # agreed before the forward, so it runs as GC without it and the next step agrees
        split = [True] * 2 + [False] * 2 if stage == "zero2" else [False] * 4
        assert got["as_gc"][-4:] == split, got["as_gc"]
        assert got["steady"][-2:] == [stage == "zero2", False], got["steady"]
        assert got["losses"] == ref["losses"]
        assert got["param_sha"] == ref["param_sha"]


def test_a_verdict_for_gc_is_confirmed_by_as_many_rounds_again():
    """NOTE [ GC's verdict, confirmed ]: GC no slower in both rounds queues two more rounds of
    the plan against GC; a plan faster in one of them keeps the plan, GC no slower in all four
    sends the bucket to GC. Once: a second call queues nothing. The layers' verdicts come from
    the rounds their variants ran in: the plan's later runs (faster here) leave layer 0, which
    the first two rounds showed not to pay, dropped."""
    def timed(gc_seconds: list[float]) -> LeaveOneOut:
        loo = LeaveOneOut([0], repeats=2, gc=True)
        while not loo.done:
            variant = loo.next_variant()
            loo.record(variant, {LeaveOneOut.WARM_UP: 9.0, None: 1.0, 0: 0.99}.get(variant, 0.0)
                       if variant != LeaveOneOut.GC else gc_seconds.pop(0))
        return loo

    for later, verdict in (([1.1, 0.9], False), ([0.9, 0.95], True)):
        loo = timed([0.9, 1.0])
        assert loo.dropped() == {0}  # 0.01 s slower without it, in both rounds
        assert loo.gc_not_slower() and loo.confirm_gc(2) and not loo.done
        order = []
        while not loo.done:
            order.append(loo.next_variant())
            loo.record(order[-1], 0.95 if order[-1] is None else later[len(order) // 2 - 1])
        assert order == [None, LeaveOneOut.GC, None, LeaveOneOut.GC]
        assert loo.times[None] == [1.0, 1.0, 0.95, 0.95]
        assert loo.times[LeaveOneOut.GC] == [0.9, 1.0, *later]
        assert loo.gc_not_slower() == verdict and not loo.confirm_gc(2)
        assert loo.utilities() == pytest.approx({0: -0.01})  # the layers' verdict: their rounds
        assert loo.dropped() == {0}
    assert not timed([1.1, 1.1]).confirm_gc(0)  # no rounds asked: nothing queued
    assert not LeaveOneOut([0], repeats=2).confirm_gc(2)  # GC not timed: nothing to confirm
