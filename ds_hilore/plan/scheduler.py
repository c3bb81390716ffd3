"""The scheduler: HiLoRe deciding by itself, one microbatch at a time.

NOTE [ One microbatch ]
    begin_forward     shape bucket (all-reduced max over ranks); unseen -> all-R and profiled
                      (profile.py); profiled -> the bucket's plan (allocate.py), sequences split
                      by predicted exposure (``expect``) when known
    begin_microbatch  the runtime's microbatch gets the profiler sample, if any
    after_coefficients  ω known: exposure per unit and sequence; the riskiest packed units go
                      to R until the estimated error fits the risk budget (A = 0 rows are elided
                      by the runtime already)
    top_grad          the backward reached the last layer: end of a profiled microbatch is
                      queued; the gradient there is kept when a matched pass will need it
    end_step          matched passes (calibration, validation) on a separate graph, with
                      training's RNG untouched and the accumulated gradients never touched

The runtime calls these (NOTE [ Policy ] in runtime/core.py); the decisions are plain functions
(allocate.py, risk.py, knapsack.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch

from ds_hilore.plan import budget as budgets
from ds_hilore.plan.allocate import Plan, allocate
from ds_hilore.plan.calibrate import MatchedPasses
from ds_hilore.plan.profile import BucketProfile, Profiler
from ds_hilore.plan.risk import RiskModel, group_of, share
from ds_hilore.plan.validate import LeaveOneOut
from ds_hilore.runtime.elision import unverified_rows_to_r
from ds_hilore.runtime.memory import in_use_bytes

logger = logging.getLogger("ds_hilore")


@dataclasses.dataclass
class Bucket:
    key: tuple[int, int]
    profiler: Profiler
    profile: BucketProfile | None = None
    plan: Plan | None = None
    budget_bytes: int | None = None
    loo: LeaveOneOut | None = None  # NOTE [ Leave-one-out ], while it runs
    excluded: set[int] = dataclasses.field(default_factory=set)  # layers leave-one-out sent to R
    loo_utilities: dict[int, float] | None = None  # seconds per layer, measured jointly


class Scheduler:
    """Decides the plan of every microbatch of one runtime (see the module's NOTE)."""

    def __init__(self, runtime):
        self.runtime, self.config = runtime, runtime.config
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.risk = RiskModel()
        self.tighten = 1.0  # validation halves the risk budget when the measured error exceeds it
        self.expected: list[float] | None = None  # predicted exposure per sequence (expect)
        self.bucket: Bucket | None = None  # of the forward in progress
        self.meter: bool | None = None  # CUDA's peak counter was reset for a profiled microbatch
        self.baseline = 0
        self.passes = MatchedPasses(self)
        self.timing = None  # (leave-one-out, variant, start) of the forward in progress
        self.fits = 0  # microbatches whose risk was fitted or reused (refresh_interval)
        self.last_fit: tuple[float, list[str]] | None = None  # (estimate, units sent to R)
        self.calibrated = 0  # microbatches calibrated so far
        self.steps = 0
        self.alloc_s = 0.0  # this step's allocation time
        self.step_stats: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self._reset_step()

    # ------------------------------------------------------------------ pipeline
    def begin_forward(self, args, kwargs) -> None:
        if self.passes.running:
            return
        begin = time.perf_counter()
        self._close_meter()
        key = self._bucket_key(args, kwargs)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket(key, Profiler(key, self.config.profile_microbatches))
        self.bucket = bucket
        if bucket.plan is None and bucket.profiler.done:
            self._plan_bucket(bucket)
            self._start_loo(bucket)
        if bucket.loo is not None and bucket.loo.done:
            self._finish_loo(bucket)
        self.timing = None
        if bucket.plan is None:  # NOTE [ Profiling ]: measured all-R, as GC
            self.runtime.apply_plan("R")
            self._open_meter()
        elif bucket.loo is not None:  # NOTE [ Leave-one-out ]: the plan, or it minus one layer
            variant = bucket.loo.next_variant()
            self._apply(bucket, recompute_layer=None if variant == LeaveOneOut.WARM_UP else variant)
            self.timing = (bucket.loo, variant, self._now())
        else:
            self._apply(bucket)
        self.passes.begin_forward(args, kwargs, bucket)
        self.expected = None  # a prediction is for this microbatch only
        self.alloc_s += time.perf_counter() - begin

    def begin_microbatch(self, mb) -> None:
        if self.passes.running or self.bucket is None:
            return
        mb.plan_key = self.bucket.key
        mb.timing, self.timing = self.timing, None
        mb.derive = mb.derive and self.derives(self.bucket)
        if self.bucket.plan is None:
            mb.profile = self.bucket.profiler.sample(self.runtime.units, self._device())

    def after_coefficients(self, mb) -> None:
        """ω and exposure are known: spend the risk budget on this update (NOTE [ One microbatch ])."""
        if self.passes.running or mb.plan_key not in self.buckets:
            return
        begin = time.perf_counter()
        bucket = self.buckets[mb.plan_key]
        if bucket.plan is not None:
            if self.fits % self.config.refresh_interval == 0 or self.last_fit is None:
                self.last_fit = self._fit_risk(mb, bucket)
            else:  # between refreshes: the last decision, without reading exposure
                for name in self.last_fit[1]:
                    unit = next((u for u in self.runtime.units if u.name == name), None)
                    frame = mb.frame(unit.layer_index) if unit is not None else None
                    if frame is not None and frame.plan.actions[unit.pos] != "R":
                        self.runtime.downgrade(name, "R")
            self.fits += 1
            self.step_stats["grad_error_est"].append(self.last_fit[0])
        self.alloc_s += time.perf_counter() - begin

    def top_grad(self, mb, grad: torch.Tensor) -> None:
        if self.passes.running:
            return
        if mb.source is None:  # no coefficients came: nothing proves the planned elisions
            for frame in mb.live_frames():
                unverified_rows_to_r(frame, set())
        self.passes.top_grad(mb, grad)
        if mb.timing is not None:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_timing(mb))
        if mb.profile is not None:
            mb.profile.sample_memory()  # the start of the backward: logits and their gradient
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_profile(mb))
        else:
            peak = self._peak_now()
            self.step_stats["peak_bytes"] = max(self.step_stats["peak_bytes"] or 0, peak)

    def end_step(self) -> None:
        if self.passes.running:
            return
        self._close_meter()
        self.passes.run()
        self.steps += 1
        self.step_stats["alloc_s"] = self.alloc_s
        self.last_stats = self.step_stats
        self._reset_step()

    # ------------------------------------------------------------------ public
    def keeps_whole(self, mb) -> bool:
        """Whether the zero-ω sequences of ``mb`` stay in the storages kept whole: yes when the
        plan stores every unit whole (nothing was short of memory; eliding them would only copy
        the other sequences out, NOTE [ Exact zeros ] in runtime/storage.py)."""
        bucket = self.buckets.get(mb.plan_key)
        return not self.passes.running and bucket is not None and _stores_all(bucket)

    def derives(self, bucket: Bucket) -> bool:
        """Whether the units re-derive their pointwise tensors (NOTE [ Derived tensors ] in
        runtime/derived.py): no when the plan stores every unit whole and keeping those tensors
        too still fits the headroom -- nothing is short of memory, deriving would only cost time.
        Always while the bucket is profiled: the profile measures what deriving saves."""
        plan = bucket.plan
        if plan is None or not _stores_all(bucket):
            return True
        kept = sum(c.derived_bytes for c in bucket.profile.units if plan.actions.get(c.name) == "H")
        return plan.memory_bytes + kept > plan.headroom_bytes

    def expect(self, exposure: list[float] | None) -> None:
        """Predicted exposure per sequence of the next microbatch (e.g. |A_i| * tokens_i when
        on-policy with beta = 0): its sequences are split and elided by it before the forward."""
        self.expected = None if exposure is None else [float(x) for x in exposure]

    def hold_out(self) -> None:
        """Hold the next planned microbatch out for a ranking check of the risk model, run at
        the following ``end_step``; the result is ``stats["ranking"]``."""
        self.passes.hold_out = True

    @property
    def stats(self) -> dict[str, Any]:
        s = self.last_stats or self.step_stats
        est = s.get("grad_error_est") or []
        bucket = self.bucket
        return {"peak_bytes": s.get("peak_bytes"),
                "budget_bytes": bucket.budget_bytes if bucket else None,
                "grad_error_est": sum(est) / len(est) if est else None,
                "grad_error_measured": s.get("grad_error_measured"),
                "alloc_s": s.get("alloc_s", self.alloc_s),
                "risk_budget": self.config.grad_error_tolerance * self.tighten,
                "plans": {f"{k[0]}x{k[1]}": (b.plan.to_dict() if b.plan else None)
                          for k, b in self.buckets.items()},
                "leave_one_out": {f"{k[0]}x{k[1]}": {"utilities_s": b.loo_utilities,
                                                     "recomputed_layers": sorted(b.excluded)}
                                  for k, b in self.buckets.items() if b.loo_utilities is not None},
                "ranking": self.passes.ranking,
                "calibration": {"microbatches": self.calibrated, "seconds": self.passes.seconds,
                                "susceptibility": dict(self.risk.to_dict()["samples"])},
                "profiles": {f"{k[0]}x{k[1]}": (b.profile.to_dict() if b.profile else None)
                             for k, b in self.buckets.items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"risk": self.risk.to_dict(), "tighten": self.tighten, "calibrated": self.calibrated,
                "profiles": [b.profile.to_dict() for b in self.buckets.values() if b.profile],
                "excluded": {f"{k[0]}x{k[1]}": sorted(b.excluded) for k, b in self.buckets.items()
                             if b.profile}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.risk = RiskModel.from_dict(state.get("risk", {}))
        self.tighten = float(state.get("tighten", 1.0))
        self.calibrated = int(state.get("calibrated", 0))
        for data in state.get("profiles", []):
            profile = BucketProfile.from_dict(data)
            bucket = Bucket(profile.key, Profiler(profile.key, 0), profile)
            bucket.excluded = set(state.get("excluded", {}).get(f"{profile.key[0]}x{profile.key[1]}", []))
            self.buckets[profile.key] = bucket
            self._plan_bucket(bucket, profiled=False)

    # ------------------------------------------------------------------ planning
    def _plan_bucket(self, bucket: Bucket, profiled: bool = True) -> None:
        if profiled:
            bucket.profile = self._agree(bucket.profiler.result())
        profile = bucket.profile
        device = self._device()
        bucket.budget_bytes = budgets.budget_bytes(self.config, profile.gc_peak_bytes, device)
        headroom = bucket.budget_bytes - profile.gc_peak_bytes
        if headroom < 0:
            logger.warning("ds_hilore: the memory budget (%s: %.1f MiB per rank) is below what "
                           "gradient checkpointing itself needs on %dx%d (%.1f MiB); running as GC "
                           "(all R). Fix: raise the budget.", budgets.describe(self.config),
                           bucket.budget_bytes / 2**20, *bucket.key, profile.gc_peak_bytes / 2**20)
        bucket.plan = self._broadcast(allocate(profile, self.risk, headroom, self._risk_budget(),
                                               self.runtime._codec is not None,
                                               excluded=frozenset(bucket.excluded)))
        mix = {a: sum(1 for x in bucket.plan.actions.values() if x == a) for a in "HLSR"}
        logger.info("ds_hilore: plan for %dx%d: %s, %.1f MiB kept of %.1f MiB headroom, est. "
                    "error %.4f", *bucket.key, mix, bucket.plan.memory_bytes / 2**20,
                    max(headroom, 0) / 2**20, bucket.plan.risk)

    def replan(self) -> None:
        """After calibration or validation changed the risk model: every bucket again."""
        for bucket in self.buckets.values():
            if bucket.profile is not None:
                self._plan_bucket(bucket, profiled=False)

    def _apply(self, bucket: Bucket, recompute_layer: int | None = None) -> None:
        """The bucket's plan for this microbatch: splits by predicted exposure, A = 0 elided;
        ``recompute_layer``: that layer R instead (a leave-one-out variant)."""
        plan, batch = bucket.plan, bucket.key[0]
        if recompute_layer is not None:
            layer_of = {c.name: c.layer for c in bucket.profile.units}
            plan = dataclasses.replace(plan, actions={
                n: ("R" if layer_of.get(n) == recompute_layer else a) for n, a in plan.actions.items()})
        expected = self.expected if self.expected is not None and len(self.expected) == batch else None
        order = sorted(range(batch), key=lambda i: expected[i]) if expected else list(range(batch))
        packed = set(order[:batch // 2])  # the less exposed half
        elide = expected and not _stores_all(bucket)  # keeps_whole: nothing short of memory
        actions, rows = {}, {}
        for name, action in plan.actions.items():
            actions[name] = "H" if action == "S" else action
            if action in ("S", "H", "L") and (action == "S" or elide):
                per_row = ["L" if (action == "S" and i in packed) or action == "L" else "H"
                           for i in range(batch)]
                if elide and not self.runtime.config.exposure_source == "hidden_grad":
                    per_row = ["E" if expected[i] == 0 else a for i, a in enumerate(per_row)]
                rows[name] = tuple(per_row)
        self.runtime.apply_plan(actions, rows)

    def _start_loo(self, bucket: Bucket) -> None:
        layers = sorted({c.layer for c in bucket.profile.units if bucket.plan.actions[c.name] != "R"})
        repeats = self.config.plan_validation_microbatches
        if layers and repeats:
            bucket.loo = LeaveOneOut(layers, repeats)

    def _finish_loo(self, bucket: Bucket) -> None:
        loo, bucket.loo = bucket.loo, None
        collective = self.runtime.collective
        if collective is not None:  # every rank decides from the same timings
            loo.set_flat(collective.all_reduce_max_float(loo.flat()))
        bucket.loo_utilities = loo.utilities()
        dropped = loo.dropped()
        if dropped:
            logger.info("ds_hilore: leave-one-out on %dx%d: layers %s save nothing under joint "
                        "execution (%s s); recomputed from now on.", *bucket.key, sorted(dropped),
                        {k: round(v, 4) for k, v in bucket.loo_utilities.items()})
            bucket.excluded |= dropped
            self._plan_bucket(bucket, profiled=False)

    def _end_timing(self, mb) -> None:
        loo, variant, begin = mb.timing
        mb.timing = None
        loo.record(variant, self._now() - begin)

    def _now(self) -> float:
        """Leave-one-out's clock: CUDA wall time after a sync; on CPU the process's CPU time
        (NOTE [ Leave-one-out ])."""
        device = self._device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.process_time()

    def _fit_risk(self, mb, bucket: Bucket) -> tuple[float, list[str]]:
        """Estimated error of this microbatch, and the packed units sent to R (riskiest first)
        until it fits the risk budget."""
        costs = {c.name: c for c in bucket.profile.units}
        n_layers = 1 + max(c.layer for c in costs.values())
        names = list(mb.exposure)
        rows = torch.stack([mb.exposure[n] for n in names]).tolist() if names else []  # one read
        exposure = dict(zip(names, rows))
        risks = {}
        for frame in mb.live_frames():
            for pos, unit in enumerate(frame.layer.units):
                if frame.plan.actions[pos] == "R" or unit.name not in costs:
                    continue
                packed = [i for i, state in enumerate(_row_states(frame, pos)) if state == "L"]
                if not packed:
                    continue
                cost = costs[unit.name]
                part = share(exposure[unit.name], packed) if unit.name in exposure else \
                    len(packed) / frame.batch
                risks[unit.name] = self.risk.risk(group_of(cost.kind, cost.layer, n_layers),
                                                  cost.rel_error, part)
        budget = self._risk_budget()
        total = sum(risks.values())
        downgraded = []
        for name in sorted(risks, key=risks.get, reverse=True):
            if total <= budget:
                break
            self.runtime.downgrade(name, "R")
            downgraded.append(name)
            total -= risks.pop(name)
        return total, downgraded

    def _risk_budget(self) -> float:
        return self.config.grad_error_tolerance * self.tighten

    # ------------------------------------------------------------------ measuring
    def _end_profile(self, mb) -> None:
        sample, mb.profile = mb.profile, None
        sample.sample_memory()
        peak = self._close_meter() or sample.peak_bytes
        positions = {layer.index: k for k, layer in enumerate(self.runtime._layers)}
        bucket = self.buckets[mb.plan_key]
        bucket.profiler.add(sample, positions, peak, self.baseline)
        self.step_stats["peak_bytes"] = max(self.step_stats["peak_bytes"] or 0, peak or 0) or None

    def _open_meter(self) -> None:
        device = self._device()
        self.baseline = in_use_bytes(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.meter = True

    def _close_meter(self) -> int | None:
        metering, self.meter = self.meter, None
        return torch.cuda.max_memory_allocated(self._device()) if metering else None

    def _peak_now(self) -> int:
        device = self._device()
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device)
        return in_use_bytes(device)  # CPU: sampled where the peak lives, the start of the backward

    # ------------------------------------------------------------------ ranks
    def _bucket_key(self, args, kwargs) -> tuple[int, int]:
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if ids is None:
            ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
        batch, length = (ids.shape[0], ids.shape[1]) if ids is not None and ids.dim() >= 2 else (1, 1)
        collective = self.runtime.collective
        if collective is not None:
            batch, length = collective.all_reduce_max([batch, length])
        return int(batch), 1 << max(0, math.ceil(math.log2(max(1, length))))

    def _agree(self, profile: BucketProfile) -> BucketProfile:
        """Every rank plans from the same numbers: the element-wise max over ranks."""
        collective = self.runtime.collective
        if collective is None:
            return profile
        fields = ("recompute_s", "capture_s", "pack_s", "unpack_s", "derive_s", "rel_error")
        values = [getattr(u, f) for u in profile.units for f in fields]
        values += [u.h_bytes for u in profile.units] + [u.l_bytes for u in profile.units]
        values += [u.ff_bytes for u in profile.units] + [profile.gc_peak_bytes]
        values = collective.all_reduce_max_float([float(v) for v in values])
        n, k = len(profile.units), len(fields)
        for i, unit in enumerate(profile.units):
            for j, f in enumerate(fields):
                setattr(unit, f, values[i * k + j])
            unit.h_bytes = int(values[n * k + i])
            unit.l_bytes = int(values[n * k + n + i])
            unit.ff_bytes = int(values[n * k + 2 * n + i])
        profile.gc_peak_bytes = int(values[-1])
        return profile

    def _broadcast(self, plan: Plan) -> Plan:
        collective = self.runtime.collective
        return plan if collective is None else collective.broadcast_object(plan)

    def _device(self) -> torch.device:
        layer = self.runtime._layers[0].module
        param = next(layer.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _reset_step(self) -> None:
        self.alloc_s = 0.0
        self.step_stats = {"peak_bytes": None, "grad_error_est": [], "grad_error_measured": None}


def _row_states(frame, pos: int) -> list[str]:
    states = None
    for stored in frame.units[pos].stored:
        if stored.sliceable:
            states = stored.row_states()
            if "L" in states:
                return states
    return states or ["H"] * frame.batch


def _stores_all(bucket: Bucket) -> bool:
    """The bucket's plan keeps every unit whole (H): no memory is short (``keeps_whole``)."""
    return bucket.plan is not None and all(a == "H" for a in bucket.plan.actions.values())
