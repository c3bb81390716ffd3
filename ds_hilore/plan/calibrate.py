"""Matched passes: the true gradient error of a plan, measured on a training microbatch.

``MatchedPasses`` picks the microbatches to measure and runs the passes over them, in pieces
where memory is short; ``Scheduler`` (scheduler.py) owns one and calls it at ``begin_forward``,
``top_grad`` and ``end_step``. The passes' arithmetic on gradients is in grad_error.py, what
keeps them from changing ZeRO-3's state in zero3_passes.py.

NOTE [ Matched passes ]
A pass re-runs a microbatch's forward with a given plan and takes the gradient of the decoder
layers' trainable parameters with ``torch.autograd.grad`` from the gradient the training backward
brought to the last HiLoRe layer's output: a separate graph, so ``.grad`` and DeepSpeed's
reduction hooks (post-accumulate-grad hooks, which ``autograd.grad`` does not run) are never
touched, and the RNG is set to the microbatch's and restored after (``fork_rng``), so
training's stream is unchanged. The exact gradient comes from an all-R pass (bitwise what no
checkpointing gives). Passes run at the optimizer step, on the same steps on every rank (the
decision depends only on state every rank shares). A calibration error is the max over ranks
(or each rank's own: NOTE [ Calibration spread over ranks ]), a ranking error the max; the
validated step's error is that of the gradient summed over ranks (NOTE [ The step's error over
ranks ] in grad_error.py). What a pass holds is bounded (NOTE [ What a pass
holds ] in pass_runner.py); under ZeRO-3 passes gather parameters as training does and leave DeepSpeed's state as
they found it (NOTE [ Matched passes under ZeRO-3 ] in zero3_passes.py).

* Calibration (the first ``calibration_microbatches`` planned microbatches): one group of units
  (kind x depth half, cycling) has a random half of its packable units in L; the measured error
  over the sum of their codec errors is one susceptibility sample (risk.py); under ZeRO 0-2
  each rank samples a group of its own (NOTE [ Calibration spread over ranks ]).
* Ranking check (``Scheduler.hold_out()``, used by ``hilore profile --spearman``): every packable
  unit's less and more exposed half of the sequences in L alone; Spearman between predicted risk
  and measured error over those slices.
* Validation (every ``validation_interval`` steps): the plan every microbatch of the step really
  ran, after every downgrade; the error measured is the step's, |sum_r sum_m (g_m - g_m exact)| /
  |sum_r sum_m g_m exact| over the step's micro-steps m and ranks r (each microbatch's own, on
  its rank, is reported too); an error above ``grad_error_tolerance`` tightens the risk budget.
  The step's microbatches are kept for it (inputs, RNG state, the gradient at the last layer's
  output) until the step ends.

Both fit and measure the quantities of NOTE [ Risk in step units ] (risk.py): a calibration
sample is s = e_m / sum_u eps_u E_{u,S_u} / M_m, the predicted risk of a ranking slice is
s eps_u E_{u,S} / M_m (the measured e_m is relative to the microbatch's gradient).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import time
from typing import Any

import torch

from ds_hilore.grpo import exposure
from ds_hilore.plan.grad_error import accumulator, minus, numel, ratio, squared, summed_norms
from ds_hilore.plan.grad_error import rel_error as _rel_error  # noqa: F401 (importable here)
from ds_hilore.plan.grad_error import step_error  # noqa: F401 (importable here)
from ds_hilore.plan.pass_runner import PassRunner
from ds_hilore.plan.risk import group_of, share, spearman
from ds_hilore.runtime.memory import DevicePeak, in_use_bytes

logger = logging.getLogger("ds_hilore")


@dataclasses.dataclass
class _Job:
    kind: str  # "calibrate" | "validate" | "hold_out"
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
    # NOTE [ The exact gradient from training ]: the microbatch runs exact and its gradient
    # of the decoder layers' parameters, as the training backward makes it, is the exact one
    capture: bool = False
    exact: dict | None = None  # parameter position -> its exact gradient, as captured
    measured: list | None = None  # what ``_calibration`` measured at the end of its backward
    first: int = 0  # the pass's first draw: rank r's is first + r where the ranks calibrate
    spread: int = 1  # a group each, ``spread`` of them (NOTE [ Calibration spread over ranks ])

    def index(self, rank: int) -> int:
        """The draw ``rank`` calibrates in this pass."""
        return self.first + (rank if self.spread > 1 else 0)


def _scaled(bucket, cost, nbytes: float) -> float:
    """``nbytes`` of one of ``cost``'s forms (its H or L bytes, as profiled) at the bucket's
    byte scale (its longest length)."""
    return nbytes * (bucket.byte_scale or {}).get(cost.kind, 1.0)


class MatchedPasses(PassRunner):
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.running = False
        self.job: _Job | None = None
        self.seconds = 0.0  # what the passes cost so far
        # DeepSpeed's ZeRO-3 parameter offload (``engine.optimizer.parameter_offload``), given by
        # the engine integration: passes under ZeRO-3 gather through it (NOTE [ Matched passes
        # under ZeRO-3 ] in zero3_passes.py); a ZeRO-3 model attached without it gets no passes
        self.zero3_offload = None
        self._zero3: bool | None = None  # parameters partitioned by ZeRO-3
        self._validated_step = -1
        # passes whose exact gradient was not finite (NOTE [ Non-finite passes ] in grad_error.py)
        self.dropped = 0
        self.revalidate = False  # the last validation measured nothing: the next step validates
        self.hold_out = False  # the next planned microbatch is held out for a ranking check
        self.ranking: dict | None = None  # the last ranking check (see ``rank_slices``)
        self.step_jobs: list[_Job] = []  # the validated step's microbatches, in order
        self.pieces = 0  # the most pieces a pass ran in (NOTE [ What a pass holds ])
        # NOTE [ Calibration that cannot change a plan ]: decided again only after a plan
        # changed (``Scheduler._plan_bucket`` clears it), not per microbatch
        self.settled: bool | None = None
        self.said_settled = False
        self.peak_bytes: int | None = None  # the highest in-use reading during passes
        self._meter: DevicePeak | None = None  # CUDA: the window of the passes in progress
        self._peak_now = 0  # CPU: the highest reading of the passes in progress
        self._warned_pieces = False
        self.fresh = False  # the forward in progress owns ``job`` (``begin_forward``)
        self._capture_bytes: int | None = None  # one gradient of the layers' trainable parameters
        self._layer_capture_bytes = 0  # the same, of the layer with the most
        self.token_bytes: int | None = None  # a layer's input per position (B x T rows), once seen
        self.hidden_states_recorded = False  # a forward recorded every layer's output (``_capture``)
        # microbatches the next calibration was put off (NOTE [ Calibrated where cheap ])
        self.deferred = 0

    # ------------------------------------------------------------------ selection
    def begin_forward(self, args, kwargs, bucket, replayable: bool = True) -> bool:
        """Choose the matched pass of the forward beginning now, if any. Returns True when its
        microbatch must run exact (NOTE [ The exact gradient from training ]). The step's
        first microbatch that calibrates, once its backward came, is the step's calibration:
        later forwards of the step get no job."""
        s = self.scheduler
        self.fresh = False
        if self.job is not None and self.job.kind == "calibrate" and self.job.grad is not None:
            return False
        self.job = None
        if not replayable or bucket.plan is None or not self._supported():
            return False
        kind = None
        if self.hold_out and s.runtime._codec is not None:
            kind, self.hold_out = "hold_out", False
        elif s.calibrated < s.config.calibration_microbatches and s.runtime._codec is not None \
                and not self._settled():
            kind = "calibrate" if self._cheap_here(bucket) else None
        elif (s.config.validation_interval and self._validated_step != s.steps
              and (self.revalidate or s.steps % s.config.validation_interval == 0)):
            kind = "validate"
        if kind is None:
            return False
        cuda = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else None
        capture = kind == "calibrate" and self._capture_fits(bucket)
        self.job = _Job(kind, tuple(args), dict(kwargs), torch.get_rng_state(), cuda, bucket,
                        capture=capture)
        if kind == "calibrate":  # NOTE [ Calibration spread over ranks ]
            self.job.spread = self._spread()
            self.job.first = s.calibrated if self.job.spread == 1 else \
                max(s.calibration_draws, s.calibrated)
        self.fresh = True
        if kind == "validate":
            self.step_jobs.append(self.job)
        return capture

    def due(self) -> bool:
        """Whether a forward of the step beginning may be chosen for a pass (as ``begin_forward``
        chooses): a hold-out asked for, a calibration left, a validation due at this step."""
        s = self.scheduler
        codec = s.runtime._codec is not None
        return self.job is not None or (self.hold_out and codec) or (
            s.calibrated < s.config.calibration_microbatches and codec and not self._settled()) \
            or bool(s.config.validation_interval and self._validated_step != s.steps and (
                self.revalidate or s.steps % s.config.validation_interval == 0))

    # NOTE [ Calibrated where cheap ]
    # A calibration costs its microbatch a forward and a backward of the decoder layers (the
    # matched pass), so its price grows with the microbatch's tokens: on a run whose steps vary
    # over 128, 256 and 512 positions (2-core CPU, 2 ranks), the step at 512 that calibrated cost
    # 6.0 s more than GC's, those at 256 about 2 s, the one at 128 1.2 s (each with some planning
    # in it). What it measures does not depend on the length: a sample is the error over the
    # predicted risk, both relative to the microbatch's own gradient (NOTE [ Risk in step units ]
    # in risk.py), and it is pooled per unit group, not per bucket. So a microbatch calibrates
    # only in a planned bucket of the shortest length met so far (over every bucket, planned or
    # not, but those that run as GC and never calibrate: NOTE [ Never slower than GC ] in
    # validate.py; by the keys and verdicts every rank agreed on, so the same choice on every
    # rank); one of a longer bucket puts the calibration off -- each calibration at most
    # ``DEFER_AT_MOST`` microbatches, so that a short shape met once, or rarely, cannot hold
    # calibration off for long.
    DEFER_AT_MOST = 16

    def _cheap_here(self, bucket) -> bool:
        """Whether ``bucket``'s microbatch may calibrate now (NOTE [ Calibrated where cheap ])."""
        lengths = [b.key[1] for b in self.scheduler.buckets.values() if not b.gc_faster]
        shortest = min(lengths, default=bucket.key[1])
        if bucket.key[1] <= shortest or self.deferred >= self.DEFER_AT_MOST:
            self.deferred = 0
            return True
        self.deferred += 1
        return False

    # NOTE [ Calibration that cannot change a plan ]
    # Calibration samples the gradient error that packing adds, per unit group, so that the
    # plans spend the error budget where it buys the most. A plan changes with those samples
    # only where the budget binds it. When planning a bucket the scheduler also asks the
    # knapsack for the plan without any error budget (what memory and time alone choose): if it
    # is the plan chosen and its estimated error is under 1/SETTLE of the budget, the plan stays
    # the same under any susceptibility up to SETTLE times the one estimated (each group's error
    # grows at most that much; a smaller one frees nothing the plan wants), ``error_slack``. So
    # once each kind of unit has a sample (the groups of a kind differ by less than their kinds
    # do: on paper-cpu attention's samples ran 0.12-0.23, the MLP's 0.27-0.35) and every planned
    # bucket has that slack, the calibrations left are not run (a 2-core CPU run at 128
    # positions paid about 1 s for each, half a step); a bucket planned later without it starts
    # them again. Validation (``validation_interval``) runs as after a full calibration. The
    # same on every rank: rank 0 decides the slack with the plan, the samples are agreed.
    # ``hilore profile`` runs every calibration asked for (SETTLE None).
    SETTLE: float | None = 4.0

    def _settled(self) -> bool:
        """Whether no calibration left could change a plan (NOTE [ Calibration that cannot
        change a plan ]); said once."""
        if self.settled is not None:
            return self.settled
        s = self.scheduler
        buckets = [b for b in s.buckets.values() if b.plan is not None and not b.gc_faster]
        kinds = {c.kind for b in buckets for c in b.profile.units if c.l_bytes < c.h_bytes}
        sampled = {group.split(":")[0] for group, values in s.risk.samples.items() if values}
        self.settled = self.SETTLE is not None and s.calibrated >= 1 and bool(buckets) and \
            kinds <= sampled and all(b.error_slack for b in buckets)
        if self.settled and not self.said_settled:
            self.said_settled = True
            logger.info("ds_hilore: calibration stops after %d of %d microbatches: every plan's "
                        "estimated error (at most %.4f) is under 1/%g of the budget %.4f, where "
                        "more samples cannot change it.", s.calibrated,
                        s.config.calibration_microbatches, max(b.plan.risk for b in buckets),
                        self.SETTLE, s._risk_budget())
        return self.settled

    # NOTE [ When the exact gradient is captured ]
    # The capture (NOTE [ The exact gradient from training ]) holds one copy of the decoder
    # layers' trainable gradients, made layer by layer as the training backward comes down.
    # The microbatch's memory is highest where its backward begins, every layer's saved tensors
    # alive and nothing captured yet; each layer's backward then frees what the layer saved --
    # its input at least, which gradient checkpointing keeps too -- and captures the layer's
    # gradients. So where no layer's trainable gradients are larger than its input (LoRA, or
    # full fine-tuning on long enough microbatches), the capture never takes the backward
    # above where it began but for the layer in progress, whose gradients are made before its
    # saved tensors go; and that one is covered where the largest layer's gradients are no
    # more than the packed bytes the microbatch does not keep (it runs its packed units
    # recomputed: NOTE [ The exact gradient from training ]) -- the bucket's plan, so not where
    # every rank handed over a prediction, which may re-solve it to spend what the zero rows
    # leave (NOTE [ Freed memory is spent ] in prediction.py). Else the capture is taken only
    # where the whole of it is small against GC's activations (1/16), and the two-pass form
    # runs at the optimizer step otherwise. Reading the first rule from the activations alone
    # sent a LoRA model's 128-position bucket (its gradients 2.75 MiB, 1/16 of its activations
    # less) to the two-pass form at the step, where the budget had no room for a pass in one
    # piece: 8 pieces, 12.9 s for a calibration against 1.2 s captured (2-core CPU, 2 ranks).
    # Decided from what every rank agrees on (the profile, the plan, the shortest length over
    # ranks, whether every rank predicted): the capture's pass ends in an all-reduce. A rank
    # with fewer sequences than the bucket's most frees less per layer than reckoned, but its
    # plan is priced for the most, and the sequences it lacks leave more room than that.
    def _capture_fits(self, bucket) -> bool:
        """Whether the calibration microbatch captures its exact gradient from the training
        backward (NOTE [ When the exact gradient is captured ])."""
        if self._zero3:  # its gathers are DeepSpeed's own inside a backward: the two-pass form
            return False
        if self.hidden_states_recorded:  # the training gradient is not the pass's (``_capture``)
            return False
        if self._capture_bytes is None:
            groups = self._layer_params()
            self._capture_bytes = sum(numel(p) * p.element_size() for g in groups for p in g)
            self._layer_capture_bytes = max((sum(numel(p) * p.element_size() for p in g)
                                             for g in groups), default=0)
        if not self._capture_bytes:
            return False
        profile = bucket.profile
        activations = max(0, profile.gc_peak_bytes - profile.baseline_bytes) if profile else 0
        if self._capture_bytes <= activations // 16:
            return True
        s = self.scheduler
        if s.rows_agreed[0] < 1.0:  # a prediction on every rank: the plan may be re-solved
            return False
        layer = self._layer_capture_bytes
        tokens = bucket.key[0] * s.shortest
        return bool(self.token_bytes) and layer <= tokens * self.token_bytes and \
            layer <= self._packed_bytes(bucket)

    @staticmethod
    def _packed_bytes(bucket) -> float:
        """The bytes of the plan's packed units, at the bucket's byte scale."""
        if bucket.plan is None or bucket.profile is None:
            return 0.0
        actions = bucket.plan.actions
        return sum(_scaled(bucket, cost, cost.l_bytes) for cost in bucket.profile.units
                   if actions.get(cost.name) == "L")

    def top_grad(self, mb, grad: torch.Tensor) -> None:
        """``mb``'s backward reached its last layer: its gradient there goes to the pass chosen
        at its own forward (``mb.pass_job``), never to a later forward's (a forward with grad
        between a microbatch's forward and its backward, e.g. a reference model's that is never
        backpropagated): that job is the one the step's passes then run."""
        if self.token_bytes is None and grad.dim() >= 3 and grad.numel():  # (..., B, T, H)
            rows = max(1, grad.shape[-3] * grad.shape[-2])
            self.token_bytes = grad.element_size() * grad.numel() // rows
        job = mb.pass_job
        if job is None or job.grad is not None:
            return
        self.job = job
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
        if job.capture:
            self._capture(job, mb)

    def _capture(self, job: _Job, mb) -> None:
        """NOTE [ The exact gradient from training ]
        A calibration pass compares a gradient with some units in L against the exact one. The
        exact one need not be a pass of its own: the microbatch chosen for calibration runs its
        plan with every packed unit recomputed instead (H, R and E are exact), and a hook on
        each trainable parameter of the decoder layers keeps the gradient the training backward
        hands it (before it is accumulated: this microbatch's alone, whatever DeepSpeed's hooks
        do next). At the optimizer step a single pass -- the units of the calibration subset in
        L, the others as the microbatch ran them -- is compared with it as its gradients arrive.
        That halves the passes, and the pass stops at the last HiLoRe layer (no LM head, no
        logits: NOTE [ A pass stops at the last layer ] in pass_runner.py), so a calibration costs about one
        forward and backward of the decoder layers. Held from the backward to the step: one
        gradient of the layers' trainable parameters, taken only where that is small
        (``_capture_fits``). Where the layers' parameters get gradient from anywhere but the
        last layer's output (hidden states recorded for the loss), the training gradient is not
        the pass's exact gradient: the two-pass form runs instead, and from then on the
        calibration microbatches are not run exact for a capture (the training script's forward
        is the same each step)."""
        if any(frame.check_every_layer for frame in mb.live_frames()):
            job.capture = False
            self.hidden_states_recorded = True
            return
        params = [p for g in self._layer_params() for p in g]
        job.exact = {}
        handles = [p.register_hook(functools.partial(self._keep_exact, job, i))
                   for i, p in enumerate(params)]

        def measure():
            for handle in handles:
                handle.remove()
            if not self._pass_fits(job):  # at the step instead, in the two-pass form
                job.exact = None
                return
            begin = time.perf_counter()
            self._open_meter()
            try:
                with torch.enable_grad():  # a backward's callbacks run without it
                    job.measured = self._calibration(job)
            finally:
                self._close_meter()
                self.seconds += time.perf_counter() - begin
                job.exact = {}  # the pass is done: nothing of it is held to the step

        torch.autograd.Variable._execution_engine.queue_callback(measure)

    def _pass_fits(self, job: _Job) -> bool:
        """Whether the calibration's pass fits what the budget leaves at the end of the
        backward (the min over ranks): what is in use now, plus what the pass holds -- every
        layer's input (its units are R but those of the subset, which hold their L bytes), one
        layer re-created at a time, and the gradient at the last layer and its copy. Where it
        does not (a budget close to GC's peak on a model whose logits are small), the two-pass
        form runs at the optimizer step instead, when the step's memory is given back."""
        bucket = job.bucket
        if bucket.budget_bytes is None or bucket.profile is None:
            return True
        _, names, _ = self._calibration_subset(bucket, job.index(self._rank()))
        per_layer: dict[int, float] = {}
        packed = 0.0
        for cost in bucket.profile.units:
            per_layer[cost.layer] = per_layer.get(cost.layer, 0.0) + _scaled(bucket, cost, cost.h_bytes)
            if cost.name in names:
                packed += _scaled(bucket, cost, cost.l_bytes)
        layer_input = job.grad.numel() * job.grad.element_size()  # (B, T, H)
        need = (len(per_layer) + 2) * layer_input + max(per_layer.values(), default=0.0) + packed
        spare = float(bucket.budget_bytes - in_use_bytes(self._device()) - need)
        collective = self.scheduler.runtime.collective
        if collective is not None:
            spare = -collective.all_reduce_max_float([-spare])[0]
        return spare >= 0

    def _keep_exact(self, job: _Job, i: int, grad: torch.Tensor) -> None:
        with self.scheduler.metering.held():  # the pass's, not the plan's (NOTE [ Tracked on CPU ])
            previous = job.exact.get(i)
            job.exact[i] = grad.detach().clone() if previous is None else previous + grad

    def _supported(self) -> bool:
        """False under ZeRO-3 without DeepSpeed's parameter offload to gather through (a model
        attached outside ``ds_hilore.initialize``); decided once, not per microbatch."""
        if self._zero3 is None:
            layers = self.scheduler.runtime._layers
            self._zero3 = any(hasattr(p, "ds_id") for layer in layers for p in layer.module.parameters())
            if self._zero3 and self.zero3_offload is None:
                logger.info("ds_hilore: matched passes (calibration, validation) are skipped: the "
                            "parameters are ZeRO-3's, and the model was not attached through "
                            "ds_hilore.initialize, which gives the passes DeepSpeed's gathers; "
                            "the risk model keeps its prior.")
        return not self._zero3 or self.zero3_offload is not None

    # ------------------------------------------------------------------ at the step
    def run(self) -> None:
        job, self.job = self.job, None
        step_jobs, self.step_jobs = [j for j in self.step_jobs if j.grad is not None], []
        if job is None or job.grad is None:
            return
        begin = time.perf_counter()
        self._open_meter()
        try:
            self._run(job, step_jobs)
        finally:
            self._close_meter()
            self.seconds += time.perf_counter() - begin

    def _run(self, job: _Job, step_jobs: list[_Job]) -> None:
        s = self.scheduler
        if job.kind == "hold_out":
            self.ranking = self._rank_slices(job)
        elif job.kind == "calibrate":
            # NOTE [ The exact gradient from training ]: measured at the end of its backward
            measured = job.measured if job.exact is not None else self._calibration(job)
            if measured is not None and job.spread > 1:  # the next pass draws the next groups
                s.calibration_draws = job.first + job.spread
            added = 0
            for group, error, eps in measured or []:  # the same list on every rank
                if self._measured(error, "calibration", finite=True):  # else a later one again
                    s.risk.add(group, error, eps)
                    s.calibrated, added = s.calibrated + 1, added + 1
            if not added:
                return
        else:
            error = self._validate_step(step_jobs or [job])
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

    def _calibration(self, job: _Job) -> list[tuple[str, float, float]] | None:
        """The samples (group, measured error, sum_u eps_u E_u / M_m) of one calibration pass:
        a random half of one group's packable units in L (NOTE [ Matched passes ]), one sample
        per rank where the ranks calibrate a group each (NOTE [ Calibration spread over
        ranks ]); None when nothing of the microbatch was exposed on any rank. The same on
        every rank."""
        if not self._exposed_anywhere(job):  # NOTE [ A calibration with nothing exposed ]
            return None
        group, names, _ = self._calibration_subset(job.bucket, job.index(self._rank()))
        eps = _exposed_eps(job, names)
        actions = {n: ("L" if n in names else "R") for n in job.executed}
        if job.exact is not None:  # NOTE [ The exact gradient from training ]
            error = self._against_captured(job, actions)
        else:
            error = self._errors(job, [(actions, {})])[0]
        if job.spread == 1:  # the same risk model on every rank: the largest error, least eps
            return [(group, self._agree(error), self._least(eps))]
        exposed = job.mass is None or sum(job.mass) > 0  # None: no weights, taken as exposed
        return self._gathered(job, error, eps if exposed and math.isfinite(eps) else None)

    # NOTE [ Calibration spread over ranks ]
    # A calibration sample costs a pass over the decoder layers (NOTE [ The exact gradient from
    # training ]), and the first calibrations are most of the warm-up's cost. With every rank
    # calibrating the same group, N ranks pay N passes for one sample (the largest error over
    # the least exposure). Where the ranks' module calls need not match (ZeRO 0-2: a pass on
    # one rank gathers nothing the others must gather too) and at least N samples are still
    # due, rank r calibrates the group of the pass's first draw + r: N samples for the price of
    # one, each a whole measurement on its rank's microbatch (its error over its own exposure),
    # so the four groups are sampled in two steps on 2 ranks instead of four. A rank whose
    # microbatch carries no loss mass adds no sample (NOTE [ A calibration with nothing
    # exposed ]), and the next pass draws the groups after the last drawn, so that a group
    # left unsampled comes round again. The samples are all-reduced in one vector and folded
    # in rank order: every rank holds the same risk model. Under ZeRO-3 (a rank's pass packs
    # its own group and recomputes the rest: another set of module calls than the others'),
    # wherever the ranks' calls must match (``matched_calls``: also a multi-rank ``attach``,
    # which cannot tell what gathers), and for the last samples due, every rank calibrates the
    # same group, as before.
    def _spread(self) -> int:
        """How many ranks calibrate a group each in the next calibration (NOTE [ Calibration
        spread over ranks ]): the same on every rank."""
        s = self.scheduler
        collective = s.runtime.collective
        if collective is None or s.runtime.matched_calls:
            return 1
        world = collective.world_size
        return world if s.config.calibration_microbatches - s.calibrated >= world else 1

    def _rank(self) -> int:
        collective = self.scheduler.runtime.collective
        return collective.rank if collective is not None else 0

    def _gathered(self, job: _Job, error: float, eps: float | None) -> list[tuple[str, float, float]]:
        """Every rank's sample of a spread calibration, in rank order (NOTE [ Calibration spread
        over ranks ]); ``eps`` None where this rank's microbatch had no loss mass."""
        collective = self.scheduler.runtime.collective
        values = [0.0] * (5 * job.spread)
        k = 5 * collective.rank
        if eps is not None:  # (a sample, finite error, error is NaN, error is inf, eps)
            values[k:k + 5] = [1.0, error if math.isfinite(error) else 0.0,
                               float(math.isnan(error)), float(error == math.inf), eps]
        values = collective.all_reduce_sum(values)
        samples = []
        for rank in range(job.spread):
            present, value, nan, inf, eps_r = values[5 * rank:5 * rank + 5]
            if not present:
                continue  # nothing exposed there
            group = self._calibration_subset(job.bucket, job.index(rank))[0]
            samples.append((group, math.nan if nan else math.inf if inf else value, eps_r))
        return samples

    def _errors(self, job: _Job, variants: list[tuple[Any, dict]]) -> list[float]:
        """This rank's ||g - g_exact|| / ||g_exact|| of ``job`` under each variant (actions,
        rows), piece by piece (NOTE [ What a pass holds ]); NaN / inf as ``ratio``
        (grad_error.py)."""
        num, den = [0.0] * len(variants), [0.0]
        for piece in self._pieces(job, accumulators=False):
            exact: dict[int, torch.Tensor] = {}

            def keep(i, g):
                exact[i] = g
                den[0] += squared(g)

            self._pass(job, "R", {}, piece, keep)
            for v, (actions, rows) in enumerate(variants):
                seen: set[int] = set()

                def compare(i, g, v=v, seen=seen):
                    seen.add(i)
                    num[v] += squared(minus(g, exact.get(i)))

                self._pass(job, actions, rows, piece, compare)
                num[v] += sum(squared(e) for i, e in exact.items() if i not in seen)  # planned: 0
            exact.clear()
        return [ratio(n, den[0]) for n in num]

    def _against_captured(self, job: _Job, actions: dict) -> float:
        """This rank's ||g - g_exact|| / ||g_exact|| of ``job`` under ``actions``, against the
        gradient captured from its training backward: one pass, stopped at the last layer."""
        params = [p for g in self._layer_params() for p in g]
        exact = job.exact
        num = [0.0]
        seen: set[int] = set()

        def compare(i, g):
            seen.add(i)
            num[0] += squared(minus(g, exact.get(i)))

        self._pass(job, actions, {}, params, compare, stop=not self._zero3)
        num[0] += sum(squared(e) for i, e in exact.items() if i not in seen)  # planned: 0
        self.pieces = max(self.pieces, 1)
        return ratio(num[0], sum(squared(e) for e in exact.values()))

    def _validate_step(self, jobs: list[_Job]) -> float:
        """The step's measured error over ``jobs`` (its microbatches) and every rank's
        (NOTE [ The step's error over ranks ] in grad_error.py); each microbatch's own error
        reported too (this rank's). Per piece: D and G summed over the microbatches, then over
        ranks."""
        s = self.scheduler
        num = den = 0.0
        per_mb = [[0.0, 0.0] for _ in jobs]  # this rank's (||d_m||^2, ||g_m||^2)
        for piece in self._pieces(jobs[-1], accumulators=True):
            diff = [accumulator(p) for p in piece]  # D, this rank's
            total = [accumulator(p) for p in piece]  # G, this rank's
            for job, sums in zip(jobs, per_mb):
                exact: dict[int, torch.Tensor] = {}

                def keep(i, g, sums=sums):
                    exact[i] = g
                    total[i].add_(g)
                    sums[1] += squared(g)

                def compare(i, g, sums=sums):
                    d = minus(g, exact.pop(i, None))
                    sums[0] += squared(d)
                    diff[i].add_(d)

                self._pass(job, "R", {}, piece, keep)
                self._pass(job, *_as_executed(job), piece, compare)
                for i, e in exact.items():  # no planned gradient: it is 0
                    sums[0] += squared(e)
                    diff[i].sub_(e)
                exact.clear()
            n, d = summed_norms(diff, total, s.runtime.collective)
            num, den = num + n, den + d
            diff.clear()  # freed before the next piece's are made
            total.clear()
        error = self._agree(ratio(num, den))  # the same on every rank
        s.step_stats["grad_error_measured"] = error
        s.step_stats["grad_error_measured_microbatch"] = [ratio(n, d) for n, d in per_mb]
        return error

    def _rank_slices(self, job: _Job) -> dict:
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
        candidates, variants = [], []
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
            # halves wherever the bucket has several sequences, whatever this rank's batch: every
            # rank runs the same passes, whose errors are agreed (NOTE [ Uneven batches ] in
            # scheduler.py); a rank's empty half packs nothing there and measures 0
            halves = [order[:batch // 2], order[batch // 2:]] \
                if cost.sliceable and job.bucket.key[0] > 1 else [order]
            for rows in halves:
                group = group_of(cost.kind, cost.layer, n_layers)
                exposed = sum(exposure[i] for i in rows) / mass if mass > 0 else share(exposure, rows)
                predicted = s.risk.risk(group, cost.rel_error, exposed)
                by_advantage = s.risk.risk(group, cost.rel_error, share(adv, rows)) if adv else None
                per_row = tuple("L" if i in rows else "H" for i in range(batch))
                variants.append(({n: ("H" if n == name else "R") for n in job.executed}, {name: per_row}))
                candidates.append({"unit": name, "rows": rows, "predicted": predicted,
                                   "predicted_advantage": by_advantage})
        slices = []
        for slice_, error in zip(candidates, self._errors(job, variants) if variants else []):
            measured = self._agree(error)
            if not self._measured(measured, "ranking"):  # NOTE [ Non-finite passes ] in grad_error.py
                continue
            slices.append({**slice_, "measured": measured})
        measured = [x["measured"] for x in slices]
        rho = spearman([x["predicted"] for x in slices], measured) if len(slices) > 1 else None
        rho_adv = spearman([x["predicted_advantage"] for x in slices], measured) \
            if adv and len(slices) > 1 else None
        return {"spearman": rho, "spearman_advantage": rho_adv, "slices": slices}

    def _calibration_subset(self, bucket, index: int) -> tuple[str, set[str], float]:
        """(group, units in L, sum of their codec errors) of calibration sample ``index``."""
        costs = [c for c in bucket.profile.units if c.l_bytes < c.h_bytes]
        n_layers = 1 + max(c.layer for c in bucket.profile.units)
        # kinds alternate (attn:low, mlp:low, attn:high, ...): few passes still cover each kind
        groups = sorted({group_of(c.kind, c.layer, n_layers) for c in costs},
                        key=lambda g: (g.split(":")[1] != "low", g))
        if not groups:
            return "", set(), 0.0
        group = groups[index % len(groups)]
        members = [c for c in costs if group_of(c.kind, c.layer, n_layers) == group]
        chosen = random.Random(index).sample(members, max(1, len(members) // 2))
        return group, {c.name for c in chosen}, sum(c.rel_error for c in chosen)

    def _exposed_anywhere(self, job: _Job) -> bool:
        """Whether ``job``'s microbatch had loss mass on some rank (the same answer on every
        rank, so that every rank runs the passes or none does).

        NOTE [ A calibration with nothing exposed ]
        A microbatch whose coefficients are zero on every rank (every group of zero advantage,
        no KL term) has an exact gradient of 0, and so has every approximation of it: its pass
        would measure 0 / 0 and record a susceptibility of 0 for the group, which lets the
        allocator pack that group at no risk from then on. Such a microbatch teaches nothing;
        it is not counted as a calibration, and the next planned microbatch calibrates instead.
        One all-reduce, on calibrating microbatches only."""
        local = 1.0 if job.mass is None or sum(job.mass) > 0 else 0.0
        collective = self.scheduler.runtime.collective
        if collective is not None:
            local = collective.all_reduce_max_float([local])[0]
        return local > 0

    def _measured(self, error: float, what: str, finite: bool = False) -> bool:
        """False (the pass is dropped, counted and said once) when it measured nothing, or,
        ``finite``, when its error is not a number a sample can hold (NOTE [ Non-finite passes ]
        in grad_error.py)."""
        if not math.isnan(error) and not (finite and math.isinf(error)):
            return True
        self.dropped += 1
        if self.dropped == 1:
            logger.warning("ds_hilore: a %s pass was dropped: a gradient of its microbatch was "
                           "not finite (an overflowed step, e.g. fp16 loss scaling before its "
                           "scale settles); it is measured again on a later microbatch "
                           "(stats['calibration']['dropped_nonfinite'] counts these).", what)
        return False


def _as_executed(job: _Job) -> tuple[dict, dict]:
    """(actions, rows) of the plan ``job``'s microbatch ran: packed units and rows as they were,
    elided rows measured exactly (their gradient is 0)."""
    actions, rows = {}, {}
    for name, (action, states) in job.executed.items():
        actions[name] = "H" if action != "R" else "R"
        if states is not None:
            rows[name] = tuple("H" if x == "E" else x for x in states)
    return actions, rows


def _exposed_eps(job: _Job, names) -> float:
    """sum_u eps_u E_{u,all} / M_m over the units packed whole (NOTE [ Risk in step units ]);
    a unit without token weights counts E_{u,all} = M_m."""
    mass = sum(job.mass) if job.mass else 0.0
    costs = {c.name: c for c in job.bucket.profile.units}
    total = 0.0
    for name in names:
        values = (job.exposure or {}).get(name)
        exposed = sum(values) / mass if values is not None and mass > 0 else 1.0
        total += costs[name].rel_error * exposed
    return total
