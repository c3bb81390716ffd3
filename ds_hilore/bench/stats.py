"""What the bench reads of ``engine.hilore.stats`` (the one place it reads them): the
warm-up work of a step (``step_work``) and what a report row shows of a run (``digest``).

NOTE [ Warm-up steps, from the stats ]
A step is a warm-up step when HiLoRe's planner worked on learning in it: a shape bucket was
profiled (its plan still ``None`` after the step: its microbatches ran all R under the op-level
meter) or planned (a plan appeared, or changed: the first plan, a re-plan after a plan's peak
was checked, after calibration, after leave-one-out dropped a layer); matched passes calibrated
the risk model (``calibration.microbatches`` or ``calibration.seconds`` moved); or leave-one-out
timed variants of a plan (a bucket with a plan that keeps some unit and no ``leave_one_out``
entry yet, while ``plan_validation_microbatches`` > 0: the entry appears when it ends, in the
step that ends it). The stats carry no flag saying leave-one-out is under way, nor one for a
plan whose peak is being checked without a re-plan: the first is derived as said, the second
is not seen (such a step runs the plan, metered). Nor do they say which bucket a step's
microbatches ran: a bucket still profiled, or still under leave-one-out, counts only for a step
whose sequence lengths fall in it, read off the bucket's name ("<sequences>x<length>", the
length rounded up to a power of two, as HiLoRe buckets shapes); a name read otherwise counts
for every step. Should the stats carry a ``"warm_up"`` entry (the step's warm-up work, e.g. a
list of kinds), it is read instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["KINDS", "digest", "step_work"]

# what HiLoRe's ``stats["warm_up"]`` names (NOTE [ Warm-up, counted ] in plan/scheduler.py)
KINDS = ("compile", "profiling", "planning", "calibration", "leave-one-out", "check",
         "unplanned")


def step_work(before: Mapping[str, Any] | None, after: Mapping[str, Any],
              validates: bool = True, lengths: list[int] | None = None) -> list[str]:
    """The kinds of warm-up work (``KINDS``) HiLoRe did in the step between two readings of
    its stats (``before``: None before the first step); [] for a steady step. ``validates``:
    the runtime's ``plan_validation_microbatches`` > 0 (leave-one-out runs); ``lengths``: the
    sequence lengths of the step's forwards (None: any bucket may have run)."""
    if "warm_up" in after:  # the runtime's own account, when it gives one
        work = after["warm_up"]
        return sorted(k for k, v in work.items() if v) if isinstance(work, Mapping) else list(work or [])
    before = before or {}
    plans_b, plans_a = before.get("plans") or {}, after.get("plans") or {}
    work = set()
    for key, plan in plans_a.items():
        if plan is None:
            if _ran(key, lengths):
                work.add("profiling")
        elif plans_b.get(key) is None or _actions(plans_b[key]) != _actions(plan):
            work.add("planning")
    calib_b, calib_a = before.get("calibration") or {}, after.get("calibration") or {}
    if any((calib_a.get(k) or 0) != (calib_b.get(k) or 0) for k in ("microbatches", "seconds")):
        work.add("calibration")
    loo_b, loo_a = before.get("leave_one_out") or {}, after.get("leave_one_out") or {}
    if set(loo_a) - set(loo_b):
        work.add("leave-one-out")
    if validates and any(plan is not None and key not in loo_a and _keeps(plan)
                         and _ran(key, lengths) for key, plan in plans_a.items()):
        work.add("leave-one-out")
    return [k for k in KINDS if k in work]


def _ran(key: str, lengths: list[int] | None) -> bool:
    """Whether a step of these sequence ``lengths`` ran bucket ``key`` (NOTE above)."""
    try:
        length = int(str(key).split("x")[1])
    except (IndexError, ValueError):
        return True
    return lengths is None or any(length == 1 << (max(1, t) - 1).bit_length() for t in lengths)


def _actions(plan: Mapping[str, Any]) -> dict[str, str]:
    return dict(plan.get("actions") or {})


def _keeps(plan: Mapping[str, Any]) -> bool:
    """The plan keeps some unit (leave-one-out validates such a plan)."""
    return any(a != "R" for a in _actions(plan).values())


def digest(stats: Mapping[str, Any]) -> dict[str, Any]:
    """What a report row shows of a HiLoRe run, from its last step's stats: the mix of actions
    (units x microbatches), bytes held per action, codec seconds, the allocator's own figures
    (None under ``force_plan``), its plan per shape bucket, unit by unit, the buckets that run as
    GC (``runs_as_gc``), and whether the step agreed nothing before its forwards
    (``steady_step``, None under ``force_plan``: NOTE [ A steady step agrees nothing before its
    forwards ] in plan/steady.py)."""
    actions = {a: n for a, n in (stats.get("actions") or {}).items() if n}
    allocator = None
    if stats.get("budget_bytes") is not None:
        allocator = {k: stats.get(k) for k in ("budget_bytes", "peak_bytes", "grad_error_est",
                                               "risk_budget")}
    plans = {key: dict(plan.get("actions") or {})
             for key, plan in (stats.get("plans") or {}).items() if plan is not None}
    return {"plan_mix": actions,
            "held_bytes": {a: n for a, n in (stats.get("bytes") or {}).items() if n},
            "pack_s": stats.get("pack_s"), "unpack_s": stats.get("unpack_s"),
            "allocator": allocator, "plans": plans or None,
            "runs_as_gc": stats.get("runs_as_gc"), "steady_step": stats.get("steady")}
