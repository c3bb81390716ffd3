"""What HiLoRe decides: per shape bucket, which units are stored (H), packed (L), split by
sequence or recomputed (R), within a memory budget and a gradient-error budget.

    profile.py       what each unit costs, measured on the running model (NOTE [ Profiling ])
    risk.py          how much gradient error packing adds, calibrated from matched passes
    calibrate.py     the matched passes (NOTE [ Matched passes ])
    pass_runner.py   one pass, in pieces that fit (NOTE [ What a pass holds ])
    grad_error.py    their arithmetic on gradients: norms, relative errors, the step's over ranks
    zero3_passes.py  a pass under ZeRO-3 (NOTE [ Matched passes under ZeRO-3 ])
    knapsack.py      the two-constraint multiple-choice knapsack (pure)
    allocate.py      a bucket's plan from its profile (pure)
    scheduler.py     the per-microbatch pipeline (NOTE [ One microbatch ])
    buckets.py       a shape bucket, priced for its longest length
    prediction.py    a prediction's rows: agreed over ranks, run apart, the plan re-solved for them
    slices.py        a microbatch's unit-sequence slices: their risk, the exposure quartiles
    metering.py      the scheduler's memory windows: GC's profiled peak, memory that appears
    checks.py        ... a plan's peak checked against the budget at its microbatch's length
"""

from __future__ import annotations

from typing import Mapping

import torch.nn as nn

from ds_hilore.config import HiLoReConfig
from ds_hilore.runtime import HiLoReRuntime
from ds_hilore.runtime import attach as attach_runtime

__all__ = ["attach"]


def attach(model: nn.Module, config: HiLoReConfig | Mapping | str | None = None) -> HiLoReRuntime:
    """Make HiLoRe the activation checkpointing of ``model``, deciding by itself.

    The runtime (``ds_hilore.runtime.attach``) plus the scheduler that plans every microbatch
    within ``memory_budget`` and ``grad_error_tolerance``. With ``force_plan`` one action, the
    plan is fixed and nothing is measured or allocated; a ``force_plan`` mapping pins the units
    it matches and leaves the others to the scheduler (the pinned ones are measured as they run).

    Args / Returns / Raises: as ``ds_hilore.runtime.attach``.
    """
    from ds_hilore.plan.scheduler import Scheduler

    runtime = attach_runtime(model, config)
    if runtime.attached and not isinstance(runtime.config.force_plan, str):
        runtime.policy = Scheduler(runtime)
    return runtime
