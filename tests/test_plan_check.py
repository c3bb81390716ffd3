"""The check of a plan's peak (NOTE [ The plan's peak, checked ] and NOTE [ Headroom a checked
plan left ] in plan/checks.py), on CPU with real models and op-level windows: a microbatch
run in part checks a plan without passing it, one that runs it whole passes it; a plan whose
price (GC's peak plus what it was priced to add) exceeds its peak well gives its bucket the excess (less two margins) as headroom; plans re-solved per microbatch
stay within the headroom without it.

No timing enters an assertion: the profile's times are fixed (``equal_utilities``)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import ds_hilore
from ds_hilore.config import HiLoReConfig
from models import VOCAB, equal_utilities, one_torch_thread, tiny_model

MiB = 2**20
B, T = 8, 128

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

CONFIG = {"low_precision": "none", "profile_microbatches": 2, "calibration_microbatches": 0,
          "plan_validation_microbatches": 0}


def _model():
    model = tiny_model("qwen2", layers=4, hidden=128, heads=4, intermediate=512, dropout=False,
                       vocab_size=VOCAB)
    model.config._attn_implementation = "sdpa"
    return model


def _microbatch(model, runtime, seed: int, kept=None) -> None:
    """One microbatch, its loss on the rows ``kept`` (all of them by default): the rows a
    prediction handed to ``expect`` names zero carry no loss, as the prediction says."""
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
    rows = torch.arange(B) if kept is None else torch.tensor(kept, dtype=torch.long)
    if len(rows):
        torch.nn.functional.cross_entropy(logits[rows].flatten(0, 1), ids[rows, 1:].flatten()).backward()
    else:
        (logits.sum() * 0).backward()
    model.zero_grad(set_to_none=True)
    runtime.end_step()


class _Recording:
    """One rank's collective that records what each plan's check reduces: (over the budget,
    partial, under the GC peak it was priced on, its peak less its price, in use at its start
    beyond the profile's baseline, its upper bound over the budget), in bytes."""

    def __init__(self):
        self.checks: list[list[float]] = []

    def all_reduce_max(self, values):
        return list(values)

    def all_reduce_max_float(self, values):
        if sys._getframe(1).f_code.co_name == "end_check":
            self.checks.append(list(values))
        return list(values)

    def all_reduce_sum(self, values):
        return list(values)

    def broadcast_object(self, obj):
        return obj


def test_a_plan_priced_well_above_its_peak_gives_the_excess_as_headroom(monkeypatch, caplog):
    """A profile whose units are priced at 4x the bytes they keep (as a price can be where the
    kept units replace GC's recompute of the last layers): the plan's check finds the price
    above the peak, and the headroom grows by that excess less two margins."""
    equal_utilities(monkeypatch)
    model = _model()
    runtime = ds_hilore.attach(model, dict(CONFIG, memory_budget=2.0))
    try:
        for seed in range(2):  # profiled
            _microbatch(model, runtime, seed)
        runtime.expect([0.0] * B)  # planned, run all R: nothing checked
        _microbatch(model, runtime, 2, kept=[])
        state = runtime.state_dict()
    finally:
        runtime.detach()
    for unit in state["policy"]["profiles"][0]["units"]:
        unit["h_bytes"] *= 4
    runtime = ds_hilore.attach(model, dict(CONFIG, memory_budget=2.0))
    collective = runtime.collective = _Recording()
    try:
        runtime.load_state_dict(state)  # planned at once, from the inflated profile
        bucket = runtime.policy.buckets[(B, T)]
        priced = bucket.plan
        with caplog.at_level(logging.INFO, logger="ds_hilore"):
            _microbatch(model, runtime, 3)  # the plan's first microbatch: checked
        assert len(collective.checks) == 1
        over, partial, under_gc, short, grown, bound = collective.checks[0]
        margin = max(MiB, bucket.budget_bytes // 100)
        excess = -short
        assert over < 0 and partial == 0 and under_gc <= 0 and excess >= 3 * margin, \
            collective.checks
        assert bucket.checked is priced and bucket.credits == 1
        assert bucket.headroom_credit == int(excess) - 2 * margin
        assert "under its price" in caplog.text
        # planned again with it: the headroom grew by the credit
        assert bucket.plan.headroom_bytes == priced.headroom_bytes + bucket.headroom_credit
        # a plan re-solved for the sequences a microbatch keeps is not checked on its own:
        # solved within the headroom without the credit
        policy = runtime.policy  # half the rows kept, as agreed with the bucket's key
        policy.rows_agreed = [0.0, float(B // 2), 1.0, 0.0] + policy.rows_agreed[4:]
        rows = policy._plan_for_rows(bucket, shared=True)
        assert rows is not bucket.plan
        assert rows.headroom_bytes == bucket.plan.headroom_bytes - bucket.headroom_credit
    finally:
        runtime.detach()


def test_a_microbatch_run_in_part_does_not_pass_the_plan(monkeypatch):
    equal_utilities(monkeypatch)
    model = _model()
    runtime = ds_hilore.attach(model, CONFIG)
    collective = runtime.collective = _Recording()
    policy = runtime.policy
    try:
        for seed in range(2):  # profiled
            _microbatch(model, runtime, seed)
        runtime.expect([1.0] * (B // 2) + [0.0] * (B // 2))  # planned, run in part: no credit
        _microbatch(model, runtime, 2, kept=range(B // 2))
        bucket = policy.buckets[(B, T)]
        assert bucket.headroom_credit == 0
        # an absolute budget with room for some units of the eight, not all (an all-H plan
        # stores every sequence whatever the prediction), planned again from the same profile
        policy.config = HiLoReConfig(**dict(CONFIG, memory_budget_bytes=bucket.profile.gc_peak_bytes
                                            + 6 * MiB))
        policy._plan_bucket(bucket, profiled=False)
        assert 0 < sorted(bucket.plan.actions.values()).count("H") < B, bucket.plan
        checks = len(collective.checks)
        runtime.expect([1.0] * (B // 2) + [0.0] * (B // 2))  # half kept: a plan re-solved,
        _microbatch(model, runtime, 3, kept=range(B // 2))  # measured (an overshoot would count), partial
        assert len(collective.checks) == checks + 1 and collective.checks[-1][1] == 1
        assert bucket.checked is not bucket.plan and policy.metering.awaits_check(bucket)
        plan = bucket.plan
        _microbatch(model, runtime, 4)  # no prediction: the plan itself, every sequence
        assert len(collective.checks) == checks + 2 and collective.checks[-1][1] == 0
        assert bucket.checked is plan  # (and planned again if it left room: a credit)
    finally:
        runtime.detach()


def _zero_rows_found_after_the_forward(model, runtime, seed: int, zero: int) -> None:
    """One microbatch whose first ``zero`` sequences have zero loss coefficients (A = 0),
    handed to HiLoRe with the loss (no prediction): found after the forward, and elided."""
    from ds_hilore.grpo import policy_loss

    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    advantages = torch.tensor([0.0] * zero + [1.0, -1.0] * ((B - zero) // 2))
    policy_loss(logp, logp.detach(), advantages, torch.ones_like(logp, dtype=torch.bool),
                loss_type="grpo", model=model).loss.backward()
    model.zero_grad(set_to_none=True)
    runtime.end_step()


def test_a_check_in_part_whose_bound_fits_is_not_repeated(monkeypatch):
    """Sequences found zero after the forward are elided from a plan that stores units whole:
    the check reads less than the plan keeps (partial), but every byte it did not keep was
    freed by a downgrade and is added to its later readings (NOTE [ A bound for a check in
    part ]), an upper bound of the plan's peak run whole. Where it fits the budget the plan is
    taken at its first check, without a credit; under a budget between the reading and the
    bound it is checked again. The budget a check compares with is set from the readings
    (malloc's are not the same on every machine), the rest is the real model's."""
    from ds_hilore.plan.checks import MAX_CREDITS, MAX_PARTIAL

    equal_utilities(monkeypatch)
    model = _model()
    runtime = ds_hilore.attach(model, CONFIG)
    collective = runtime.collective = _Recording()
    metering = runtime.policy.metering
    restored = []
    _recording_freed(monkeypatch, restored)
    try:
        for seed in range(2):  # profiled
            _microbatch(model, runtime, seed)
        runtime.expect([0.0] * B)  # planned, run all R: nothing checked
        _microbatch(model, runtime, 2, kept=[])
        bucket = runtime.policy.buckets[(B, T)]
        # planned again with room for some of the eight units, not all (what GC's peak holds
        # depends on the process: the same room whatever ran in it before)
        runtime.policy.config = HiLoReConfig(**dict(
            CONFIG, memory_budget=1 + 6 * MiB / bucket.profile.gc_peak_bytes))
        runtime.policy._plan_bucket(bucket, profiled=False)
        plan = bucket.plan
        assert "H" in plan.actions.values() and "R" in plan.actions.values(), plan
        assert metering.awaits_check(bucket)
        budget = bucket.budget_bytes + 64 * MiB  # room for the bound
        monkeypatch.setattr(metering, "budget_at", lambda b, length: budget)
        bucket.credits = MAX_CREDITS  # a whole check's room is not credited: the plan stays
        restored.clear()
        _zero_rows_found_after_the_forward(model, runtime, 3, zero=0)  # the plan run whole
        whole, partial, *_ = collective.checks[-1]
        assert partial == 0 and restored == [] and bucket.checked is bucket.plan
        # awaiting its check again (as a plan made again does): that step agrees, not steady
        # (NOTE [ A steady step agrees nothing before its forwards ] in plan/steady.py)
        bucket.checked = bucket.fit_actions = None
        runtime.policy.steady = False
        _zero_rows_found_after_the_forward(model, runtime, 3, zero=B // 2)
        over, partial, _, _, _, bound = collective.checks[-1]
        assert partial == 1 and sum(restored) > 0  # half the stored rows dropped
        assert over <= bound <= over + sum(restored) and bound <= 0, collective.checks[-1]
        # an upper bound of what the plan peaked at when run whole (the heap's readings of
        # the same work differ by some KiB)
        assert bound >= whole - MiB and over < whole, (whole, over, bound)
        # (planned again at the step's start with the same actions: memory that appeared
        # after profiling is charged then, NOTE [ Memory that appears after profiling ])
        assert bucket.checked is bucket.plan and bucket.fit_actions == plan.actions
        assert bucket.headroom_credit == 0 and bucket.plan.actions == plan.actions  # no credit
        assert bucket.key not in metering.partial_checks  # its earlier partial checks dropped
        # a budget between the reading and its bound: checked again, as any partial check
        bucket.checked = bucket.fit_actions = None
        runtime.policy.steady = False
        between = budget + int((over + bound) / 2)
        monkeypatch.setattr(metering, "budget_at", lambda b, length: between)
        for k in range(MAX_PARTIAL - 1):
            restored.clear()
            _zero_rows_found_after_the_forward(model, runtime, 4 + k, zero=B // 2)
            over, partial, _, _, _, bound = collective.checks[-1]
            assert partial == 1 and over < 0 < bound, collective.checks[-1]
            assert bucket.checked is None and metering.awaits_check(bucket), k
        assert metering.partial_checks[bucket.key][1] == MAX_PARTIAL - 1
    finally:
        runtime.detach()


def _recording_freed(monkeypatch, restored: list) -> None:
    """``FreedBytes.add`` also records the bytes it is told."""
    from ds_hilore.plan.checks import FreedBytes

    add = FreedBytes.add

    def recorded(self, unit, nbytes: int, stored=None) -> None:
        restored.append(nbytes)
        add(self, unit, nbytes, stored)
    monkeypatch.setattr(FreedBytes, "add", recorded)


def _microbatch_of(model, runtime, length: int, seed: int, transient: int = 0) -> None:
    """A microbatch of ``length`` positions; ``transient`` bytes more made after its forward
    and held to the end of its backward (what a plan's price does not see)."""
    ids = torch.randint(3, VOCAB, (B, length), generator=torch.Generator().manual_seed(seed))
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    transient = transient() if callable(transient) else transient  # read after the forward
    held = torch.ones(transient // 4) if transient else None
    loss.backward()
    del held, loss, logits
    model.zero_grad(set_to_none=True)
    runtime.end_step()


@pytest.mark.parametrize("transient", [False, True])
def test_a_plan_is_checked_at_a_microbatch_longer_than_every_profiled_one(monkeypatch, caplog,
                                                                          transient):
    """Profiled at 40 and 48 positions, the plan of the 64 bucket first runs at 64: it is
    checked there, against the budget priced at 64 (GC's peak grown per token): one that fits
    passes it, one that holds as much again as the whole budget, which the price does not see,
    is caught and its headroom cut (the budget is the process's: with the heap other tests
    left, a fixed size could fit in it)."""
    equal_utilities(monkeypatch)
    model = _model()
    runtime = ds_hilore.attach(model, dict(CONFIG, memory_budget=1.5))
    collective = runtime.collective = _Recording()
    try:
        for seed, length in enumerate((40, 48)):  # profiled
            _microbatch_of(model, runtime, length, seed)
        with caplog.at_level(logging.INFO, logger="ds_hilore"):
            held = (lambda: runtime.policy.buckets[(B, 64)].budget_bytes) if transient else 0
            _microbatch_of(model, runtime, 64, 2, transient=held)  # planned
        bucket = runtime.policy.buckets[(B, 64)]
        assert (bucket.shortest, bucket.longest) == (40, 48)
        assert len(collective.checks) == 1, "the plan's first microbatch was not checked"
        plan = bucket.checked
        assert plan is not None and any(a != "R" for a in plan.actions.values()), plan
        profile = bucket.profile
        grown = profile.baseline_bytes + (profile.gc_peak_bytes - profile.baseline_bytes) * 64 / 48
        budget_at = runtime.policy.metering.budget_at(bucket, 64)
        assert budget_at == int(bucket.budget_bytes * grown / profile.gc_peak_bytes) > \
            bucket.budget_bytes
        assert runtime.policy.metering.budget_at(bucket, 48) == bucket.budget_bytes
        over = collective.checks[0][0]
        if transient:
            assert over > 0 and bucket.overshot and bucket.headroom_cut == \
                int(over) + max(MiB, bucket.budget_bytes // 100)
            assert "peaked" in caplog.text and bucket.plan is not plan  # planned again
        else:
            assert over <= 0 and bucket.headroom_cut == 0 and bucket.fit_actions == plan.actions
    finally:
        runtime.detach()
