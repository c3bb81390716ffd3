"""A shape bucket: what the scheduler keeps per (sequences, length rounded up to a power of
two), and the prices its plan is made at, those of its longest length (NOTE [ Priced for the
bucket's longest ]).

Used by ``Scheduler`` (scheduler.py), which makes a bucket per shape and plans it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ds_hilore.plan.allocate import Plan
from ds_hilore.plan.profile import BucketProfile, Profiler
from ds_hilore.plan.validate import LeaveOneOut


@dataclasses.dataclass
class Bucket:
    key: tuple[int, int]
    profiler: Profiler
    profile: BucketProfile | None = None
    plan: Plan | None = None
    budget_bytes: int | None = None
    budget_bound: str | None = None  # which bound set it: the stated key, or "device" (budget.py)
    loo: LeaveOneOut | None = None  # NOTE [ Leave-one-out ], while it runs
    excluded: set[int] = dataclasses.field(default_factory=set)  # layers leave-one-out sent to R
    loo_utilities: dict[int, float] | None = None  # seconds per layer, measured jointly
    validated: bool = False  # leave-one-out ran to its end (here, or before a resume)
    shortest: int | None = None  # positions of the shortest profiled microbatch, over ranks
    longest: int | None = None  # ... of the longest (NOTE [ The plan's peak, checked ])
    byte_scale: dict[str, float] | None = None  # bytes x this per unit kind, for the longest
    # NOTE [ The plan's peak, checked ] and [ Headroom a checked plan left ] in checks.py
    headroom_cut: int = 0  # bytes taken off the headroom after a plan peaked over the budget
    headroom_credit: int = 0  # bytes added to it: what a checked plan peaked under its price
    priced_gc_peak: int | None = None  # GC's peak the plan was priced on (its plan's peak less kept)
    credits: int = 0  # how many times a credit was given
    overshot: bool = False  # a plan of this bucket peaked over the budget: no credit from then on
    checked: Plan | None = None  # the last plan whose peak was checked
    fit_actions: dict[str, str] | None = None  # of the last checked plan within the budget
    # the bucket whose profile this one's times were scaled from (NOTE [ A bucket learns from
    # the others ] in profile.py)
    source: tuple[int, int] | None = None
    loo_layers: bool = False  # its leave-one-out times layer variants (the run's one that does)
    gc_faster: bool = False  # timed no faster than GC itself (NOTE [ Never slower than GC ] in validate.py)
    # its plan is far enough under the error budget that calibration cannot change it (NOTE
    # [ Calibration that cannot change a plan ] in calibrate.py)
    error_slack: bool = False


# NOTE [ Priced for the bucket's longest ]
# A bucket holds every length in (L/2, L] (L a power of two), its profile comes from its first
# microbatches, and its plan runs on all of them: priced at the profiled lengths, a plan run at
# L keeps more than it was priced for (measured: 1.13x the budget, profiled at 66, run at 128).
# So bytes are priced for L, from the shortest profiled length T0 (over ranks and profiled
# microbatches, saved with the profile; a profile given without it, by a state of an earlier
# version or by hand, is taken as measured at L), r = L/T0:
# * a unit's saved bytes grow with T at most like its tensors do: an MLP is per token, its
#   tensors are (B, T, .) -- x r exactly; attention (and a whole-layer unit) may save (B, h, T,
#   T) scores -- x r^2 bounds it (its per-token tensors grow less). The profile's bytes are
#   medians over microbatches no shorter than T0, so they are at least the bytes at T0, and
#   the scaled price is at least what the plan keeps at any length of the bucket.
# * a relative budget (memory_budget x GC's peak) leaves headroom (m - 1) x GC's peak; GC's
#   peak only grows with T, so the profiled one is a lower bound of GC's at L and the
#   headroom priced from it never exceeds what the budget allows there: peak(T) <= GC(T) +
#   kept(T) <= GC(T) + (m - 1) GC(T0) <= m GC(T).
# * an absolute budget (bytes, a fraction of the device, or the device's own bound) must hold
#   GC's peak at L: it is bounded by the baseline (weights, optimizer state: no T) plus the
#   part above it x r^2 (every activation, logits included, grows at most like T^2; gradients
#   of the parameters do not grow at all, so this overestimates): safe, and exact at r = 1.
# Times are not scaled: they rank options, they do not bound anything.
def priced_for_longest(bucket: Bucket, relative: bool) -> tuple[dict[str, float], int]:
    """(bytes factor per unit kind, GC's peak to plan under) for the bucket's longest length."""
    profile, length = bucket.profile, bucket.key[1]
    shortest = bucket.shortest or length
    r = length / max(1, min(shortest, length))
    byte_scale = {c.kind: (r if c.kind == "mlp" else r * r) for c in profile.units}
    gc_peak = profile.gc_peak_bytes
    if not relative:
        above = max(0, gc_peak - profile.baseline_bytes)
        gc_peak = profile.baseline_bytes + math.ceil(above * r * r)
    return byte_scale, gc_peak


# NOTE [ GC's peak at another length ]
# A plan's check at a length T above the longest profiled one, T1, under a relative budget
# needs GC's peak at T (NOTE [ The plan's peak, checked ] in checks.py), which was not
# measured. What GC's peak holds above the baseline (in use before the forward) is mostly per
# token -- the layers' inputs it keeps, the layer it recomputes, the logits and their
# gradient -- so it is grown per token: baseline + (GC's peak - baseline) x T / T1. Above the
# truth by what does not grow (parameters' gradients made in the backward), below it by what
# grows faster (scores saved per query and key: eager attention). Measured on a 2-layer Llama
# (hidden 128, eager attention, B = 2) profiled at T1 = 300, GC's peak 17.7 MiB above the
# baseline: estimated 23.6 MiB above it at T = 400 (measured: 21.3), 30.2 at 512 (31.6). Growing
# the recomputed layer's attention by (T / T1)^2, as a plan's bytes are priced, read 25.6 and
# 35.6: an attention unit's bytes do not all grow that fast.
def gc_peak_at(profile: BucketProfile, r: float) -> float:
    """GC's peak at ``r`` times the longest profiled length, ``r`` >= 1 (NOTE [ GC's peak at
    another length ])."""
    above = max(0, profile.gc_peak_bytes - profile.baseline_bytes)
    return profile.baseline_bytes + above * r


def stretched(bucket: Bucket) -> bool:
    """The plan's bytes are priced for a length longer than the profiled one (NOTE [ Priced for
    the bucket's longest ])."""
    return any(v != 1.0 for v in (bucket.byte_scale or {}).values())


def priced_rooms(bucket: Bucket) -> tuple[int, list[int]] | None:
    """The rooms of GC's phases (NOTE [ The backward's memory, layer by layer ] in profile.py)
    the bucket's plan is priced with: its profile's, where the plan's bytes are priced at the
    profiled length; None (GC's peak plus every byte) where they are stretched to a longer one
    -- a room measured at T0 is no bound at L."""
    return None if stretched(bucket) else bucket.profile.rooms()


def kept_rows(profile: BucketProfile, kept: int, batch: int) -> BucketProfile:
    """``profile`` priced for ``kept`` of its ``batch`` sequences (NOTE [ Freed memory is
    spent ] in scheduler.py)."""
    units = []
    for cost in profile.units:
        if cost.sliceable and cost.rows == batch and kept < batch:
            k = kept / batch
            cost = dataclasses.replace(cost, h_bytes=math.ceil(cost.h_bytes * k),
                                       l_bytes=math.ceil(cost.l_bytes * k), pack_s=cost.pack_s * k,
                                       unpack_s=cost.unpack_s * k, rows=max(kept, 1))
        units.append(cost)
    return dataclasses.replace(profile, units=units)


def stores_all(bucket: Bucket) -> bool:
    """The bucket's plan keeps every unit whole (H): no memory is short
    (``Scheduler.keeps_whole``)."""
    return bucket.plan is not None and all(a == "H" for a in bucket.plan.actions.values())


def rounded_length(length: int) -> int:
    """A bucket's length: ``length`` rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, length))))


def input_shape(args, kwargs) -> tuple[int, int]:
    """(sequences, positions) of a forward's input ids or embeddings; (1, 1) when none."""
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if ids is None:
        ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return (ids.shape[0], ids.shape[1]) if ids is not None and ids.dim() >= 2 else (1, 1)
