"""Matched passes: the true gradient error of a plan, measured on a training microbatch.

NOTE [ Matched passes ]
A pass re-runs a microbatch's forward with a given plan and takes the gradient of the decoder
layers' trainable parameters with ``torch.autograd.grad`` from the gradient the training backward
brought to the last HiLoRe layer's output: a separate graph, so ``.grad`` and DeepSpeed's
reduction hooks are never touched, and the RNG is set to the microbatch's and restored after
(``fork_rng``), so training's stream is unchanged. The exact gradient comes from an all-R pass
(bitwise what no checkpointing gives). Passes run at the optimizer step, on the same steps on
every rank (the decision depends only on state every rank shares), and the measured error is
the max over ranks.

* Calibration (the first ``calibration_microbatches`` planned microbatches): one group of units
  (kind x depth half, cycling) has a random half of its packable units in L; the measured error
  over the sum of their codec errors is one susceptibility sample (risk.py).
* Ranking check (``Scheduler.hold_out()``, used by ``hilore profile --spearman``): every packable
  unit's less and more exposed half of the sequences in L alone; Spearman between predicted risk
  and measured error over those slices.
* Validation (every ``validation_interval`` steps): the plan the microbatch really ran, after
  every downgrade; an error above ``grad_error_tolerance`` tightens the risk budget.

Under ZeRO-3 the parameters are partitioned outside their modules' forward and backward, so
``autograd.grad`` on them is not available: passes are skipped (said once) and the risk model
keeps its prior.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any

import torch

from ds_hilore.plan.risk import group_of, share, spearman

logger = logging.getLogger("ds_hilore")


@dataclasses.dataclass
class _Job:
    kind: str  # "calibrate" | "validate"
    args: tuple
    kwargs: dict
    rng: torch.Tensor
    cuda_rng: list | None
    bucket: Any
    grad: torch.Tensor | None = None
    executed: dict | None = None  # unit -> (action, row states) as the microbatch ran
    exposure: dict | None = None  # unit -> E_{u,i} per sequence of the microbatch (held-out)


class MatchedPasses:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.running = False
        self.job: _Job | None = None
        self.seconds = 0.0  # what the passes cost so far
        self._zero3: bool | None = None  # parameters partitioned by ZeRO-3
        self._validated_step = -1
        self.hold_out = False  # the next planned microbatch is held out for a ranking check
        self.ranking: dict | None = None  # the last ranking check (see ``rank_slices``)

    # ------------------------------------------------------------------ selection
    def begin_forward(self, args, kwargs, bucket) -> None:
        s = self.scheduler
        self.job = None
        if bucket.plan is None or not self._supported():
            return
        kind = None
        if self.hold_out and s.runtime._codec is not None:
            kind, self.hold_out = "hold_out", False
        elif s.calibrated < s.config.calibration_microbatches and s.runtime._codec is not None:
            kind = "calibrate"
        elif (s.config.validation_interval and s.steps % s.config.validation_interval == 0
              and self._validated_step != s.steps):
            kind = "validate"
        if kind is None:
            return
        cuda = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else None
        self.job = _Job(kind, tuple(args), dict(kwargs), torch.get_rng_state(), cuda, bucket)

    def top_grad(self, mb, grad: torch.Tensor) -> None:
        job = self.job
        if job is None or job.grad is not None:
            return
        job.grad = grad.detach().clone()  # (B, T, H)
        job.exposure = {name: values.tolist() for name, values in mb.exposure.items()}
        job.executed = {}
        for frame in mb.live_frames():
            for pos, unit in enumerate(frame.layer.units):
                action = frame.plan.actions[pos]
                states = None
                if action != "R":
                    states = next((st.row_states() for st in frame.units[pos].stored if st.sliceable), None)
                job.executed[unit.name] = (action, states)

    def _supported(self) -> bool:
        """False under ZeRO-3 (partitioned parameters); decided once, not per microbatch."""
        if self._zero3 is None:
            layers = self.scheduler.runtime._layers
            self._zero3 = any(hasattr(p, "ds_id") for layer in layers for p in layer.module.parameters())
            if self._zero3:
                logger.info("ds_hilore: matched passes (calibration, validation) are skipped under "
                            "ZeRO-3; the risk model keeps its prior.")
        return not self._zero3

    # ------------------------------------------------------------------ at the step
    def run(self) -> None:
        job, self.job = self.job, None
        if job is None or job.grad is None:
            return
        begin = time.perf_counter()
        s = self.scheduler
        exact = self._grads(job, "R", {})
        if job.kind == "hold_out":
            self.ranking = self._rank_slices(job, exact)
        elif job.kind == "calibrate":
            group, names, eps = self._calibration_subset(job.bucket)
            approx = self._grads(job, {n: ("L" if n in names else "R") for n in job.executed}, {})
            error = self._agree(_rel_error(approx, exact))
            s.risk.add(group, error, eps)
            s.calibrated += 1
        else:
            actions, rows = {}, {}
            for name, (action, states) in job.executed.items():
                actions[name] = "H" if action != "R" else "R"
                if states is not None:  # elided rows are measured exactly (their gradient is 0)
                    rows[name] = tuple("H" if x == "E" else x for x in states)
            approx = self._grads(job, actions, rows)
            error = self._agree(_rel_error(approx, exact))
            s.step_stats["grad_error_measured"] = error
            self._validated_step = s.steps
            if error > s.config.grad_error_tolerance:
                s.tighten *= max(0.1, 0.8 * s.config.grad_error_tolerance / error)
                logger.warning("ds_hilore: measured gradient error %.4f exceeds grad_error_tolerance "
                               "%.4f; the risk budget is tightened to %.4f.", error,
                               s.config.grad_error_tolerance, s._risk_budget())
        s.replan()
        self.seconds += time.perf_counter() - begin

    def _rank_slices(self, job: _Job, exact: list[torch.Tensor]) -> dict:
        """How well the risk model ranks measured error on a held-out microbatch: for every
        packable unit and each half of the sequences (the less and the more exposed), the error
        of a pass with only that slice in L against the predicted risk; Spearman over slices."""
        s = self.scheduler
        costs = {c.name: c for c in job.bucket.profile.units}
        n_layers = 1 + max(c.layer for c in costs.values())
        batch = job.grad.shape[0]
        slices = []
        for name, cost in costs.items():
            if cost.l_bytes >= cost.h_bytes or name not in job.executed:
                continue
            exposure = job.exposure.get(name) or [1.0] * batch
            order = sorted(range(batch), key=lambda i: exposure[i])
            halves = [order[:batch // 2], order[batch // 2:]] if cost.sliceable and batch > 1 else [order]
            for rows in halves:
                predicted = s.risk.risk(group_of(cost.kind, cost.layer, n_layers), cost.rel_error,
                                        share(exposure, rows))
                per_row = tuple("L" if i in rows else "H" for i in range(batch))
                actions = {n: ("H" if n == name else "R") for n in job.executed}
                measured = self._agree(_rel_error(self._grads(job, actions, {name: per_row}), exact))
                slices.append({"unit": name, "rows": rows, "predicted": predicted, "measured": measured})
        rho = spearman([x["predicted"] for x in slices], [x["measured"] for x in slices]) \
            if len(slices) > 1 else None
        return {"spearman": rho, "slices": slices}

    def _calibration_subset(self, bucket) -> tuple[str, set[str], float]:
        s = self.scheduler
        costs = [c for c in bucket.profile.units if c.l_bytes < c.h_bytes]
        n_layers = 1 + max(c.layer for c in bucket.profile.units)
        # kinds alternate (attn:low, mlp:low, attn:high, ...): few passes still cover each kind
        groups = sorted({group_of(c.kind, c.layer, n_layers) for c in costs},
                        key=lambda g: (g.split(":")[1] != "low", g))
        if not groups:
            return "", set(), 0.0
        group = groups[s.calibrated % len(groups)]
        members = [c for c in costs if group_of(c.kind, c.layer, n_layers) == group]
        chosen = random.Random(s.calibrated).sample(members, max(1, len(members) // 2))
        return group, {c.name for c in chosen}, sum(c.rel_error for c in chosen)

    def _grads(self, job: _Job, actions, rows) -> list[torch.Tensor]:
        runtime = self.scheduler.runtime
        last = next(layer for layer in runtime._layers if layer.index == runtime._last_active)
        params = [p for layer in runtime._layers for p in layer.module.parameters() if p.requires_grad]
        captured = {}
        handle = last.module.register_forward_hook(lambda m, a, out: captured.setdefault("h", out))
        saved = (dict(runtime._plan), dict(runtime._rows), runtime._plan_source)
        devices = list(range(torch.cuda.device_count())) if job.cuda_rng is not None else []
        self.running = True
        try:
            with torch.random.fork_rng(devices=devices), runtime.shadow():
                torch.set_rng_state(job.rng)
                for d, state in zip(devices, job.cuda_rng or []):
                    torch.cuda.set_rng_state(state, d)
                runtime.apply_plan(actions, rows)
                runtime.model(*job.args, **job.kwargs)
                hidden = captured["h"]
                hidden = hidden if isinstance(hidden, torch.Tensor) else next(
                    x for x in hidden if isinstance(x, torch.Tensor))
                grads = torch.autograd.grad(hidden, params, grad_outputs=job.grad, allow_unused=True)
        finally:
            self.running = False
            handle.remove()
            runtime._plan, runtime._rows, runtime._plan_source = saved
        return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]

    def _agree(self, error: float) -> float:
        collective = self.scheduler.runtime.collective
        return error if collective is None else collective.all_reduce_max_float([error])[0]


def _rel_error(approx: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """||g - g_exact|| / ||g_exact|| over every trainable parameter of the decoder layers."""
    num = sum(float((a.double() - e.double()).pow(2).sum()) for a, e in zip(approx, exact))
    den = sum(float(e.double().pow(2).sum()) for e in exact)
    return (num / den) ** 0.5 if den > 0 else 0.0
