"""A plan priced phase by phase (NOTE [ The backward's memory, layer by layer ] in
plan/profile.py, NOTE [ A plan priced phase by phase ] in plan/allocate.py): the tracker reads
GC's peak per phase, the profile keeps each phase's room under GC's peak (the least over its
microbatches and, agreed, over ranks), the allocator keeps the last layer's units whole beyond a
headroom that GC's peak plus every kept byte would refuse -- and the peak measured after every
op stays within the budget.

No timing enters an assertion: the profile's times are fixed (``equal_utilities``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ds_hilore
from ds_hilore.plan.allocate import allocate, layer_groups, peak_over_gc
from ds_hilore.plan.buckets import Bucket, priced_rooms
from ds_hilore.plan.metering import agree
from ds_hilore.plan.profile import BucketProfile, Profiler, UnitCost
from ds_hilore.plan.risk import RiskModel
from ds_hilore.runtime.memory import PeakMeter, PeakTracker
from models import VOCAB, equal_utilities, one_torch_thread, tiny_model

MiB = 2**20
LAYERS, B, T = 4, 8, 128
CONFIG = {"low_precision": "none", "profile_microbatches": 2, "calibration_microbatches": 0,
          "plan_validation_microbatches": 0}

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


# ---------------------------------------------------------------------------- the tracker

def test_the_tracker_reads_each_phase_s_peak():
    tracker = PeakTracker()
    assert tracker.open()
    try:
        t = torch.ones(16 * MiB // 4)
        del t
        tracker.enter_phase(3)
        u = torch.ones(4 * MiB // 4)
        del u
        tracker.enter_phase(2)
        v = torch.ones(8 * MiB // 4)
        del v
        peaks = dict(tracker.phase_peaks)
        start = tracker.start_bytes
    finally:
        tracker.close()
    assert set(peaks) == {None, 3, 2}
    assert 16 * MiB <= peaks[None] - start < 17 * MiB
    assert 4 * MiB <= peaks[3] - start < 5 * MiB
    assert 8 * MiB <= peaks[2] - start < 9 * MiB
    assert tracker.peak_bytes == max(peaks.values())


# ---------------------------------------------------------------------------- the profile

def _unit(layer: int, kind: str, h: int, l: int) -> UnitCost:  # noqa: E741
    return UnitCost(f"model.layers.{layer}.{kind}", kind, layer, 0 if kind == "attn" else 1,
                    recompute_s=1.0, h_bytes=h, l_bytes=l, rows=4, sliceable=True)


def _profile(rooms=(0, [])) -> BucketProfile:
    units = [_unit(k, kind, 10 * MiB, 3 * MiB) for k in range(3) for kind in ("attn", "mlp")]
    return BucketProfile((4, 64), units, gc_peak_bytes=100 * MiB, baseline_bytes=10 * MiB,
                         repeats=1, seconds=0.0, top_room_bytes=rooms[0],
                         layer_room_bytes=list(rooms[1]))


def test_rooms_are_the_least_over_the_samples_that_read_every_phase():
    profiler = Profiler((4, 64), 4)
    layers = {10: 0, 11: 1, 12: 2}  # layer index -> position

    def add(peak, phases):
        profiler.add(profiler.sample([], torch.device("cpu")), layers, peak, 0, 0, phases)

    add(100, {None: 70, 12: 100, 11: 90, 10: 80})
    add(95, {None: 80, 12: 95, 11: 85, 10: 75})
    add(90, {None: 90})  # its backward recomputed no layer: says nothing of them
    add(99, None)  # not tracked
    profile = profiler.result()
    assert profile.top_room_bytes == 15  # min(100 - 70, 95 - 80)
    assert profile.layer_room_bytes == [20, 10, 0]
    assert profile.rooms() == (15, [20, 10, 0])
    assert profile.gc_peak_bytes == 100
    # a profile without rooms (CUDA, an older state) is priced as before
    assert BucketProfile.from_dict({k: v for k, v in profile.to_dict().items()
                                    if "room" not in k}).rooms() is None
    assert BucketProfile.from_dict(profile.to_dict()).rooms() == (15, [20, 10, 0])
    profiler = Profiler((4, 64), 2)  # no sample read every phase: no rooms
    add(90, {None: 90})
    add(95, {None: 80, 12: 95, 11: 85})
    assert profiler.result().rooms() is None


class _TwoRanks:
    """A collective of two ranks: the other rank's numbers are ``other``'s."""

    def __init__(self, other: list[float]):
        self.other = other

    def all_reduce_max_float(self, values):
        return [max(a, b) for a, b in zip(values, self.other)]


def test_ranks_agree_on_the_least_room_of_each_phase():
    mine, theirs = _profile((30 * MiB, [5 * MiB, 0, 2 * MiB])), _profile((20 * MiB, [9 * MiB, 1, 0]))
    collect = []

    class Recording:
        def all_reduce_max_float(self, values):
            collect.append(list(values))
            return values

    agree(theirs, Recording())
    agreed = agree(mine, _TwoRanks(collect[0]))
    assert agreed.rooms() == (20 * MiB, [5 * MiB, 0, 0])
    # a rank that read no phase agrees on none
    collect.clear()
    agree(_profile(), Recording())
    assert agree(_profile((30 * MiB, [5 * MiB, 0, 2 * MiB])), _TwoRanks(collect[0])).rooms() is None


def test_a_bucket_priced_for_a_longer_length_has_no_rooms():
    bucket = Bucket((4, 64), Profiler((4, 64), 1), _profile((30 * MiB, [5 * MiB, 0, 2 * MiB])))
    bucket.byte_scale = {"attn": 1.0, "mlp": 1.0}
    assert priced_rooms(bucket) == (30 * MiB, [5 * MiB, 0, 2 * MiB])
    bucket.byte_scale = {"attn": 4.0, "mlp": 2.0}  # profiled at 32, the bucket holds 64
    assert priced_rooms(bucket) is None


# ---------------------------------------------------------------------------- the allocator

def test_the_last_layer_is_kept_whole_where_only_its_own_backward_would_pay_for_it():
    # three layers of two 10 MiB units; 15 MiB of headroom; GC peaks in the last layer's
    # backward, 25 MiB higher than before the layers' backward
    risk, profile = RiskModel(), _profile((25 * MiB, [6 * MiB, 3 * MiB, 0]))
    flat = allocate(profile, risk, 15 * MiB, 0.0, codec=False)
    assert flat.memory_bytes <= 15 * MiB and flat.peak_over_gc_bytes == flat.memory_bytes
    phased = allocate(profile, risk, 15 * MiB, 0.0, codec=False, rooms=profile.rooms())
    kept = {n for n, a in phased.actions.items() if a == "H"}
    assert {"model.layers.2.attn", "model.layers.2.mlp"} <= kept
    assert phased.memory_bytes > 15 * MiB >= phased.peak_over_gc_bytes
    assert phased.utility_s > flat.utility_s
    # the price: its highest phase -- everything kept less the room before the backward, or
    # the layers before a layer's backward plus its own packed bytes less that layer's room
    groups = layer_groups(profile, risk, False, 0.5)
    picked = [next(o for o in g if o.label.items() <= phased.actions.items()) for g in groups]
    before = [0, picked[0].memory, picked[0].memory + picked[1].memory]
    expect = max([phased.memory_bytes - 25 * MiB] + [b - r for b, r in zip(before, [6 * MiB, 3 * MiB, 0])])
    assert peak_over_gc(picked, profile.rooms()) == phased.peak_over_gc_bytes == expect


def test_a_packed_unit_pays_its_packed_copy_at_its_own_backward():
    # packed (L) units add their packed bytes at their own layer's backward, stored ones (H)
    # nothing; one layer, no room at its backward, 2 MiB of room before it: packing (3 MiB
    # kept) fits the total at 2 MiB of headroom but not its own backward; at 3 MiB it does
    unit = dataclasses.replace(_unit(0, "mlp", 10 * MiB, 3 * MiB), pack_s=0.01, unpack_s=0.01)
    profile = dataclasses.replace(_profile(), units=[unit], top_room_bytes=2 * MiB,
                                  layer_room_bytes=[0])
    groups = layer_groups(profile, RiskModel(), True, 0.5)
    own = {o.label[unit.name]: o.own_bytes for o in groups[0]}
    assert own["H"] == 0 and own["L"] == 3 * MiB and own["R"] == 0
    assert own["S"] == int(3 * MiB * 2 / 4)  # the packed half of its 4 sequences
    rooms = profile.rooms()
    assert allocate(profile, RiskModel(), 2 * MiB, 1.0, codec=True, rooms=rooms).actions == \
        {unit.name: "R"}
    plan = allocate(profile, RiskModel(), 3 * MiB, 1.0, codec=True, rooms=rooms)
    assert plan.actions == {unit.name: "L"} and plan.peak_over_gc_bytes == 3 * MiB
    # with room before the backward for all of it, H: nothing at its own backward
    plan = allocate(profile, RiskModel(), 2 * MiB, 1.0, codec=True, rooms=(8 * MiB, [0]))
    assert plan.actions == {unit.name: "H"} and plan.peak_over_gc_bytes == 2 * MiB


# ---------------------------------------------------------------------------- end to end

def _model():
    model = tiny_model("qwen2", layers=LAYERS, hidden=128, intermediate=512, heads=4,
                       dropout=False, seed=3)
    model.config._attn_implementation = "sdpa"
    return model


def _step(model, runtime, seed: int) -> int:
    """One microbatch's step, its whole-process peak read after every op."""
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    with PeakMeter("cpu") as meter:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        runtime.end_step()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


def test_a_plan_kept_beyond_gc_s_peak_plus_its_bytes_holds_the_budget(monkeypatch):
    equal_utilities(monkeypatch)  # H pays the same for every unit, whatever the load
    model = _model()
    # GC's phases first: one of them is GC's peak (here a layer's backward: a 128-token
    # vocabulary makes the loss small), the forward's end lower by about a layer's recompute
    probe = ds_hilore.attach(model, dict(CONFIG, memory_budget=1.01))
    try:
        for seed in range(3):  # two profiled microbatches, then the plan
            _step(model, probe, seed)
        profile = probe.policy.buckets[(B, T)].profile
    finally:
        probe.detach()
    top, layers = profile.rooms()
    assert len(layers) == LAYERS and top > 0 and min(layers) == 0 <= min(layers)
    last = sum(u.h_bytes for u in profile.units if u.layer == LAYERS - 1)
    # half the last layer's bytes of headroom: GC's peak plus every kept byte keeps it not
    budget = 1 + 0.5 * last / profile.gc_peak_bytes
    runtime = ds_hilore.attach(model, dict(CONFIG, memory_budget=budget))
    try:
        peaks = [_step(model, runtime, seed) for seed in range(6)]
        bucket = runtime.policy.buckets[(B, T)]
    finally:
        runtime.detach()
    plan = bucket.plan
    assert all(plan.actions[u.name] == "H" for u in bucket.profile.units if u.layer == LAYERS - 1), \
        plan.actions
    assert plan.memory_bytes > plan.headroom_bytes >= plan.peak_over_gc_bytes
    flat = allocate(bucket.profile, runtime.policy.risk, plan.headroom_bytes, 1.0, codec=False)
    assert flat.memory_bytes <= plan.headroom_bytes < plan.memory_bytes
    assert not bucket.overshot and bucket.headroom_cut == 0  # its check found the price held
    for k, peak in enumerate(peaks[2:]):  # the planned microbatches, the first one checked
        assert peak <= bucket.budget_bytes, (k, peak / bucket.budget_bytes)
