"""The scheduler: HiLoRe deciding by itself, one microbatch at a time.

NOTE [ One microbatch ]
    begin_forward     shape bucket (all-reduced max over ranks; in a steady step this rank's
                      own, nothing agreed: NOTE [ A steady step agrees nothing before its
                      forwards ] in steady.py); unseen -> all-R and profiled
                      (profile.py); profiled -> the bucket's plan (allocate.py), sequences split
                      by predicted exposure (``expect``) when known, those predicted 0 never
                      stored and the plan re-solved for the rest (NOTE [ Freed memory is spent ])
    begin_microbatch  the runtime's microbatch gets the profiler sample, if any
    after_coefficients  ω known: exposure per unit and sequence; the riskiest packed units go
                      to R until the estimated error, in the step's units (NOTE [ Risk in step
                      units ] in risk.py), fits the risk budget -- one decision for all ranks
                      (A = 0 rows are elided by the runtime already)
    top_grad          the backward reached the last layer: end of a profiled microbatch is
                      queued; the gradient there is kept when a matched pass will need it
    end_step          matched passes (calibration, validation) on a separate graph, with
                      training's RNG untouched and the accumulated gradients never touched

The runtime calls these (NOTE [ Policy ] in runtime/core.py); the decisions are plain functions
(allocate.py, risk.py, knapsack.py). Here: the pipeline, a bucket's planning and the risk fit.
Alongside: a shape bucket and its prices (buckets.py), the risk of a microbatch's slices and
where its exposure quartiles went (slices.py), the memory windows (metering.py), the matched
passes (calibrate.py), what it reports and saves in a checkpoint (records.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any

import torch

from ds_hilore.plan import budget as budgets
from ds_hilore.plan import prediction, records, steady
from ds_hilore.plan.allocate import Plan, allocate
from ds_hilore.plan.buckets import (Bucket, input_shape, priced_for_longest, priced_rooms,
                                    rounded_length, stores_all)
from ds_hilore.plan.calibrate import MatchedPasses
from ds_hilore.plan.metering import Metering, agree
from ds_hilore.plan.profile import BucketProfile, Profiler
from ds_hilore.plan.risk import RiskModel, StepExposure
from ds_hilore.plan.slices import count_slices, unit_risks
from ds_hilore.plan.validate import LeaveOneOut

logger = logging.getLogger("ds_hilore")


class Scheduler:
    """Decides the plan of every microbatch of one runtime (see the module's NOTE)."""

    def __init__(self, runtime):
        self.runtime, self.config = runtime, runtime.config
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.risk = RiskModel()
        self.tighten = 1.0  # validation halves the risk budget when the measured error exceeds it
        self.expected: list[float] | None = None  # predicted exposure per sequence (expect)
        self.expected_step: float | None = None  # ... summed over the step, all ranks (expect)
        self.expected_exposed: int | None = None  # of the step's microbatches, non-zero (expect)
        self.applied = None  # (prediction, step prediction, exposed count) the plan used
        self.step_exposure = StepExposure()  # NOTE [ Risk in step units ] in risk.py
        self.row_plans: dict = {}  # plans re-solved for the rows a prediction keeps
        self.predicted_zero = False  # the microbatch in progress runs all R, every rank's predicted 0
        self.bucket: Bucket | None = None  # of the forward in progress
        self.rows_here = 1  # sequences of the forward in progress on this rank (Uneven batches)
        self.length_here = 1  # ... and its positions (a profile sample's tokens, a check's budget)
        # this rank's prediction's rows (prediction.row_values), and the max over ranks
        self.row_values = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
        self.rows_agreed = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
        self.longest = 0  # the forward in progress's length, the max over ranks
        self.shortest = 0  # and the least
        self.metering = Metering(self)  # the memory windows (plan/metering.py)
        self.passes = MatchedPasses(self)
        self.timing = None  # (leave-one-out, variant, start) of the forward in progress
        self.fits = 0  # microbatches whose risk was fitted or reused (refresh_interval)
        self.last_fit: tuple[float, list[str]] | None = None  # (estimate, units sent to R)
        self.zero_skips = False  # the last ω was the loss's: NOTE [ A microbatch predicted zero ]
        self.calibrated = 0  # microbatches calibrated so far
        self.calibration_draws = 0  # groups drawn so far (NOTE [ Calibration spread over ranks ])
        self.steps = 0
        # NOTE [ A steady step agrees nothing before its forwards ] in steady.py: the step in
        # progress is steady (agreed at the last one's end), and its buckets run as GC; this
        # rank met what makes the next one agree (a shape without a bucket of its own, a
        # prediction); the longest length this rank met that no bucket held, and over ranks,
        # until a bucket holds it
        self.steady = False
        self.steady_as_gc = False
        self.unsettled = False
        self.unheld = 0
        self.pending = 0
        self.said_steady = False
        self.alloc_s = 0.0  # this step's allocation time
        self.step_stats: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self._reset_step()

    # ------------------------------------------------------------------ pipeline
    def begin_forward(self, args, kwargs, replayable: bool = True) -> None:
        """``replayable``: ``args``/``kwargs`` are the model's (NOTE [ Where a microbatch begins ]
        in runtime/core.py); else the first layer's hidden states, and no matched pass runs."""
        if self.passes.running:
            return
        begin = time.perf_counter()
        self.metering.end_windows()
        self.metering.begin_step()  # NOTE [ Memory that appears after profiling ]
        if self.steady and self.passes.hold_out:  # called on every rank alike; the steady part's
            self.steady, self.fits = False, 0  # risk fits were each rank's (``after_step``)
        if self.steady:
            steady.begin_forward(self, args, kwargs)
            self.alloc_s += time.perf_counter() - begin
            return
        self.rows_here, length = input_shape(args, kwargs)
        self.runtime._split_next = None  # set by ``_apply`` for this forward only
        key, shortest = self._bucket_key(self.rows_here, length,
                                         prediction.row_values(self, length))
        self.shortest = shortest
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket(key, Profiler(key, self.config.profile_microbatches))
        self.bucket = bucket
        ready = bucket.plan is None and bucket.profiler.ready(len(self._timed()))
        if bucket.plan is None and not ready:  # profiled now: its shortest counts
            bucket.shortest = min(bucket.shortest or shortest, shortest)
        if ready:
            self._plan_bucket(bucket)
            self._start_loo(bucket)
        if bucket.loo is not None and bucket.loo.done:
            self._finish_loo(bucket)
        self.timing, self.applied, self.predicted_zero = None, None, False
        self.runtime.gc_forward = self._runs_as_gc(bucket)  # NOTE [ Never slower than GC ] in validate.py
        if self.expected is not None and self._runs_as_gc(bucket, unpredicted=True):
            self.unsettled = True  # steady, it would run as GC without it (steady.py)
        exact = not self.runtime.gc_forward and \
            self.passes.begin_forward(args, kwargs, bucket, replayable)
        if self.passes.fresh and self.passes.job.kind == "calibrate":
            self.warm_up("calibration")
        if self.runtime.gc_forward:
            self.passes.fresh = False
        elif bucket.plan is None:  # NOTE [ Profiling ]: measured all-R, as GC
            self.warm_up("profiling")
            self.runtime.apply_plan("R")
            self.metering.open_profile()
        elif exact:  # NOTE [ The exact gradient from training ] in calibrate.py: neither timed nor checked
            self._apply(bucket, exact=True)
        elif bucket.loo is not None:  # NOTE [ Leave-one-out ]: the plan, or it minus one layer
            self.warm_up("leave-one-out")
            variant = bucket.loo.next_variant()
            if variant == LeaveOneOut.GC:  # gradient checkpointing itself, HiLoRe out of the way
                self.runtime.gc_forward = True
            else:
                ran = self._apply(bucket, recompute_layer=None if variant in (
                    LeaveOneOut.WARM_UP, None) else variant)
                if variant == LeaveOneOut.WARM_UP:  # the plan itself, and its timing is not used
                    self.metering.open_check(bucket, self.longest, ran)
            self.timing = (bucket.loo, variant, self._now(), self.rows_here * length)
        else:  # a microbatch a matched pass replays runs whole: the pass needs every row
            self.metering.open_check(bucket, self.longest,
                                     self._apply(bucket, steady=not self.passes.fresh))
        self.expected = None  # a prediction is for this microbatch only
        self.alloc_s += time.perf_counter() - begin

    def begin_microbatch(self, mb) -> None:
        if self.passes.running or self.bucket is None:
            return
        mb.plan_key = self.bucket.key
        mb.local_checks = self.steady  # NOTE [ A steady step agrees nothing before its forwards ]
        mb.pass_job = self.passes.job if self.passes.fresh else None  # chosen at its forward
        mb.norms_all = mb.pass_job is not None and mb.pass_job.capture
        mb.timing, self.timing = self.timing, None
        mb.derive = mb.derive and self.derives(self.bucket)
        mb.predicted, self.applied = (self.applied if self.bucket.plan is not None else None), None
        mb.freed = self.metering.freed_bytes()  # NOTE [ A bound for a check in part ] in checks.py
        if self.bucket.plan is None:
            mb.profile = self.bucket.profiler.sample(self.runtime.units, self._device(),
                                                     tokens=self.rows_here * self.length_here)
            self.metering.begin_microbatch(mb.profile)

    def wants_exposure(self, mb) -> bool:
        """Whether ``mb``'s unit exposure is to be computed and read with its coefficients: a
        risk fit is due (``refresh_interval``), or a matched pass of it will weigh its slices.
        Between refreshes the last decision is applied again without reading it."""
        if self.passes.running or mb.plan_key not in self.buckets:
            return False
        return mb.pass_job is not None or (self.buckets[mb.plan_key].plan is not None
                                           and self._fit_due())

    def risk_vector(self, mb) -> list[float] | None:
        """This rank's risk of every unit of the model (unit order), in the step's units, when a
        fit is due: agreed over ranks (the max) with the elision's decision, in its one
        all-reduce (NOTE [ Two reads per microbatch ] in runtime/reads.py); None otherwise, the
        same on every rank."""
        if self.passes.running or mb.plan_key not in self.buckets or \
                self.buckets[mb.plan_key].plan is None or not self._fit_due():
            return None
        mass, exposure = mb.exposure_lists()
        predicted = getattr(mb, "predicted", None) or (None, None, None)
        reference = self.step_exposure.reference(
            sum(mass), sum(predicted[0]) if predicted[0] else None, predicted[1], predicted[2])
        risks = unit_risks(self.risk, mb, self.buckets[mb.plan_key], mass, exposure)
        mb.unit_risks = risks  # name -> s eps E_{u,S}
        mb.risk_here = [risks.get(u.name, 0.0) / reference if reference > 0 else 0.0
                        for u in self.runtime.units]
        return mb.risk_here

    def after_coefficients(self, mb, agreed: list[float] | None = None) -> None:
        """ω and exposure are known: spend the risk budget on this update (NOTE [ One microbatch ]).
        ``agreed``: ``risk_vector`` after the all-reduce (the max over ranks), when a fit was
        due: the units sent to R are one decision for all ranks (``_fit_risk``); between
        refreshes the last decision is applied again: it was collective too."""
        if self.passes.running or mb.plan_key not in self.buckets:
            return
        begin = time.perf_counter()
        self.zero_skips = mb.source == "analytic"  # an all-zero one skips its recompute then
        bucket = self.buckets[mb.plan_key]
        if bucket.plan is not None:
            if agreed is not None:  # in a steady step this rank's own plan: its own risks
                self.last_fit = self._fit_risk(mb, mb.risk_here if mb.local_checks else agreed)
            else:
                for name in self.last_fit[2]:
                    unit = next((u for u in self.runtime.units if u.name == name), None)
                    if unit is not None and _packs(mb, unit):
                        self.runtime.downgrade(name, "R", mb=mb)
            self.fits += 1
            if self.last_fit[2]:  # units sent to R keep nothing: the peak is not the plan's
                self.metering.partial()
            risk, mass = self.last_fit[0], self.last_fit[1]
            self.step_exposure.add(mass, risk)
            self.step_stats["grad_error_est"].append(risk / mass if mass > 0 else 0.0)
        self.alloc_s += time.perf_counter() - begin

    def _fit_due(self) -> bool:
        return self.fits % self.config.refresh_interval == 0 or self.last_fit is None

    def top_grad(self, mb, grad: torch.Tensor) -> None:
        if self.passes.running:
            return
        if any(frame.elided_rows for frame in mb.live_frames()):  # sequences found zero keep nothing
            self.metering.partial()
        with self.metering.held():  # NOTE [ Tracked on CPU ]: kept for a matched pass only
            self.passes.top_grad(mb, grad)
        if mb.timing is not None:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_timing(mb))
        self.metering.top_grad(mb)

    def forward_failed(self) -> None:
        """A forward of the model raised: its memory windows end (no backward will close them;
        an op-level tracker left open would read every op until the next training forward)."""
        self.metering.end_windows()

    def detach(self) -> None:
        """The runtime detaches: no memory window stays open (NOTE [ Tracked on CPU ])."""
        self.metering.detach()

    def end_step(self) -> None:
        if self.passes.running:
            return
        self.metering.end_windows()  # before the matched passes: they are not the step's plan
        self.passes.run()
        self.step_stats["grad_error_est_step"] = self.step_exposure.close(
            self.runtime.collective, steady.riders(self))
        self.step_stats["steady"] = self.steady
        self.steps += 1
        steady.after_step(self, self.step_exposure.riders)
        self.step_stats["alloc_s"] = self.alloc_s
        self.last_stats = self.step_stats
        self._reset_step()

    # ------------------------------------------------------------------ public
    def keeps_whole(self, mb) -> bool:
        """Whether the zero-ω sequences of ``mb`` stay in the storages kept whole: yes when the
        plan stores every unit whole (nothing was short of memory; eliding them would only copy
        the other sequences out, NOTE [ Exact zeros ] in runtime/storage.py)."""
        bucket = self.buckets.get(mb.plan_key)
        return not self.passes.running and bucket is not None and stores_all(bucket)

    def derives(self, bucket: Bucket) -> bool:
        """Whether the units re-derive their pointwise tensors (NOTE [ Derived tensors ] in
        runtime/derived.py): no when the plan stores every unit whole and keeping those tensors
        too still fits the headroom -- nothing is short of memory, deriving would only cost time.
        Always while the bucket is profiled: the profile measures what deriving saves."""
        plan = bucket.plan
        if plan is None or not stores_all(bucket):
            return True
        scale = bucket.byte_scale or {}  # priced for the bucket's longest, as the plan is
        kept = sum(c.derived_bytes * scale.get(c.kind, 1.0) for c in bucket.profile.units
                   if plan.actions.get(c.name) == "H")
        return plan.peak_over_gc_bytes + kept > plan.headroom_bytes

    def expect(self, exposure: list[float] | None, step_exposure: float | None = None,
               exposed_microbatches: int | None = None) -> None:
        """Predicted exposure per sequence of the next microbatch, before its forward.

        The plan of that microbatch then stores its most exposed sequences H and packs the
        least exposed ones (per-sequence splits), never stores a sequence predicted 0 (E), and
        spends the memory those leave on more H/L (the knapsack re-solved for the rows kept).

        Args:
            exposure: one value per sequence, any unit: sum_t |A_i| w_{i,t} m_{i,t}
                (``ds_hilore.grpo.exposure.predicted``; |A_i| x response tokens ranks the same
                way). A zero must mean a zero loss coefficient: on-policy with no KL or entropy
                term (beta = 0). With beta > 0 or an entropy bonus, do not call this. A wrong
                zero is caught after the forward (its units are recomputed: exact, slower).
            step_exposure: optional, the same prediction summed over every microbatch of the
                optimizer step on every rank: the risk then reads this microbatch against the
                step (NOTE [ Risk in step units ] in risk.py); without it, against a running
                reference.
            exposed_microbatches: optional, with ``step_exposure``: how many of those
                microbatches (every rank's) have a non-zero prediction. Those predicted zero
                pack nothing, so the step's error tolerance is shared by these alone (NOTE
                [ The tolerance of a step, shared by its exposed microbatches ] in risk.py);
                without it, by every microbatch of the last step.
        """
        self.expected = None if exposure is None else [float(x) for x in exposure]
        self.expected_step = None if exposure is None or step_exposure is None else float(step_exposure)
        exposed = None if self.expected_step is None else exposed_microbatches
        if exposed is not None and int(exposed) < 1:
            raise ValueError(f"expect(exposed_microbatches={exposed!r}): the count of the step's "
                             "microbatches with non-zero predicted exposure, on every rank; at "
                             "least 1 (leave it out when unknown)")
        self.expected_exposed = None if exposed is None else int(exposed)

    def hold_out(self) -> None:
        """Hold the next planned microbatch out for a ranking check of the risk model, run at
        the following ``end_step``; the result is ``stats["ranking"]``. Under several ranks,
        call it on every rank at the same point: the check's passes agree over ranks. Where no
        pass could take it -- nothing packed (``"low_precision": "none"``), or matched passes
        off (ZeRO-3 attached outside ``ds_hilore.initialize``) -- it is said and nothing is held
        out: a hold-out left pending kept every later step from being steady."""
        why = "nothing is packed (\"low_precision\": \"none\")" if self.runtime._codec is None \
            else None if self.passes._supported() else \
            "matched passes are off (ZeRO-3 attached outside ds_hilore.initialize)"
        if why is not None:
            logger.warning("ds_hilore: hold_out(): no ranking check, %s", why)
            return
        self.passes.hold_out = True

    @property
    def stats(self) -> dict[str, Any]:
        return records.stats(self)

    def state_dict(self) -> dict[str, Any]:
        return records.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        records.load_state_dict(self, state)

    # ------------------------------------------------------------------ planning
    def _plan_bucket(self, bucket: Bucket, profiled: bool = True) -> None:
        self.warm_up("planning")
        if profiled:
            # NOTE [ Memory that appears after profiling ] in plan/metering.py
            grown, now = self.metering.grown()
            bucket.profile = self._agree(bucket.profiler.result(grown, now, self._timed()))
            self.metering.planned(bucket)
        profile = bucket.profile
        device = self._device()
        bucket.budget_bytes, bound = self._agree_budget(
            *budgets.budget_and_bound(self.config, profile.gc_peak_bytes, device))
        bucket.budget_bound = bound
        # m x GC's peak (NOTE [ Priced for the bucket's longest ] in buckets.py)
        relative = bound != "device" and self.config.memory_budget_bytes is None and \
            self.config.memory_fraction is None
        bucket.byte_scale, gc_peak = priced_for_longest(bucket, relative)
        bucket.priced_gc_peak = gc_peak
        headroom = bucket.budget_bytes - gc_peak - bucket.headroom_cut + bucket.headroom_credit
        if headroom < 0 and profiled:  # once per shape; replans reuse the same numbers
            logger.warning("ds_hilore: the memory budget (%s: %.1f MiB per rank) is below what "
                           "gradient checkpointing itself needs on %dx%d (%.1f MiB); running as GC "
                           "(all R). Fix: raise the budget.", budgets.describe(self.config),
                           bucket.budget_bytes / 2**20, *bucket.key, gc_peak / 2**20)
        priced = functools.partial(allocate, profile, self.risk, headroom,
                                   codec=self.runtime._codec is not None,
                                   excluded=frozenset(bucket.excluded),
                                   byte_scale=bucket.byte_scale, rooms=priced_rooms(bucket))
        plan = priced(self._risk_budget())
        # NOTE [ Calibration that cannot change a plan ] in calibrate.py: the plan that memory
        # and time alone choose, and whether the error budget is that far from binding it
        free = priced(math.inf)
        slack = free.actions == plan.actions and \
            free.risk * self.passes.SETTLE <= self._risk_budget() if self.passes.SETTLE else False
        bucket.plan, bucket.error_slack = self._broadcast((plan, slack))
        self.passes.settled = None  # decided again with this plan
        mix = {a: sum(1 for x in bucket.plan.actions.values() if x == a) for a in "HLSR"}
        # said once per shape; replans (calibration, validation, leave-one-out) at DEBUG
        logger.log(logging.INFO if profiled else logging.DEBUG,
                   "ds_hilore: plan for %dx%d: %s, %.1f MiB kept of %.1f MiB headroom, est. "
                   "error %.4f", *bucket.key, mix, bucket.plan.memory_bytes / 2**20,
                   max(headroom, 0) / 2**20, bucket.plan.risk)

    def replan(self) -> None:
        """After calibration or validation changed the risk model: every bucket again."""
        for bucket in self.buckets.values():
            if bucket.profile is not None:
                self._plan_bucket(bucket, profiled=False)

    def _apply(self, bucket: Bucket, recompute_layer: int | None = None, exact: bool = False,
               steady: bool = False) -> str:
        """The bucket's plan for this microbatch: splits by predicted exposure (the most exposed
        sequences H, the least exposed L), sequences predicted 0 run apart without autograd
        (``steady``: a microbatch neither timed nor calibrated; NOTE [ Kept rows only ] in
        runtime/rows.py) or elided (E), and the memory they leave spent (``_plan_for_rows``;
        all R when every one is: NOTE [ A microbatch predicted zero ]); ``recompute_layer``:
        that layer R instead (a leave-one-out variant, timed on the bucket's own plan). Returns
        what the microbatch runs, for the plan's check (NOTE [ The plan's peak, checked ] in
        checks.py): ``"whole"`` the bucket's plan itself, every sequence kept; ``"nothing"``
        all R; ``"part"`` a plan re-solved for the sequences it keeps. The same on every rank
        but for the sequences kept."""
        plan, batch = bucket.plan, min(self.rows_here, bucket.key[0])  # NOTE [ Uneven batches ]
        if recompute_layer is not None:
            layer_of = {c.name: c.layer for c in bucket.profile.units}
            plan = dataclasses.replace(plan, actions={
                n: ("R" if layer_of.get(n) == recompute_layer else a) for n, a in plan.actions.items()})
        expected = self.expected if self.expected is not None and len(self.expected) == batch else None
        mode = self.runtime.elision_mode(self._device())  # NOTE [ Stand-ins on accelerators ]
        split = steady and prediction.splits(self)  # every rank's, or in a steady step its own
        # "whole": only where the backward will be skipped -- not under ZeRO-3, nor on a
        # microbatch leave-one-out times (``_may_skip`` in elision.py); nothing is short where
        # every unit is stored whole (keeps_whole)
        shared = not stores_all(bucket) and (mode is True or split or (
            self.runtime.zero_backward_skip and bucket.loo is None))
        self.predicted_zero = False  # set by _plan_for_rows: from all-reduced values only
        if bucket.loo is None:
            plan = self._plan_for_rows(bucket, shared, split)
        rows_split = None if self.predicted_zero or not split else \
            prediction.split_here(self, batch, expected)
        if split and bucket.gc_faster:  # NOTE [ Never slower than GC ]: where the ranks split
            # (agreed), every rank runs all R -- a rank with no zero row too (it has no split of
            # its own): a plan that keeps something on one rank only would give that rank's
            # backward a check, and a collective, that the others never make
            plan = Plan.all_r(plan.actions, plan.headroom_bytes)
        elide = bool(expected) and shared and self.row_values[0] == 0 and rows_split is None \
            and (mode is True or not any(expected))  # this rank's prediction
        kept = rows_split.kept if rows_split is not None else \
            [i for i in range(batch) if not (elide and expected[i] == 0)]
        actions, rows = prediction.unit_rows(plan, kept if rows_split is not None else
                                             list(range(batch)), expected, elide, kept)
        if exact:  # NOTE [ The exact gradient from training ] in calibrate.py
            for name in [n for n, a in actions.items() if a == "L" or "L" in rows.get(n, ())]:
                actions[name] = "R"
                rows.pop(name, None)
        self.applied = (expected, self.expected_step, self.expected_exposed) if expected else None
        if expected:  # stats: how many microbatches were planned from a prediction
            stats = self.step_stats
            stats["predicted_microbatches"] = stats.get("predicted_microbatches", 0) + 1
        self.runtime._split_next = rows_split
        self.runtime.apply_plan(actions, rows)
        if self.predicted_zero:  # the same on every rank (a re-solved plan all R may not be;
            return "nothing"  # a bucket's plan all R is never checked: awaits_check)
        return "whole" if plan is bucket.plan and len(kept) == batch and not exact else "part"

    def _plan_for_rows(self, bucket: Bucket, shared: bool, split: bool = False) -> Plan:
        return prediction.plan_for_rows(self, bucket, shared, split)

    def _pinned(self, names) -> dict[str, str]:
        """The units among ``names`` that ``force_plan`` pins, with their actions."""
        if self.config.force_plan is None:
            return {}
        pinned = {name: self.config.force_plan_for(name) for name in names}
        return {name: a for name, a in pinned.items() if a is not None}

    def _start_loo(self, bucket: Bucket) -> None:
        # units pinned by force_plan are not the allocator's to drop, and a bucket with a unit
        # pinned to keep something never runs as GC: neither is timed
        pinned = self._pinned(bucket.plan.actions)
        layers = sorted({c.layer for c in bucket.profile.units if bucket.plan.actions[c.name] != "R"}
                        - {c.layer for c in bucket.profile.units if c.name in pinned})
        gc = not any(a != "R" for a in pinned.values())
        source = next((b for b in self.buckets.values() if b.loo_layers), None)
        if source is not None and source is not bucket:  # NOTE [ A bucket learns from the others ]
            bucket.source = source.key  # in profile.py: a layer's verdict once per run; this
            self._inherit(bucket, source.excluded)  # bucket's plan timed against GC alone
            layers = [] if any(a != "R" for a in bucket.plan.actions.values()) else None
        repeats = self.config.plan_validation_microbatches
        if layers is not None and (layers or (bucket.source is not None and gc)) and repeats:
            bucket.loo = LeaveOneOut(layers, repeats, tokens=bucket.key[0] * bucket.key[1], gc=gc)
            bucket.loo_layers = bool(layers)
        else:
            bucket.validated = True  # nothing to validate

    def _finish_loo(self, bucket: Bucket) -> None:
        loo = bucket.loo
        collective = self.runtime.collective
        if collective is not None:  # every rank decides from the same timings
            loo.set_flat(collective.all_reduce_max_float(loo.flat()))
        if loo.gc_not_slower() and loo.confirm_gc(self.config.plan_validation_microbatches):
            return  # NOTE [ GC's verdict, confirmed ] in validate.py: more rounds first
        bucket.loo = None
        bucket.loo_utilities, bucket.validated = loo.utilities(), True
        bucket.gc_faster = loo.gc_not_slower()
        if bucket.gc_faster:  # NOTE [ Never slower than GC ] in validate.py, said once a bucket
            logger.info("ds_hilore: on %dx%d HiLoRe's plan was timed no faster than gradient "
                        "checkpointing (%.4f s against %.4f s, fastest runs per microbatch): this "
                        "shape runs as gradient checkpointing from now on.", *bucket.key,
                        min(loo.times[None]), min(loo.times[LeaveOneOut.GC]))
        dropped = loo.dropped()
        for other in self.buckets.values():  # NOTE [ A bucket learns from the others ]
            if other.source == bucket.key and other.plan is not None:
                self._inherit(other, dropped)
        if dropped:
            logger.info("ds_hilore: leave-one-out on %dx%d: layers %s save nothing under joint "
                        "execution (%s s); recomputed from now on.", *bucket.key, sorted(dropped),
                        {k: round(v, 4) for k, v in bucket.loo_utilities.items()})
            bucket.excluded |= dropped
            self._plan_bucket(bucket, profiled=False)

    def _runs_as_gc(self, bucket: Bucket, unpredicted: bool = False) -> bool:
        """NOTE [ Never slower than GC ] in validate.py: timed no faster than GC, or a plan that
        keeps nothing (with no prediction whose zeros it could elide): the bucket runs as
        gradient checkpointing, HiLoRe's hooks out of the way. The same on every rank: from
        agreed values only (``rows_agreed``, not this rank's ``expected``: a rank run as GC
        beside one run through frames would fire the gradient hooks in another order, NOTE
        [ One order of gradient hooks on every rank ] in steady.py); in a steady step, where the
        prediction is this rank's own, this rank's. ``unpredicted``: as it runs without a
        prediction."""
        plan = bucket.plan
        if plan is None or (not unpredicted and prediction.splits(self)):
            return False
        if any(a != "R" for a in self._pinned(plan.actions).values()):  # pinned by force_plan
            return False
        missing = bool(self.rows_agreed[prediction.MISSING])  # some rank's prediction can do nothing
        return bucket.gc_faster or ((unpredicted or missing)
                                    and not any(a != "R" for a in plan.actions.values()))

    def _timed(self) -> list:
        """The run's timed profile samples, every bucket's (NOTE [ A bucket learns from the
        others ] in profile.py)."""
        return [x for b in self.buckets.values() for x in b.profiler.timed()]

    def _inherit(self, bucket: Bucket, excluded: set[int]) -> None:
        """Leave-one-out's verdict of another bucket: those layers recomputed here too."""
        if excluded - bucket.excluded:
            bucket.excluded |= excluded
            self._plan_bucket(bucket, profiled=False)

    def _end_timing(self, mb) -> None:
        loo, variant, begin, tokens = mb.timing
        mb.timing = None
        loo.record(variant, self._now() - begin, tokens)  # NOTE [ Timings per token ]

    def _now(self) -> float:
        """Leave-one-out's clock: CUDA wall time after a sync; on CPU the process's CPU time
        (NOTE [ Leave-one-out ])."""
        device = self._device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.process_time()

    def _fit_risk(self, mb, scaled: list[float]) -> tuple[float, float, list[str]]:
        """(risk, M_m, units sent to R): this microbatch's absolute risk sum_u s eps_u E_{u,S}
        after the decision, its exposure mass, and the packed units sent to R, riskiest first,
        until sum_u s eps_u E_{u,S} / M_ref fits the risk budget (NOTE [ Risk in step units ]
        in risk.py). ``scaled``: every unit's risk / M_ref, the max over ranks
        (``risk_vector``), so every rank sends the same units to R (a rank-local R hangs
        ZeRO-3); in a steady step, whose plan is this rank's own, this rank's (ZeRO 0-2 only:
        NOTE [ A steady step agrees nothing before its forwards ] in steady.py)."""
        mass, _ = mb.exposure_lists()
        risks = dict(getattr(mb, "unit_risks", None) or {})
        budget, total = self._risk_budget(), sum(scaled)
        downgraded = []
        for k in sorted(range(len(scaled)), key=lambda k: (-scaled[k], k)):
            if total <= budget or scaled[k] <= 0:
                break
            unit = self.runtime.units[k]
            if _packs(mb, unit):
                self.runtime.downgrade(unit.name, "R", mb=mb)
            downgraded.append(unit.name)
            total -= scaled[k]
            risks.pop(unit.name, None)
        count_slices(self.step_stats, mb, mass)
        return sum(risks.values()), sum(mass), downgraded

    def _risk_budget(self) -> float:
        return self.config.grad_error_tolerance * self.tighten

    # ------------------------------------------------------------------ ranks
    def _bucket_key(self, batch: int, length: int,
                    rows: list[float]) -> tuple[tuple[int, int], int]:
        """NOTE [ Uneven batches ]
        The bucket is the max over ranks of (sequences, length rounded up to a power of two):
        one plan for every rank. A rank's microbatch may hold fewer sequences than the bucket
        (an uneven last microbatch, a dynamic batch size): its per-sequence rows are sized from
        its own sequences (``rows_here``), never from the bucket's; its plan, priced for the
        bucket's most sequences, only keeps fewer bytes. Also returned: the shortest length
        over ranks (NOTE [ Priced for the bucket's longest ] in buckets.py)."""
        collective = self.runtime.collective
        shortest = self.length_here = int(length)
        self.rows_agreed = list(rows)
        if collective is not None:  # one all-reduce: the shape, and the prediction's rows
            agreed = collective.all_reduce_max_float([batch, length, -length, *rows])
            batch, length, shortest = int(agreed[0]), int(agreed[1]), -int(agreed[2])
            self.rows_agreed = agreed[3:]
        self.longest = int(length)  # over ranks: a check's decision (``_open_check``)
        return (int(batch), rounded_length(length)), int(shortest)

    def _agree(self, profile: BucketProfile) -> BucketProfile:
        return agree(profile, self.runtime.collective)  # plan/metering.py

    def _agree_budget(self, budget: int, bound: str) -> tuple[int, str]:
        """One budget for every rank: the least over ranks, bound by the device where any
        rank's device bound it. A device's free memory (NOTE [ What the device can give ] in
        budget.py) and ``memory_fraction`` differ by rank; the plan, its checks and the credit
        a check earns must not, or one rank replans (a collective) while the others do not."""
        collective = self.runtime.collective
        if collective is None:
            return budget, bound
        least, device = collective.all_reduce_max([-budget, int(bound == "device")])
        return -least, "device" if device else bound

    def _broadcast(self, value):
        """Rank 0's ``value`` (a plan, with what goes with it) on every rank."""
        collective = self.runtime.collective
        return value if collective is None else collective.broadcast_object(value)

    def _device(self) -> torch.device:
        layer = self.runtime._layers[0].module
        param = next(layer.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def warm_up(self, kind: str, amount: float = 1) -> None:
        """NOTE [ Warm-up, counted ]
        What the step did to learn rather than to train, by kind: microbatches profiled
        (all R, metered op by op on CPU), microbatches whose plan's peak was checked (metered
        too), leave-one-out's variants, calibration microbatches (run exact, and a matched pass
        at the end of their backward), plans made, the seconds the codec's compilation
        took, and microbatches of a steady step that no bucket holds (``unplanned``: run all
        R, as GC where the buckets run as GC, NOTE [ A steady step agrees nothing before its
        forwards ] in steady.py). ``stats["warm_up"]``; empty for a steady step that met only
        shapes its buckets hold."""
        work = self.step_stats.setdefault("warm_up", {})
        work[kind] = work.get(kind, 0) + amount

    def _reset_step(self) -> None:
        self.alloc_s = 0.0
        self.step_stats = {"peak_bytes": None, "grad_error_est": [], "grad_error_measured": None}


def _packs(mb, unit) -> bool:
    """Whether ``unit`` keeps something in ``mb`` that a recompute can replace: a frame that
    holds it, not R. A layer kept whole (NOTE [ A layer that keeps everything ] in
    runtime/calling.py) stores every unit H, as autograd does, and has nothing to send to R."""
    frame = mb.frame(unit.layer_index)
    return frame is not None and not frame.kept_whole and frame.plan.actions[unit.pos] != "R"
