"""Matched passes: the true gradient error of a plan, measured on a training microbatch.

NOTE [ Matched passes ]
A pass re-runs a microbatch's forward with a given plan and takes the gradient of the decoder
layers' trainable parameters with ``torch.autograd.grad`` from the gradient the training backward
brought to the last HiLoRe layer's output: a separate graph, so ``.grad`` and DeepSpeed's
reduction hooks are never touched, and the RNG is set to the microbatch's and restored after
(``fork_rng``), so training's stream is unchanged. The exact gradient comes from an all-R pass
(bitwise what no checkpointing gives). Passes run at the optimizer step, on the same steps on
every rank (the decision depends only on state every rank shares). A calibration or ranking
error is the max over ranks; the validated step's error is that of the gradient summed over
ranks (NOTE [ The step's error over ranks ]).

* Calibration (the first ``calibration_microbatches`` planned microbatches): one group of units
  (kind x depth half, cycling) has a random half of its packable units in L; the measured error
  over the sum of their codec errors is one susceptibility sample (risk.py).
* Ranking check (``Scheduler.hold_out()``, used by ``hilore profile --spearman``): every packable
  unit's less and more exposed half of the sequences in L alone; Spearman between predicted risk
  and measured error over those slices.
* Validation (every ``validation_interval`` steps): the plan every microbatch of the step really
  ran, after every downgrade; the error measured is the step's, |sum_r sum_m (g_m - g_m exact)| /
  |sum_r sum_m g_m exact| over the step's micro-steps m and ranks r (each microbatch's own, on
  its rank, is reported too); an error above ``grad_error_tolerance`` tightens the risk budget. The step's microbatches are
  kept for it (inputs, RNG state, the gradient at the last layer's output) until the step ends.

Both fit and measure the quantities of NOTE [ Risk in step units ] (risk.py): a calibration
sample is s = e_m / sum_u eps_u E_{u,S_u} / M_m, the predicted risk of a ranking slice is
s eps_u E_{u,S} / M_m (the measured e_m is relative to the microbatch's gradient).

Under ZeRO-3 the parameters are partitioned outside their modules' forward and backward, so
``autograd.grad`` on them is not available: passes are skipped (said once) and the risk model
keeps its prior.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from typing import Any

import torch

from ds_hilore.grpo import exposure
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
    mass: list | None = None  # M_i = sum_t |ω_{i,t}| per sequence (NOTE [ Risk in step units ])
    predicted: list | None = None  # the caller's predicted exposure per sequence (``expect``)


class MatchedPasses:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.running = False
        self.job: _Job | None = None
        self.seconds = 0.0  # what the passes cost so far
        self._zero3: bool | None = None  # parameters partitioned by ZeRO-3
        self._validated_step = -1
        self.dropped = 0  # passes whose exact gradient was not finite (NOTE [ Non-finite passes ])
        self.revalidate = False  # the last validation measured nothing: the next step validates
        self.hold_out = False  # the next planned microbatch is held out for a ranking check
        self.ranking: dict | None = None  # the last ranking check (see ``rank_slices``)
        self.step_jobs: list[_Job] = []  # the validated step's microbatches, in order

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
        elif (s.config.validation_interval and self._validated_step != s.steps
              and (self.revalidate or s.steps % s.config.validation_interval == 0)):
            kind = "validate"
        if kind is None:
            return
        cuda = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else None
        self.job = _Job(kind, tuple(args), dict(kwargs), torch.get_rng_state(), cuda, bucket)
        if kind == "validate":
            self.step_jobs.append(self.job)

    def top_grad(self, mb, grad: torch.Tensor) -> None:
        job = self.job
        if job is None or job.grad is not None:
            return
        job.grad = grad.detach().clone()  # (B, T, H)
        job.exposure = {name: values.tolist() for name, values in mb.exposure.items()}
        if mb.token_weights is not None:
            segments = mb.segments if mb.token_weights.shape[0] == 1 and mb.segments else None
            job.mass = exposure.row_mass(mb.token_weights, segments).tolist()
        job.predicted = (getattr(mb, "predicted", None) or (None,))[0]
        job.executed = {}
        for frame in mb.live_frames():
            for pos, unit in enumerate(frame.layer.units):
                action = frame.plan.actions[pos]
                states = None
                if action != "R":  # a storage with packed rows: an unpackable one stays H
                    sliced = [st.row_states() for st in frame.units[pos].stored if st.sliceable]
                    states = next((x for x in sliced if "L" in x), sliced[0] if sliced else None)
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
        step_jobs, self.step_jobs = [j for j in self.step_jobs if j.grad is not None], []
        if job is None or job.grad is None:
            return
        begin = time.perf_counter()
        s = self.scheduler
        exact = self._grads(job, "R", {})
        if job.kind == "hold_out":
            self.ranking = self._rank_slices(job, exact)
        elif job.kind == "calibrate":
            group, names, _ = self._calibration_subset(job.bucket)
            eps = _exposed_eps(job, names)
            approx = self._grads(job, {n: ("L" if n in names else "R") for n in job.executed}, {})
            error = self._agree(_rel_error(approx, exact))
            if not self._measured(error, "calibration", finite=True):  # the next one again
                self.seconds += time.perf_counter() - begin
                return
            s.risk.add(group, error, eps)
            s.calibrated += 1
        else:
            error = self._validate_step(step_jobs or [job], job, exact)
            self._validated_step = s.steps
            self.revalidate = not self._measured(error, "validation")
            if self.revalidate:
                s.step_stats["grad_error_measured"] = None
            elif error > s.config.grad_error_tolerance:  # inf included: the tightest budget
                s.tighten *= max(0.1, 0.8 * s.config.grad_error_tolerance / error)
                logger.warning("ds_hilore: measured gradient error %.4f exceeds grad_error_tolerance "
                               "%.4f; the risk budget is tightened to %.4f.", error,
                               s.config.grad_error_tolerance, s._risk_budget())
        s.replan()
        self.seconds += time.perf_counter() - begin

    def _validate_step(self, jobs: list[_Job], last: _Job, last_exact: list[torch.Tensor]) -> float:
        """The step's measured error over ``jobs`` (its microbatches; ``last``'s exact gradient
        already taken) and every rank's (``step_error``); each microbatch's own error reported
        too (this rank's)."""
        s = self.scheduler
        diff = exact_sum = None
        per_mb = []
        for job in jobs:
            exact = last_exact if job is last else self._grads(job, "R", {})
            actions, rows = {}, {}
            for name, (action, states) in job.executed.items():
                actions[name] = "H" if action != "R" else "R"
                if states is not None:  # elided rows are measured exactly (their gradient is 0)
                    rows[name] = tuple("H" if x == "E" else x for x in states)
            approx = self._grads(job, actions, rows)
            per_mb.append(_rel_error(approx, exact))
            delta = [a.double() - e.double() for a, e in zip(approx, exact)]
            diff = delta if diff is None else [d + x for d, x in zip(diff, delta)]
            exact_sum = [e.double() for e in exact] if exact_sum is None else \
                [t + e.double() for t, e in zip(exact_sum, exact)]
        error = self._agree(step_error(diff, exact_sum, s.runtime.collective))  # the same on every rank
        s.step_stats["grad_error_measured"] = error
        s.step_stats["grad_error_measured_microbatch"] = per_mb
        return error

    def _rank_slices(self, job: _Job, exact: list[torch.Tensor]) -> dict:
        """How well the risk model ranks measured error on a held-out microbatch: for every
        packable unit and each half of the sequences (the less and the more exposed), the error
        of a pass with only that slice in L against the predicted risk; Spearman over slices.
        Predicted: s eps_u E_{u,S} / M_m (complete exposure); ``spearman_advantage`` ranks by
        the caller's predicted exposure instead (|A_i| x tokens: advantage-only), when
        ``expect`` gave one for this microbatch."""
        s = self.scheduler
        costs = {c.name: c for c in job.bucket.profile.units}
        n_layers = 1 + max(c.layer for c in costs.values())
        batch = job.grad.shape[0]
        slices = []
        mass = sum(job.mass) if job.mass else 0.0
        adv = job.predicted if job.predicted and len(job.predicted) == batch else None
        for name, cost in costs.items():
            if cost.l_bytes >= cost.h_bytes or name not in job.executed:
                continue
            # a unit without token weights (not kept in the plan): the rows' mass M_i, as the
            # scheduler's risk falls back to (uniform activation weights)
            exposure = job.exposure.get(name) or \
                (job.mass if job.mass and len(job.mass) == batch else [1.0] * batch)
            order = sorted(range(batch), key=lambda i: exposure[i])
            halves = [order[:batch // 2], order[batch // 2:]] if cost.sliceable and batch > 1 else [order]
            for rows in halves:
                group = group_of(cost.kind, cost.layer, n_layers)
                exposed = sum(exposure[i] for i in rows) / mass if mass > 0 else share(exposure, rows)
                predicted = s.risk.risk(group, cost.rel_error, exposed)
                by_advantage = s.risk.risk(group, cost.rel_error, share(adv, rows)) if adv else None
                per_row = tuple("L" if i in rows else "H" for i in range(batch))
                actions = {n: ("H" if n == name else "R") for n in job.executed}
                measured = self._agree(_rel_error(self._grads(job, actions, {name: per_row}), exact))
                if not self._measured(measured, "ranking"):  # NOTE [ Non-finite passes ]
                    continue
                slices.append({"unit": name, "rows": rows, "predicted": predicted, "measured": measured,
                               "predicted_advantage": by_advantage})
        measured = [x["measured"] for x in slices]
        rho = spearman([x["predicted"] for x in slices], measured) if len(slices) > 1 else None
        rho_adv = spearman([x["predicted_advantage"] for x in slices], measured) \
            if adv and len(slices) > 1 else None
        return {"spearman": rho, "spearman_advantage": rho_adv, "slices": slices}

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
        """The max over ranks; NaN when any rank measured nothing, else inf when any rank's
        approximation was not finite (a max over NaN is not defined the same by every backend)."""
        collective = self.scheduler.runtime.collective
        if collective is None:
            return error
        finite = error if math.isfinite(error) else 0.0
        value, nan, inf = collective.all_reduce_max_float(
            [finite, float(math.isnan(error)), float(error == math.inf)])
        return math.nan if nan else math.inf if inf else value

    def _measured(self, error: float, what: str, finite: bool = False) -> bool:
        """False (the pass is dropped, counted and said once) when it measured nothing, or,
        ``finite``, when its error is not a number a sample can hold (NOTE [ Non-finite passes ])."""
        if not math.isnan(error) and not (finite and math.isinf(error)):
            return True
        self.dropped += 1
        if self.dropped == 1:
            logger.warning("ds_hilore: a %s pass was dropped: a gradient of its microbatch was "
                           "not finite (an overflowed step, e.g. fp16 loss scaling before its "
                           "scale settles); it is measured again on a later microbatch "
                           "(stats['calibration']['dropped_nonfinite'] counts these).", what)
        return False


def _exposed_eps(job: _Job, names) -> float:
    """sum_u eps_u E_{u,all} / M_m over the units packed whole (NOTE [ Risk in step units ]);
    a unit without token weights counts E_{u,all} = M_m."""
    mass = sum(job.mass) if job.mass else 0.0
    costs = {c.name: c for c in job.bucket.profile.units}
    total = 0.0
    for name in names:
        values = (job.exposure or {}).get(name)
        ratio = sum(values) / mass if values is not None and mass > 0 else 1.0
        total += costs[name].rel_error * ratio
    return total


def step_error(diff: list[torch.Tensor], exact: list[torch.Tensor], collective) -> float:
    """||sum_r D_r|| / ||sum_r G_r||: the relative error of the step's gradient over ranks.

    NOTE [ The step's error over ranks ]
    What the optimizer sees is the gradient summed over ranks (data parallel, then averaged:
    a scale the ratio does not see), so the error ``grad_error_tolerance`` bounds is
    ||sum_r D_r|| / ||sum_r G_r||, with D_r = sum_m (g_m - g_m exact) and G_r = sum_m g_m exact
    of rank r's micro-steps. Neither the max of the ranks' own errors nor a sum of their
    squared norms is that: ||sum_r D_r||^2 = sum_r ||D_r||^2 + sum_{r != s} <D_r, D_s>, and
    the cross terms (errors that cancel or add up over ranks) need the vectors. So D and G
    themselves are summed over ranks, tensor by tensor in fp64 (every rank holds the whole
    decoder gradient here: passes do not run under ZeRO-3), and the norms taken after; every
    rank then computes the same value. Validation runs every ``validation_interval`` steps,
    so this all-reduce of one gradient (twice) is rare.

    Args:
        diff, exact: this rank's D and G, one fp64 tensor per parameter; summed in place.
        collective: ``runtime.collective`` (None on one process): ``all_reduce_sum_tensor``
            (in place) where it has one, else its list form ``all_reduce_sum``.
    """
    tensors = [*diff, *exact]
    if collective is not None:
        _sum_over_ranks(tensors, collective)
    num = sum(float(d.pow(2).sum()) for d in diff)
    den = sum(float(e.pow(2).sum()) for e in exact)
    return _ratio(num, den)


def _sum_over_ranks(tensors: list[torch.Tensor], collective) -> None:
    """Every tensor summed over ranks, in place, in the same order on every rank."""
    reduce = getattr(collective, "all_reduce_sum_tensor", None)
    if reduce is not None:
        for t in tensors:
            reduce(t)
        return
    flat = torch.cat([t.detach().flatten().double().cpu() for t in tensors])  # (n,) a stand-in's list form
    summed = torch.tensor(collective.all_reduce_sum(flat.tolist()), dtype=torch.float64)
    offset = 0
    for t in tensors:
        t.copy_(summed[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _rel_error(approx: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """||g - g_exact|| / ||g_exact|| over every trainable parameter of the decoder layers
    (NOTE [ Non-finite passes ]: NaN when the exact gradient is not finite)."""
    num = sum(float((a.double() - e.double()).pow(2).sum()) for a, e in zip(approx, exact))
    den = sum(float(e.double().pow(2).sum()) for e in exact)
    return _ratio(num, den)


# NOTE [ Non-finite passes ]
# A matched pass on a microbatch whose backward overflowed (fp16 loss scaling in the first
# steps, exactly when calibration runs) has a non-finite exact gradient: it measures nothing.
# Its error is NaN -- never 0, which would read as "packing is free", and never stored, which
# would make every later risk NaN and the knapsack refuse -- and the pass is dropped, counted
# (``dropped_nonfinite``) and run again on a later microbatch. An exact gradient that is finite
# with an approximation that is not is a real, unbounded error: inf, which tightens the risk
# budget as far as it goes (and is never a calibration sample: s = inf would make 0 x inf).
def _ratio(num: float, den: float) -> float:
    """sqrt(num / den) of squared norms: NaN when ``den`` is not finite, inf when ``num`` is
    not (or when ``den`` is 0 and ``num`` is not), 0 when both are 0."""
    if not math.isfinite(den):
        return math.nan
    if not math.isfinite(num):
        return math.inf
    if den > 0:
        return (num / den) ** 0.5
    return 0.0 if num == 0 else math.inf
