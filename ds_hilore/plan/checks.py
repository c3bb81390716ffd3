"""A plan's peak, checked: the part of the scheduler's ``Metering`` (metering.py) that measures
the first microbatch running a bucket's plan against the budget, and corrects the bucket's
headroom by what it finds (NOTE [ The plan's peak, checked ], NOTE [ Headroom a checked plan
left ], NOTE [ Growth that is not the plan's ]). Its state lives on the metering.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ds_hilore.plan.buckets import gc_peak_at, stretched
from ds_hilore.runtime.memory import DevicePeak, PeakTracker, in_use_bytes

__all__ = ["MAX_CREDITS", "MAX_PARTIAL", "FreedBytes", "PlanChecks", "gradient_bytes"]

logger = logging.getLogger("ds_hilore")

MAX_CREDITS = 2  # NOTE [ Headroom a checked plan left ]
MAX_PARTIAL = 3  # NOTE [ The plan's peak, checked ]
_NEVER = 1e30  # a check's bound where it has none (finite: it goes through an all-reduce)


class PlanChecks:
    """The checks of ``Metering`` (metering.py): ``open_check`` at a planned microbatch's
    forward, ``end_check`` when its backward ends."""

    # NOTE [ The plan's peak, checked ]
    # A plan is priced from the profile: GC's peak plus what it keeps (at its highest phase
    # where the profile read GC's phases, NOTE [ A plan priced phase by phase ] in allocate.py).
    # What it really peaks at can still differ (the allocator's rounding and fragmentation, a
    # transient the profile's units do not own, a peak of the loss between units). So the
    # first microbatch that runs a bucket's plan (a leave-one-out's warm-up variant: the plan
    # itself; not a microbatch
    # predicted zero and run all R: measured there, a plan's check read GC's peak, or less, and
    # passed every plan, 48-65 MiB under a 1.10 budget on ``hilore bench --model paper-cpu``) is
    # measured as the profile's GC peak was, from its forward to the end of its backward: a
    # ``DevicePeak`` window on CUDA (its lower bound when not exact: a check must not re-plan
    # for another reader's peak), an op-level ``PeakTracker`` window on CPU (NOTE [ Tracked on
    # CPU ] in metering.py; one that cannot open on a rank, e.g. inside a compiled call, opens
    # on none: the check ends in a collective). If it exceeds the bucket's budget, the bucket's
    # headroom is lowered by the overshoot plus a margin (1% of the budget, at least 1 MiB) and
    # the bucket is planned again; the overshoot is the max over ranks, so every rank re-plans the same.
    # Each plan of a bucket is checked once, and a plan that only repeats the actions of one
    # checked within the budget (a replan after calibration changed the risks, not the choice)
    # is not checked again; the plans re-solved per microbatch (``_plan_for_rows``) live within
    # the same, corrected headroom and are not checked on their own. A checked microbatch that
    # kept less than its plan -- a plan re-solved for the sequences it keeps (those predicted
    # zero elided), units sent to R by the risk fit after its forward, sequences whose
    # coefficients came out zero (``partial``, any rank) -- can show an overshoot, not that the
    # plan fits: the plan is checked again at a later microbatch, and taken as fitting after
    # MAX_PARTIAL such checks (an op-level window costs a dispatch per op; where microbatches
    # keep less than their plan, what such a check measured is what runs), without a credit
    # (NOTE [ Headroom a checked plan left ]), and only where its readings left a margin under
    # the budget (NOTE [ A plan checked only in part ]).
    # A plan is checked on the microbatches it meets, whatever their length, each rank's peak
    # against the budget priced at its own microbatch's length T (``budget_at``). An absolute
    # budget holds at any T. A relative one (m x GC's peak) allows m x GC(T) at T (NOTE
    # [ Priced for the bucket's longest ]): up to the longest profiled length T1 (over ranks and
    # profiled microbatches) GC's peak is at most the profiled one, the max over them, and the
    # budget's bytes hold; above it GC(T) was not measured and is estimated from the profile
    # (``gc_peak_at`` in buckets.py, NOTE [ GC's peak at another length ] there).
    # Waiting instead for a microbatch no longer than the shortest profiled one leaves plans
    # unchecked: with GRPO's varied lengths, and more so over several ranks, hardly any comes
    # (profiled at 260 and 300 tokens, none of twelve microbatches of 301-512 was).
    def open_check(self, bucket, length: int, ran: str) -> None:
        """``length``: the microbatch's, the max over ranks; ``ran``: what it runs of the plan
        (``Scheduler._apply``: whole, part or nothing; nothing, all R, is the same on every
        rank, so the check, which ends in a collective, opens on every rank or on none)."""
        if not self.awaits_check(bucket) or ran == "nothing":
            return
        device = self.s._device()
        opened = device.type == "cuda" or self._track()
        collective = self.s.runtime.collective
        if collective is not None:  # a window that cannot open on one rank opens on none
            opened = not collective.all_reduce_max_float([0.0 if opened else 1.0])[0]
        if not opened:
            self.close_tracker()
            return
        self.check_partial, self.check_length = ran != "whole", length
        self.check_whole = ran == "whole"  # NOTE [ A bound for a check in part ]
        self.check_budget = self.budget_at(bucket, self.s.length_here)
        # NOTE [ Growth that is not the plan's ]
        self.check_base = in_use_bytes(device) - gradient_bytes(self.s.runtime.model, device)
        self.s.warm_up("check")
        self.check = (bucket, bucket.plan,
                      DevicePeak(device) if device.type == "cuda" else self.tracker)

    def budget_at(self, bucket, length: int) -> int:
        """The budget a microbatch of ``length`` positions (this rank's) is checked against
        (NOTE [ The plan's peak, checked ])."""
        profile = bucket.profile
        profiled = bucket.longest or bucket.shortest or bucket.key[1]  # a state without it
        if not self._relative(bucket) or profile is None or length <= profiled or profile.gc_peak_bytes <= 0:
            return bucket.budget_bytes
        return int(bucket.budget_bytes * gc_peak_at(profile, length / profiled)
                   / profile.gc_peak_bytes)

    def _relative(self, bucket) -> bool:
        """The bucket's budget is a multiple of GC's peak (not bytes, nor the device's bound)."""
        config = self.s.config
        return bucket.budget_bound != "device" and config.memory_budget_bytes is None and \
            config.memory_fraction is None

    def freed_bytes(self) -> "FreedBytes | None":
        """What a microbatch tells the bytes its downgrades free and what its backward
        unpacks, where its plan's peak is checked op by op (None otherwise): they count in the
        check's upper bound (NOTE [ A bound for a check in part ])."""
        check = self.check
        if check is None or not isinstance(check[2], PeakTracker):
            return None
        return FreedBytes(self, check)

    def partial(self) -> None:
        """The microbatch being checked keeps less than its plan: units sent to R after its
        forward, sequences found zero (NOTE [ The plan's peak, checked ])."""
        self.check_partial = True

    def awaits_check(self, bucket) -> bool:
        """The bucket's plan is still to be checked (NOTE [ The plan's peak, checked ])."""
        return bucket.plan is not None and bucket.checked is not bucket.plan and \
            bucket.budget_bytes is not None and bucket.fit_actions != bucket.plan.actions and \
            any(a != "R" for a in bucket.plan.actions.values())

    def drop_check(self) -> None:
        """An open check whose backward never came (a forward without one): not checked."""
        if self.check is not None:
            meter, self.check = self.check[2], None
            if isinstance(meter, DevicePeak):
                meter.close()

    def end_check(self, check) -> None:
        if self.check is not check:
            return
        self.check = None
        bucket, plan, meter = check
        values = self._measured(bucket, plan, meter)
        collective = self.s.runtime.collective
        if collective is not None:
            values = collective.all_reduce_max_float(values)
        over, partial, under_gc, short, grown, bound = values
        bounded = partial and over <= 0 and bound <= 0  # NOTE [ A bound for a check in part ]
        if bounded:  # taken as a whole check: earlier partial ones of the plan no longer count
            partial = False
            self.partial_checks.pop(bucket.key, None)
        if over <= 0 and partial:  # checked again at a whole one, up to MAX_PARTIAL times
            seen, count, highest = self.partial_checks.get(bucket.key, (None, 0, -math.inf))
            if seen != plan.actions:
                count, highest = 0, -math.inf
            count, highest = count + 1, max(highest, over)
            self.partial_checks[bucket.key] = (dict(plan.actions), count, highest)
            if count < MAX_PARTIAL:
                return
            if plan is bucket.plan and self._revoke(bucket):
                return
            over = highest
        margin = max(2**20, bucket.budget_bytes // 100)
        near = partial and -margin < over <= 0  # NOTE [ A plan checked only in part ]
        bucket.checked = plan
        if over <= 0 and not near:
            bucket.fit_actions = dict(plan.actions)
        if plan is not bucket.plan:
            return
        charged = grown > margin and not self._relative(bucket)  # NOTE [ Growth that is not
        if near:  # the plan's ]
            self._keep_margin(bucket, plan, over, margin)
        elif over <= 0 and not charged:
            if not partial and not bounded and under_gc <= 0 and \
                    self.check_length == bucket.key[1] and bucket.loo is None:
                self._credit(bucket, -short, margin)
            return
        if over > 0:
            cut = int(over) + margin
            logger.info("ds_hilore: the plan for %dx%d peaked %.1f MiB over the memory budget "
                        "(%.1f MiB); its headroom is lowered by %.1f MiB and it is planned again",
                        *bucket.key, over / 2**20, bucket.budget_bytes / 2**20, cut / 2**20)
            bucket.headroom_cut += cut
            bucket.overshot = True
        if charged:
            self._plan_again_for(bucket, int(grown))
        else:
            self.s._plan_bucket(bucket, profiled=False)

    # NOTE [ A plan checked only in part ]
    # Where microbatches keep less than their plan (sequences found zero after the forward,
    # units the risk fit sent to R), a check reads less than the plan keeps whole; with
    # groups shuffled across microbatches that is nearly every microbatch. A check whose upper
    # bound fits is taken at once (NOTE [ A bound for a check in part ]); otherwise a plan is
    # taken as fitting after MAX_PARTIAL such checks (NOTE [ The plan's peak, checked ]). Such a
    # plan is not held to fit by a reading just under the budget: on ``hilore bench --model
    # paper-cpu`` (ZeRO-2, 2 ranks, 1.10x) three partial checks peaked 0.7 MiB under the
    # budget at most, and a later microbatch that ran whole peaked 1.7 MiB over it. A plan
    # whose partial checks came within the overshoot's margin of the budget (1% of it, at
    # least 1 MiB) is planned again below it: the headroom is lowered by what the plan's price
    # must fall for its highest reading to sit a margin under the budget (the price's slack
    # under the old headroom, plus the reading's distance from budget less margin), the same
    # on every rank (the readings are the max over ranks). The new plan is checked in turn,
    # from its own readings; growth an absolute budget charges is charged as after any check.
    #
    # NOTE [ A bound for a check in part ]
    # Most partial checks need not be repeated. Where the microbatch ran the bucket's plan whole
    # at its forward and kept less only after it (sequences found zero elided, units the risk
    # fit sent to R), every byte it did not keep was first kept, then freed by a downgrade
    # (``LayerFrame.downgrade``), which tells the check what it freed, by storage (E) or by unit
    # (R) (``FreedBytes``, the microbatch's ``freed``). The same microbatch keeping them would
    # hold those bytes more until its backward holds as much again: a unit sent to R recomputes
    # its tensors at its first unpack; a storage with elided rows decodes itself whole at its
    # first use (an unpack, or a tensor re-derived from it), a buffer the size of the whole
    # plan's storage, its rows' copies dropped then (NOTE [ Kept rows, held once ] in
    # runtime/storage.py); a storage with packed rows holds them beside its decoding in the
    # whole plan too, until released. So each reading of the op-level tracker plus what is freed
    # and not yet held again (``PeakTracker.restore``) bounds what the whole plan holds at that
    # point, and the highest such reading bounds its peak; the downgrades' own copies, and the
    # decoding or recompute of what they freed, are left out of it (``FreedBytes.aside``: the
    # whole plan runs none of them). A partial check whose bound, like its reading, is within
    # the budget on every rank is taken as a whole one that fits, without a credit (its reading
    # is low by what was not kept); one whose bound is over is checked again as before. Not
    # where the microbatch ran a plan re-solved for its rows (the prediction's zero sequences
    # never kept: another plan), nor on CUDA, whose window is read from the device's peak
    # counter once (no reading to add them to). Measured on one ``paper-cpu`` microbatch of 8 x
    # 256 at 1.10x (plan H R H R R ... H H): with 4 of 8 sequences found zero the check read
    # 13.8 MiB under the budget and bounded the whole plan at 6.90 MiB under; the same
    # microbatch with elision off peaked 6.93 MiB under. Before the bound, ``hilore bench
    # --model paper-cpu --run-steps 40`` (shuffled groups, half of them at A = 0) ran ten checks
    # in its warm-up, each 0.3-1.4 s above GC's step, most of them repeats of a plan whose
    # microbatch had elided sequences; with it, seven, one per plan, and the warm-up cost 5.7 s
    # above GC's steps instead of 9.7 s.
    def _keep_margin(self, bucket, plan, over: float, margin: int) -> None:
        """Lower the headroom of ``bucket`` so that its next plan peaks a margin under the
        budget; the caller plans it again."""
        cut = int(over) + margin + max(0, plan.headroom_bytes - plan.peak_over_gc_bytes)
        logger.info("ds_hilore: the plan for %dx%d, checked only on microbatches that kept less "
                    "than it, peaked %.1f MiB under the memory budget (%.1f MiB), within the "
                    "%.1f MiB margin; its headroom is lowered by %.1f MiB and it is planned again",
                    *bucket.key, -over / 2**20, bucket.budget_bytes / 2**20, margin / 2**20,
                    cut / 2**20)
        bucket.headroom_cut += cut
        bucket.overshot = True  # no credit from then on
        self.partial_checks.pop(bucket.key, None)  # the new plan's readings start afresh

    # NOTE [ Growth that is not the plan's ]
    # A check reads the whole process, and the process grows for reasons of its own: under CPU
    # bf16 autocast, with microbatches of varied lengths, the heap grew from 265 to 475 MiB over
    # 30 steps with plain HF checkpointing (oneDNN's and autocast's caches, freed chunks the
    # allocator keeps). Read as the plan's, that growth was two overshoots of 54 MiB at a 1.5x
    # budget: they cut the bucket's headroom below zero and left it all R for the rest of the
    # run. So each rank's check is taken at its microbatch's start too (in use less the
    # parameters' gradients, as ``begin_step`` reads it), and what the process holds there
    # beyond the profile's baseline -- memory that appeared since profiling and was not
    # charged to the bucket (NOTE [ Memory that appears after profiling ] in metering.py) --
    # is not the plan's: it is taken off the peak the check compares with the budget and with
    # the plan's price. Under a relative budget that is all (GC's own peak, of which the budget is
    # a multiple, would hold that memory too); under an absolute one it is memory the budget
    # no longer has, so above a margin it is charged to the bucket as memory appearing after
    # profiling (its baseline and GC's peak raised by the max over ranks) and the bucket is
    # planned again -- without the cut and the lasting mark of an overshoot.
    def _measured(self, bucket, plan, meter) -> list[float]:
        """This rank's numbers of the check: its peak over the budget at its length, partial,
        under the GC peak it was priced on, the price's excess over its peak negated, and what
        was in use at its start beyond the profile's baseline -- the peak taken less that
        growth (NOTE [ Growth that is not the plan's ])."""
        bound = math.inf  # NOTE [ A bound for a check in part ]
        if isinstance(meter, PeakTracker):
            peak = upper = meter.freeze()
            bound = meter.bound_bytes if self.check_whole else math.inf
        else:  # CUDA: a lower bound when not exact, ``upper`` what it is known not to exceed
            peak, upper = meter.close(), meter.upper
            if not meter.exact:
                self._under_earlier_peak(f"the check of the plan for {bucket.key[0]}x"
                                         f"{bucket.key[1]}", meter)
        stats = self.s.step_stats
        stats["peak_bytes"] = max(stats["peak_bytes"] or 0, peak)
        baseline = bucket.profile.baseline_bytes if bucket.profile is not None else math.inf
        grown = float(max(0, self.check_base - baseline))
        # NOTE [ Headroom a checked plan left ]: under GC's own peak (> 0), and the price's
        # excess over the peak, negated (the least excess over ranks is the max of this)
        gc_peak = bucket.priced_gc_peak if bucket.priced_gc_peak is not None else math.inf
        return [float(peak - grown - self.check_budget), float(self.check_partial),
                float(gc_peak - (upper - grown)),
                float(upper - grown - (gc_peak + plan.peak_over_gc_bytes)), grown,
                min(float(bound - grown - self.check_budget), _NEVER)]

    # NOTE [ Headroom a checked plan left ]
    # Where GC's peak was not read phase by phase (CUDA, an untracked profile), a plan is priced
    # as GC's peak plus every byte it keeps, as if all of them were alive at GC's peak. They are
    # not always: GC peaks in the backward of the last layers, where it recomputes them, and a
    # unit kept there (stored or packed) replaces that recompute, whose packed tensors are
    # decoded only when its own backward asks for them. Measured on ``hilore bench --model
    # paper-cpu`` at 1.10 (headroom 35-37 MiB), priced that way: a plan packing seven units,
    # priced at +33.3 MiB over GC's peak, peaked at +17.8; another packing seven, in other
    # layers, priced at +35.6, peaked at +35.7; one storing three attention units whole, priced
    # at +31.6, peaked at +21.1 in one run and +31.7 in another. Priced phase by phase (NOTE
    # [ A plan priced phase by phase ] in allocate.py) the price is the plan's predicted peak
    # and the excess smaller; what is left of it is credited the same way. So where a checked
    # plan's price exceeds its peak by more than three margins (the margin of a cut: 1 % of the
    # budget, at least 1 MiB), the bucket's headroom gets that excess less two margins (it replaces an
    # earlier credit, the excess of the plan checked then) and the bucket is planned again --
    # with room for more kept units, and checked like any new plan: if that one peaks over the
    # budget, the cut above takes it back and no credit is given again. At most two credits per
    # bucket; the excess is the least over ranks (every rank plans the same). Only where the
    # check measures what the price stands for: the plan peaked at or above the GC peak it was
    # priced on, on every rank (below it, the check did not see what the profile saw: a profile
    # resumed from another process, memory released since), the bucket's bytes priced at the
    # profiled length (NOTE [ Priced for the bucket's longest ] in buckets.py: at a longer one
    # the excess at the profiled length says nothing) and, on CUDA, the window's upper bound
    # (``upper``: exact, or the earlier peak), from a microbatch of the bucket's full length (a
    # shorter one peaks lower), not while leave-one-out times the plan. A credited plan that
    # keeps more than the headroom without the credit passes only a whole check: after
    # MAX_PARTIAL partial ones, the credit is taken back for good and the bucket planned again
    # (``_revoke``). Plans re-solved per microbatch (``_plan_for_rows`` in scheduler.py) are not
    # checked on their own, so they are solved within the headroom without the credit.
    def _revoke(self, bucket) -> bool:
        """A plan that keeps more than the headroom without the credit passes only a whole
        check: after MAX_PARTIAL partial ones the credit is taken back, for good, and the bucket
        planned again (NOTE [ Headroom a checked plan left ]). Whether it was."""
        plan = bucket.plan
        if bucket.headroom_credit <= 0 or \
                plan.peak_over_gc_bytes <= plan.headroom_bytes - bucket.headroom_credit:
            return False
        logger.info("ds_hilore: the plan for %dx%d, made with %.1f MiB of headroom a check "
                    "found, never ran whole to be checked; planned again without it",
                    *bucket.key, bucket.headroom_credit / 2**20)
        bucket.headroom_credit, bucket.credits = 0, MAX_CREDITS
        self.s._plan_bucket(bucket, profiled=False)
        return True

    def _credit(self, bucket, excess: float, margin: int) -> None:
        """``excess``: the checked plan's price (GC's peak plus its predicted peak above it)
        above its peak."""
        credit = int(excess) - 2 * margin
        if bucket.overshot or bucket.credits >= MAX_CREDITS or stretched(bucket) or \
                credit < bucket.headroom_credit + margin:
            return
        logger.info("ds_hilore: the plan for %dx%d peaked %.1f MiB under its price (GC's peak "
                    "plus what it was priced to add); its headroom is raised by %.1f MiB and it "
                    "is planned again", *bucket.key, excess / 2**20, (credit - bucket.headroom_credit) / 2**20)
        bucket.headroom_credit = credit
        bucket.credits += 1
        self.s._plan_bucket(bucket, profiled=False)


class FreedBytes:
    """The bytes a checked microbatch's downgrades freed, added to the check's readings until
    its backward holds as much again (NOTE [ A bound for a check in part ]): by unit ((layer
    index, position), sent to R) or by storage (rows elided)."""

    def __init__(self, metering, check):
        self.metering, self.check = metering, check
        self.held: dict = {}  # Stored or unit -> [unit, bytes added]

    def add(self, unit: tuple[int, int], nbytes: int, stored=None) -> None:
        """``nbytes`` freed from ``unit``: from its storage ``stored`` (E), or all of it (R)."""
        if nbytes > 0 and self.metering.check is self.check:
            self.held.setdefault(unit if stored is None else stored, [unit, 0])[1] += nbytes
            self.check[2].restore(nbytes)

    def aside(self, unit: tuple[int, int] | None = None):
        """A downgrade, or an unpack of ``unit`` that decodes a storage or recomputes a unit
        freed here: what it allocates meanwhile is not the whole plan's, and no reading of the
        bound takes it (an unpack of another unit, a recompute the plan itself makes, counts)."""
        if unit is not None and not any(u == unit for u, _ in self.held.values()):
            return contextlib.nullcontext()
        return self.check[2].bound_paused()

    def unpacked(self, unit: tuple[int, int]) -> None:
        """The backward unpacked a tensor of ``unit``: a unit sent to R is recomputed whole
        now; a storage decoded (directly, or for a tensor re-derived from it) holds as much as
        the whole plan's, which it replaces; one released is released in the whole plan too."""
        if not self.held:
            return
        back = self.held.pop(unit, [None, 0])[1]
        for stored in [k for k in self.held if not isinstance(k, tuple)]:
            # decoded, it holds a buffer of the whole storage, its rows' copies dropped (NOTE
            # [ Kept rows, held once ] in storage.py); with packed rows it holds them beside the
            # buffer in the whole plan too, until released
            if stored.pending <= 0 or (stored.buffer is not None and not stored.packs_rows()):
                back += self.held.pop(stored)[1]
        if back and self.metering.check is self.check:
            self.check[2].restore(-back)


def gradient_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the storages the parameters' ``.grad`` tensors use on ``device``'s kind (each
    storage once); a tensor subclass (FSDP2's DTensor gradients) by the plain tensors it holds,
    this rank's shard."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        g = p.grad
        if g is None or g.device.type != device.type:
            continue
        for t in _plain(g):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a wrapper subclass's inner tensors."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
    return [x for part in inner if isinstance(part, torch.Tensor) for x in _plain(part)]
