"""The scheduler's CUDA memory meters, against a recording stand-in for CUDA's memory API.

No GPU is needed: ``torch.cuda``'s memory functions are replaced by ``_FakeCuda``, which keeps
the caching allocator's counters (allocated, reserved, their peaks, free device memory) and
records every call. What is asserted: the device's peak counters are never reset (other
readers keep their peaks, NOTE [ Shared peak counters ]), a window's peak is read as an offset
from the counter at its start, and the budget is clamped to what the device can give (NOTE
[ What the device can give ]). Inconsistent counters fail loudly.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import ds_hilore
from ds_hilore.config import HiLoReConfig
from ds_hilore.plan import budget as budgets
from ds_hilore.runtime.memory import DevicePeak
from models import tiny_model

CUDA = torch.device("cuda", 0)
MiB = 2**20


class _FakeCuda:
    """CUDA's caching-allocator counters for one device, and a log of the calls made."""

    def __init__(self, allocated: int, peak: int, reserved: int, total: int = 1000 * MiB):
        self.allocated, self.peak, self.reserved, self.reserved_peak = allocated, peak, reserved, reserved
        self.total, self.used_elsewhere = total, 100 * MiB  # context, NCCL, other processes
        self.calls: list[str] = []

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def install(self, monkeypatch) -> None:
        def reader(name, value):
            def read(device=None):
                self.calls.append(name)
                return value()
            monkeypatch.setattr(torch.cuda, name, read)
        reader("memory_allocated", lambda: self.allocated)
        reader("max_memory_allocated", lambda: self.peak)
        reader("memory_reserved", lambda: self.reserved)
        reader("max_memory_reserved", lambda: self.reserved_peak)
        reader("mem_get_info", lambda: (self.total - self.reserved - self.used_elsewhere, self.total))
        for name in ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
                     "reset_accumulated_memory_stats", "synchronize"):
            reader(name, lambda: None)

    def resets(self) -> list[str]:
        return [c for c in self.calls if c.startswith("reset")]


@pytest.fixture
def scheduler(monkeypatch):
    runtime = ds_hilore.attach(tiny_model("llama", layers=2, hidden=32, heads=4, intermediate=64),
                               {"codec_backend": "eager"})
    policy = runtime.policy
    monkeypatch.setattr(policy, "_device", lambda: CUDA)
    yield policy
    runtime.detach()


def test_profiled_peak_is_an_offset_and_no_peak_counter_is_reset(scheduler, monkeypatch):
    cuda = _FakeCuda(allocated=100 * MiB, peak=300 * MiB, reserved=320 * MiB)  # the user's peak: 300
    cuda.install(monkeypatch)
    scheduler.metering.open_profile()
    assert scheduler.metering.baseline == 100 * MiB and cuda.resets() == []
    cuda.alloc(400 * MiB)  # the profiled microbatch's peak: 500 MiB, above the earlier 300
    cuda.alloc(-400 * MiB)
    assert scheduler.metering.close_profile(sampled=120 * MiB) == 500 * MiB
    assert scheduler.step_stats["peak_exact"] is True
    assert scheduler.step_stats["peak_reserved_bytes"] == 500 * MiB
    assert torch.cuda.max_memory_allocated(CUDA) == 500 * MiB  # every other reader still sees it
    assert cuda.resets() == []


@pytest.mark.parametrize("key, value, expected_mib", [
    ("memory_budget", 1.1, 150),  # relative to GC: the lower bound (highest reading inside)
    ("memory_budget_bytes", 800 * MiB, 500),  # absolute: the upper bound (the earlier peak)
])
def test_a_window_under_an_earlier_peak_is_read_with_the_bound_its_budget_is_safe_with(
        scheduler, monkeypatch, caplog, key, value, expected_mib):
    scheduler.config = HiLoReConfig(**{key: value})
    cuda = _FakeCuda(allocated=100 * MiB, peak=500 * MiB, reserved=500 * MiB)
    cuda.install(monkeypatch)
    for _ in range(2):
        scheduler.metering.open_profile()
        cuda.alloc(100 * MiB)  # peaks at 200 MiB: under the earlier 500, the counter does not move
        cuda.alloc(-100 * MiB)
        with caplog.at_level("WARNING", logger="ds_hilore"):
            assert scheduler.metering.close_profile(sampled=150 * MiB) == expected_mib * MiB
    assert scheduler.step_stats["peak_exact"] is False
    assert cuda.resets() == []
    said = [r.getMessage() for r in caplog.records if "earlier, higher peak" in r.getMessage()]
    assert len(said) == 1  # once, naming the fix
    assert "a profiled microbatch" in said[0] and "500.0 MiB" in said[0] and \
        "150.0 MiB, a lower bound" in said[0] and "torch.cuda.reset_peak_memory_stats()" in said[0]


def test_the_step_peak_is_measured_from_the_steps_first_forward(scheduler, monkeypatch):
    cuda = _FakeCuda(allocated=100 * MiB, peak=900 * MiB, reserved=900 * MiB)  # an earlier step's peak
    cuda.install(monkeypatch)
    scheduler.steps = 7
    scheduler.metering.close_profile()  # begin_forward of the step's first microbatch
    cuda.alloc(50 * MiB)
    assert scheduler.metering.peak_now() == 150 * MiB  # not the 900 MiB of before the step
    cuda.alloc(850 * MiB)  # a new device peak inside the step: exact
    cuda.alloc(-850 * MiB)
    assert scheduler.metering.peak_now() == 1000 * MiB
    scheduler.steps = 8
    scheduler.metering.close_profile()
    assert scheduler.metering.peak_now() == 150 * MiB  # the next step starts its own window
    assert cuda.resets() == []


def test_a_reset_by_someone_else_inside_a_window_gives_a_peak_reached_inside_it(monkeypatch):
    cuda = _FakeCuda(allocated=100 * MiB, peak=900 * MiB, reserved=900 * MiB)
    cuda.install(monkeypatch)
    window = DevicePeak(CUDA)
    cuda.alloc(300 * MiB)
    cuda.peak = cuda.allocated  # the training script resets the counter at 400 MiB
    cuda.alloc(-200 * MiB)
    assert window.close() == 400 * MiB and window.exact is False and window.upper == 900 * MiB


def test_counters_that_contradict_the_allocator_fail_loudly(monkeypatch):
    cuda = _FakeCuda(allocated=600 * MiB, peak=500 * MiB, reserved=700 * MiB)  # allocated > peak
    cuda.install(monkeypatch)
    with pytest.raises(AssertionError, match="bug in ds_hilore"):
        DevicePeak(CUDA)


@pytest.mark.parametrize("key, value, expected, bound", [
    ("memory_fraction", 0.9, 1000 - 700 - 100 + 700 - 50, "device"),  # free + reserved - 5 %
    ("memory_budget_bytes", 600 * MiB, 600, "hilore.memory_budget_bytes = 629145600"),
    ("memory_budget", 4.0, 850, "device"),  # 4 x 300 MiB would be more than the device has
])
def test_the_budget_is_clamped_to_what_the_device_can_give(monkeypatch, key, value, expected, bound):
    cuda = _FakeCuda(allocated=200 * MiB, peak=300 * MiB, reserved=700 * MiB)
    cuda.install(monkeypatch)
    assert budgets.budget_bytes(HiLoReConfig(**{key: value}), 300 * MiB, CUDA) == expected * MiB
    got = budgets.budget_and_bound(HiLoReConfig(**{key: value}), 300 * MiB, CUDA)
    assert got == (expected * MiB, bound)



@pytest.mark.parametrize("earlier_mib, cut_mib", [
    (500, 60 + 6),  # a new device peak, 660 MiB: exact, 60 over the budget, plus 1% of it
    (900, 0),  # under an earlier peak: only its lower bound is known, no re-plan for it
])
def test_the_plans_peak_is_checked_as_an_offset_and_over_the_budget_lowers_the_headroom(
        scheduler, monkeypatch, caplog, earlier_mib, cut_mib):
    from ds_hilore.plan.allocate import Plan
    from ds_hilore.plan.profile import Profiler
    from ds_hilore.plan.scheduler import Bucket

    scheduler.config = HiLoReConfig(memory_budget_bytes=600 * MiB)
    plan = Plan({"u": "H"}, 50 * MiB, 1.0, 0.0, 80 * MiB, 0.0)
    bucket = Bucket((2, 8), Profiler((2, 8), 1), plan=plan, budget_bytes=600 * MiB)
    planned = []
    monkeypatch.setattr(scheduler, "_plan_bucket", lambda b, profiled=True: planned.append(profiled))
    cuda = _FakeCuda(allocated=100 * MiB, peak=earlier_mib * MiB, reserved=earlier_mib * MiB)
    cuda.install(monkeypatch)
    scheduler.metering.open_check(bucket, 8, "whole")
    check = scheduler.metering.check
    cuda.alloc(560 * MiB)  # the plan's microbatch peaks at 660 MiB
    cuda.alloc(-560 * MiB)
    with caplog.at_level("WARNING", logger="ds_hilore"):
        scheduler.metering.end_check(check)
    assert bucket.checked is plan and scheduler.metering.check is None and cuda.resets() == []
    assert bucket.headroom_cut == cut_mib * MiB
    said = [r.getMessage() for r in caplog.records if "earlier, higher peak" in r.getMessage()]
    assert len(said) == (0 if cut_mib else 1)  # unseen overshoot: said, with the fix
    assert all("the check of the plan for 2x8" in m for m in said)
    assert scheduler.step_stats.get("peak_exact", True) is bool(cut_mib)
    assert planned == ([False] if cut_mib else [])
    scheduler.metering.open_check(bucket, 8, "whole")  # this plan was checked: not again
    assert scheduler.metering.check is None


def _checked(scheduler, bucket, cuda, peak_mib: int, partial: bool = False, length: int = 8) -> None:
    """One check of ``bucket.plan`` whose microbatch (``length`` positions) peaks at
    ``peak_mib`` (a new device peak: an exact window)."""
    scheduler.metering.open_check(bucket, length, "whole")
    check = scheduler.metering.check
    assert check is not None
    if partial:
        scheduler.metering.partial()
    rise = peak_mib * MiB - cuda.allocated
    cuda.alloc(rise)
    cuda.alloc(-rise)
    scheduler.metering.end_check(check)


@pytest.fixture
def credited(scheduler, monkeypatch):
    """A bucket under a 600 MiB absolute budget, its plans priced on a GC peak of 350 MiB; the
    first keeps 200 MiB, every re-plan keeps 200 MiB plus the credit (a new plan each time)."""
    from ds_hilore.plan.allocate import Plan
    from ds_hilore.plan.profile import Profiler
    from ds_hilore.plan.scheduler import Bucket

    scheduler.config = HiLoReConfig(memory_budget_bytes=600 * MiB)
    bucket = Bucket((2, 8), Profiler((2, 8), 1), budget_bytes=600 * MiB, priced_gc_peak=350 * MiB,
                    plan=Plan({"u": "H"}, 200 * MiB, 1.0, 0.0, 250 * MiB, 0.0))
    planned = []

    def plan_again(b, profiled=True):
        planned.append(b.headroom_credit - b.headroom_cut)
        b.plan = Plan({"u": "H", f"v{len(planned)}": "H"}, 200 * MiB + b.headroom_credit, 1.0,
                      0.0, 250 * MiB + planned[-1], 0.0)

    monkeypatch.setattr(scheduler, "_plan_bucket", plan_again)
    cuda = _FakeCuda(allocated=100 * MiB, peak=100 * MiB, reserved=100 * MiB)
    cuda.install(monkeypatch)
    return bucket, planned, cuda


def test_a_plan_priced_above_its_peak_raises_the_headroom_at_most_twice(scheduler, credited):
    bucket, planned, cuda = credited
    margin = 6 * MiB  # 1 % of the budget
    _checked(scheduler, bucket, cuda, 400)  # priced at 550: the excess less 2 margins
    assert bucket.headroom_credit == 150 * MiB - 2 * margin and planned == [138 * MiB]
    _checked(scheduler, bucket, cuda, 500)  # the new plan, priced at 688: a larger credit
    assert bucket.headroom_credit == 188 * MiB - 2 * margin and bucket.credits == 2
    _checked(scheduler, bucket, cuda, 450)  # no third
    assert bucket.headroom_credit == 176 * MiB and len(planned) == 2
    assert bucket.fit_actions == bucket.plan.actions  # it fits: not checked again


def test_no_credit_after_an_overshoot_nor_for_a_small_excess(scheduler, credited):
    bucket, planned, cuda = credited
    _checked(scheduler, bucket, cuda, 540)  # 10 MiB under its price: less than 3 margins
    assert bucket.headroom_credit == 0 and planned == [] and bucket.checked is bucket.plan
    bucket.plan = dataclasses.replace(bucket.plan, actions={"w": "H"})  # a plan not checked yet
    _checked(scheduler, bucket, cuda, 620)  # over: cut by 20 + a margin
    assert bucket.headroom_cut == 26 * MiB and bucket.overshot and planned == [-26 * MiB]
    _checked(scheduler, bucket, cuda, 400)  # far under, but the bucket overshot once
    assert bucket.headroom_credit == 0 and len(planned) == 1


def test_no_credit_where_the_check_does_not_bound_the_plan(scheduler, credited):
    bucket, planned, cuda = credited
    bucket.byte_scale = {"mlp": 2.0, "attn": 4.0}  # priced for twice the profiled length
    _checked(scheduler, bucket, cuda, 400)
    assert bucket.headroom_credit == 0 and planned == [] and bucket.checked is bucket.plan
    bucket.byte_scale = None
    bucket.plan = dataclasses.replace(bucket.plan, actions={"w": "H"})
    cuda.peak = 900 * MiB  # an earlier, higher peak: the window is not exact
    _checked(scheduler, bucket, cuda, 400)
    assert bucket.headroom_credit == 0 and planned == [] and bucket.checked is bucket.plan
    cuda.peak = cuda.allocated
    bucket.plan = dataclasses.replace(bucket.plan, actions={"x": "H"})
    _checked(scheduler, bucket, cuda, 340)  # under GC's own profiled peak (350 MiB)
    assert bucket.headroom_credit == 0 and planned == [] and bucket.checked is bucket.plan
    bucket.plan = dataclasses.replace(bucket.plan, actions={"y": "H"})
    _checked(scheduler, bucket, cuda, 400, length=6)  # shorter than the bucket's 8: peaks lower
    assert bucket.headroom_credit == 0 and planned == [] and bucket.checked is bucket.plan


def test_a_credited_plan_that_never_runs_whole_loses_the_credit(scheduler, credited):
    from ds_hilore.plan.metering import MAX_PARTIAL

    bucket, planned, cuda = credited
    _checked(scheduler, bucket, cuda, 400)  # a credit of 138 MiB: the new plan keeps 338 MiB
    assert bucket.headroom_credit == 138 * MiB and planned == [138 * MiB]
    for _ in range(MAX_PARTIAL):  # it keeps more than the 250 MiB without the credit
        _checked(scheduler, bucket, cuda, 500, partial=True)
    assert bucket.headroom_credit == 0 and planned == [138 * MiB, 0]  # planned again without it
    assert bucket.credits == 2 and bucket.checked is not bucket.plan  # no credit again


def test_a_microbatch_run_all_r_checks_nothing(scheduler, credited):
    bucket, planned, cuda = credited
    scheduler.metering.open_check(bucket, 8, "nothing")  # e.g. every sequence predicted zero
    assert scheduler.metering.check is None and scheduler.metering.awaits_check(bucket)


def test_a_partial_check_is_repeated_and_gives_no_credit(scheduler, credited):
    from ds_hilore.plan.metering import MAX_PARTIAL

    bucket, planned, cuda = credited
    for k in range(MAX_PARTIAL - 1):  # kept less than its plan: the plan is checked again
        _checked(scheduler, bucket, cuda, 400, partial=True)
        assert bucket.checked is None and scheduler.metering.awaits_check(bucket), k
    _checked(scheduler, bucket, cuda, 400, partial=True)  # the last: taken as fitting
    assert bucket.checked is bucket.plan and bucket.fit_actions == bucket.plan.actions
    assert bucket.headroom_credit == 0 and planned == []
    bucket.plan = dataclasses.replace(bucket.plan, actions={"w": "H"})
    _checked(scheduler, bucket, cuda, 640, partial=True)  # a partial overshoot still cuts
    assert bucket.headroom_cut == 46 * MiB and planned == [-46 * MiB]


def test_a_plan_checked_only_in_part_keeps_a_margin_under_the_budget(scheduler, credited, caplog):
    from ds_hilore.plan.metering import MAX_PARTIAL

    caplog.set_level(logging.INFO, logger="ds_hilore")
    bucket, planned, cuda = credited  # 600 MiB budget, a margin of 6 MiB
    bucket.plan = dataclasses.replace(bucket.plan, headroom_bytes=210 * MiB)  # 10 MiB of slack
    first = bucket.plan
    readings = [590, 597, 580]  # partial checks; the highest 3 MiB under the budget
    for k, peak in enumerate(readings):
        cuda.peak = cuda.allocated  # each window exact
        _checked(scheduler, bucket, cuda, peak, partial=True)
        assert (bucket.checked is None) is (k < MAX_PARTIAL - 1), k
    # not taken as fitting: planned again with its price 3 + 10 MiB lower (the reading a
    # margin under, the slack gone)
    assert bucket.fit_actions != first.actions and bucket.overshot and bucket.credits == 0
    assert bucket.headroom_cut == (-3 + 6 + 10) * MiB and planned == [-13 * MiB]
    assert bucket.key not in scheduler.metering.partial_checks  # the new plan's count afresh
    assert any("checked only on microbatches that kept less" in r.getMessage() for r in caplog.records)
    assert scheduler.metering.awaits_check(bucket)  # the new plan is checked in turn
    for _ in range(MAX_PARTIAL):  # readings a margin under: taken as fitting
        cuda.peak = cuda.allocated
        _checked(scheduler, bucket, cuda, 593, partial=True)
    assert bucket.checked is bucket.plan and bucket.fit_actions == bucket.plan.actions
    assert len(planned) == 1


def _grown(scheduler, monkeypatch, config: dict, headroom_mib: int):
    """A 2x8 bucket under a 600 MiB budget (``config``), profiled at a 100 MiB baseline and a
    300 MiB GC peak, its plan keeping 250 MiB within ``headroom_mib``; each re-plan recorded as
    (baseline, GC peak); the device holds 180 MiB: 80 more than the baseline.
    Returns (profile, plan, bucket, planned, cuda)."""
    from ds_hilore.plan.allocate import Plan
    from ds_hilore.plan.profile import BucketProfile, Profiler
    from ds_hilore.plan.scheduler import Bucket

    scheduler.config = HiLoReConfig(**config)
    profile = BucketProfile((2, 8), [], gc_peak_bytes=300 * MiB, baseline_bytes=100 * MiB,
                            repeats=1, seconds=0.0)
    plan = Plan({"u": "H"}, 250 * MiB, 1.0, 0.0, headroom_mib * MiB, 0.0)
    bucket = Bucket((2, 8), Profiler((2, 8), 1), profile, plan=plan, budget_bytes=600 * MiB,
                    priced_gc_peak=300 * MiB)
    planned = []
    monkeypatch.setattr(scheduler, "_plan_bucket", lambda b, profiled=True: planned.append(
        (b.profile.baseline_bytes, b.profile.gc_peak_bytes)))
    cuda = _FakeCuda(allocated=180 * MiB, peak=180 * MiB, reserved=180 * MiB)
    cuda.install(monkeypatch)
    return profile, plan, bucket, planned, cuda


@pytest.mark.parametrize("relative", [True, False], ids=["relative", "absolute"])
def test_memory_the_process_grew_by_before_a_check_is_no_overshoot_of_the_plan(
        scheduler, monkeypatch, caplog, relative):
    """NOTE [ Growth that is not the plan's ]: the check's microbatch starts with 80 MiB more in
    use than the profile's baseline (caches the process grew by since) and peaks 40 MiB over
    the budget: 40 under it without that growth, so no cut and no overshoot; under an absolute
    budget the growth is charged to the bucket, which is planned again."""
    config = {"memory_budget": 2.0} if relative else {"memory_budget_bytes": 600 * MiB}
    profile, plan, bucket, planned, cuda = _grown(scheduler, monkeypatch, config, 300)
    with caplog.at_level("INFO", logger="ds_hilore"):
        _checked(scheduler, bucket, cuda, 640)
    assert bucket.checked is plan and bucket.headroom_cut == 0 and not bucket.overshot
    if relative:  # GC's own peak would hold it too: nothing to charge
        assert planned == [] and bucket.fit_actions == plan.actions
        assert (profile.baseline_bytes, profile.gc_peak_bytes) == (100 * MiB, 300 * MiB)
    else:  # memory the budget no longer has: charged, planned again, the new plan checked
        assert planned == [(180 * MiB, 380 * MiB)] and bucket.fit_actions is None
        assert "80.0 MiB in use appeared after 2x8 was profiled" in caplog.text
    assert "over the memory budget" not in caplog.text


def test_a_plan_checked_only_in_part_near_the_budget_has_its_growth_charged(
        scheduler, monkeypatch, caplog):
    """NOTE [ A plan checked only in part ] with NOTE [ Growth that is not the plan's ]: under an
    absolute budget, partial checks that start 80 MiB above the profile's baseline and, without
    that growth, peak 3 MiB under the budget both keep the margin (the headroom cut) and charge
    the growth (the bucket's baseline and GC's peak raised) before the bucket is planned again."""
    from ds_hilore.plan.metering import MAX_PARTIAL

    config = {"memory_budget_bytes": 600 * MiB}
    _, _, bucket, planned, cuda = _grown(scheduler, monkeypatch, config, 260)  # 10 MiB of slack
    with caplog.at_level("INFO", logger="ds_hilore"):
        for _ in range(MAX_PARTIAL):
            cuda.peak = cuda.allocated
            _checked(scheduler, bucket, cuda, 677, partial=True)
    assert bucket.headroom_cut == (-3 + 6 + 10) * MiB and bucket.overshot
    assert planned == [(180 * MiB, 380 * MiB)] and bucket.fit_actions is None
    assert "80.0 MiB in use appeared after 2x8 was profiled" in caplog.text
    assert "checked only on microbatches that kept less" in caplog.text
    assert bucket.key not in scheduler.metering.partial_checks  # the next plan's count afresh
