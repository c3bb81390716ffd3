"""What the scheduler (``ds_hilore.plan.scheduler.Scheduler``) reports and what a checkpoint
keeps of it: ``stats`` (merged into the runtime's ``stats``; the bench's rows), and the state
a resume restores (profiles, risk model, calibration; plans are made again from them)."""

from __future__ import annotations

from typing import Any

from ds_hilore.plan.buckets import Bucket
from ds_hilore.plan.profile import BucketProfile, Profiler
from ds_hilore.plan.risk import RiskModel, StepExposure
from ds_hilore.plan.slices import quartile_shares

__all__ = ["load_state_dict", "state_dict", "stats"]


def _name(key) -> str:
    return f"{key[0]}x{key[1]}"


def stats(scheduler) -> dict[str, Any]:
    """The last step's figures (or the step in progress'), every bucket's plan and profile,
    leave-one-out, ranking and calibration."""
    s = scheduler.last_stats or scheduler.step_stats
    est = _estimates(scheduler, s)
    bucket, buckets, passes = scheduler.bucket, scheduler.buckets, scheduler.passes
    return {"peak_bytes": s.get("peak_bytes"),
            "budget_bytes": bucket.budget_bytes if bucket else None,
            "budget_bound": bucket.budget_bound if bucket else None,
            "peak_exact": s.get("peak_exact"),
            "peak_reserved_bytes": s.get("peak_reserved_bytes"),
            "grad_error_est": est["step"],
            "grad_error_measured": s.get("grad_error_measured"),
            "grad_error_est_microbatch": est["microbatches"],
            "grad_error_measured_microbatch": s.get("grad_error_measured_microbatch"),
            "exposure_quartiles": quartile_shares(s.get("exposure_slices")),
            "predicted_microbatches": s.get("predicted_microbatches", 0),
            "warm_up": dict(s.get("warm_up") or {}),  # NOTE [ Warm-up, counted ] in scheduler.py
            "alloc_s": s.get("alloc_s", scheduler.alloc_s),
            # NOTE [ A steady step agrees nothing before its forwards ] in steady.py
            "steady": s.get("steady", scheduler.steady),
            # NOTE [ Never slower than GC ] in validate.py: the planned buckets run as GC
            "runs_as_gc": sorted(_name(k) for k, b in buckets.items()
                                 if b.plan is not None and scheduler._runs_as_gc(b, unpredicted=True)),
            "risk_budget": scheduler.config.grad_error_tolerance * scheduler.tighten,
            "plans": {_name(k): (b.plan.to_dict() if b.plan else None) for k, b in buckets.items()},
            "leave_one_out": {_name(k): {"utilities_s": b.loo_utilities,
                                         "recomputed_layers": sorted(b.excluded)}
                              for k, b in buckets.items() if b.loo_utilities is not None},
            "ranking": passes.ranking,
            "calibration": {"microbatches": scheduler.calibrated, "seconds": passes.seconds,
                            "dropped_nonfinite": passes.dropped, "pieces": passes.pieces,
                            "pass_peak_bytes": passes.peak_bytes,
                            "susceptibility": dict(scheduler.risk.to_dict()["samples"])},
            "profiles": {_name(k): (b.profile.to_dict() if b.profile else None)
                         for k, b in buckets.items()}}


def _estimates(scheduler, stats: dict) -> dict:
    """The step's estimate (sum of its risks, NOTE [ Risk in step units ] in risk.py) and each
    microbatch's own (relative to its gradient); for a step in progress, this rank's so far."""
    closed = stats.get("grad_error_est_step")
    if closed is not None:
        return {"step": closed["step"], "microbatches": list(stats.get("grad_error_est") or [])}
    mass = sum(scheduler.step_exposure.masses)
    step = sum(scheduler.step_exposure.risks) / mass if mass > 0 else None
    return {"step": step, "microbatches": list(stats.get("grad_error_est") or [])}


def state_dict(scheduler) -> dict[str, Any]:
    profiled = {k: b for k, b in scheduler.buckets.items() if b.profile}
    return {"risk": scheduler.risk.to_dict(), "tighten": scheduler.tighten,
            "calibrated": scheduler.calibrated, "calibration_draws": scheduler.calibration_draws,
            "step_exposure": scheduler.step_exposure.to_dict(),
            "profiles": [b.profile.to_dict() for b in profiled.values()],
            "excluded": {_name(k): sorted(b.excluded) for k, b in profiled.items()},
            "shortest": {_name(k): b.shortest for k, b in profiled.items() if b.shortest},
            "longest": {_name(k): b.longest for k, b in profiled.items() if b.longest},
            # a plan that peaked over the budget stays cut after a resume
            "headroom_cut": {_name(k): b.headroom_cut for k, b in profiled.items() if b.overshot},
            # leave-one-out still to run (saved while it ran): it runs again after a resume
            "unvalidated": [_name(k) for k, b in profiled.items() if not b.validated],
            # what leave-one-out decided stays decided: a shape that runs as GC (NOTE [ Never
            # slower than GC ] in validate.py), the bucket that timed the layers' variants and
            # those that took its verdict (NOTE [ A bucket learns from the others ] in profile.py)
            "gc_faster": [_name(k) for k, b in profiled.items() if b.gc_faster],
            "loo_layers": [_name(k) for k, b in profiled.items() if b.loo_layers],
            "source": {_name(k): list(b.source) for k, b in profiled.items()
                       if b.source is not None}}


def load_state_dict(scheduler, state: dict[str, Any]) -> None:
    """The saved state back, each saved bucket planned again from its profile (no profiling)."""
    scheduler.risk = RiskModel.from_dict(state.get("risk", {}))
    scheduler.tighten = float(state.get("tighten", 1.0))
    scheduler.calibrated = int(state.get("calibrated", 0))
    scheduler.calibration_draws = int(state.get("calibration_draws", scheduler.calibrated))
    scheduler.step_exposure = StepExposure.from_dict(state.get("step_exposure", {}))
    # NOTE [ A steady step agrees nothing before its forwards ] in steady.py: a run loaded
    # mid-way agrees again before it is steady, as a resumed one does
    scheduler.steady = scheduler.unsettled = False
    scheduler.unheld = scheduler.pending = 0
    for data in state.get("profiles", []):
        profile = BucketProfile.from_dict(data)
        name = _name(profile.key)
        bucket = Bucket(profile.key, Profiler(profile.key, 0), profile)
        bucket.excluded = set(state.get("excluded", {}).get(name, []))
        bucket.shortest = state.get("shortest", {}).get(name)
        bucket.longest = state.get("longest", {}).get(name)
        cut = state.get("headroom_cut", {}).get(name)
        if cut is not None:
            bucket.headroom_cut, bucket.overshot = int(cut), True
        bucket.validated = name not in state.get("unvalidated", [])
        bucket.gc_faster = bucket.validated and name in state.get("gc_faster", [])
        bucket.loo_layers = bucket.validated and name in state.get("loo_layers", [])
        source = state.get("source", {}).get(name)
        bucket.source = None if source is None else tuple(source)
        scheduler.buckets[profile.key] = bucket
        scheduler._plan_bucket(bucket, profiled=False)
        if not bucket.validated:
            scheduler._start_loo(bucket)
