"""One matched pass and what it may hold: the part of ``MatchedPasses`` (calibrate.py) that
re-runs a microbatch, hands each gradient on as it arrives, splits the decoder layers into
pieces that fit the budget, and agrees values over ranks.

NOTE [ What a pass holds ]
A pass keeps no gradient it does not need: a hook on each parameter sees its gradient as the
backward produces it and hands ``autograd.grad`` a zero-stride stand-in, so the exact pass
holds the exact gradient and nothing else, and a planned pass is compared with it tensor by
tensor as it arrives (its squared difference taken in fp64, one tensor at a time, and for
validation added to the step's sums D and G, kept in fp32). So a calibration or ranking pass
holds one gradient of the trainable decoder parameters, a validation three (exact, D, G),
plus one tensor's fp64 copy -- never every tensor's exact, planned and fp64 copies at once.
When even that would not fit what the memory budget leaves at the optimizer step (the budget,
less what is in use then, less the pass's own activations, bounded above by GC's microbatch
peak over its baseline plus what the plan adds to it, as priced), the decoder layers are split
into consecutive pieces that each fit, and every pass runs once per piece, taking the gradient of
that piece's parameters only: each parameter's gradient comes out of the same ops whatever
else the backward is asked for, so the squared norms, summed over pieces before the ratio,
differ from one piece's by fp64 rounding only. A layer is the smallest piece (said once when
even one does not fit). The spare memory is the min over ranks, so every rank runs the same
pieces. ``stats["calibration"]`` reports the most ``pieces`` a pass needed and
``pass_peak_bytes``, the highest in-use reading taken as gradients arrived (CUDA: the window's
allocated peak).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from ds_hilore.plan.grad_error import held_bytes, numel
from ds_hilore.plan.zero3_passes import isolated as zero3_isolated
from ds_hilore.runtime.memory import DevicePeak, in_use_bytes

logger = logging.getLogger("ds_hilore")


class _Stopped(Exception):
    """Ends a pass's forward at the last HiLoRe layer (NOTE [ A pass stops at the last layer ])."""


class PassRunner:
    """Runs passes for ``MatchedPasses``, whose state (``scheduler``, meters, ``pieces``) it
    uses; a ``job`` is calibrate.py's ``_Job`` (not imported here: calibrate imports this)."""

    # ------------------------------------------------------------------ one pass
    def _pass(self, job: Any, actions, rows, params: list[torch.Tensor],
              on_grad: Callable[[int, torch.Tensor], None], stop: bool = False) -> None:
        """``job``'s microbatch under ``actions`` / ``rows``, and the backward from the last
        layer's output to ``params``: ``on_grad(i, gradient of params[i])`` as each arrives,
        none of them kept by the pass (NOTE [ What a pass holds ]). A parameter that gets no
        gradient is never seen. ``stop``: the forward ends at the last HiLoRe layer.

        NOTE [ A pass stops at the last layer ]
        A pass needs the last HiLoRe layer's output and nothing after it: the model's final
        norm, LM head and logits (B, T, V) -- often the largest tensor of the step -- are
        neither computed nor held when the layer's forward hook ends the forward there (an
        exception the pass catches; the model's own end-of-forward hook runs as for any forward
        that raises). Not under ZeRO-3, whose module hooks gather and release parameters around
        every module's forward and must see each one end."""
        runtime = self.scheduler.runtime
        last = next(layer for layer in runtime._layers if layer.index == runtime._last_active)
        captured = {}

        def at_last(module, args, out):
            captured.setdefault("h", out)
            if stop:
                raise _Stopped

        handle = last.module.register_forward_hook(at_last)
        arrivals = [p.register_hook(self._arrival(i, on_grad)) for i, p in enumerate(params)]
        saved = (dict(runtime._plan), dict(runtime._rows), runtime._plan_source, runtime.gc_forward)
        runtime.gc_forward = False  # the pass runs its plan, whatever the last forward ran as
        devices = list(range(torch.cuda.device_count())) if job.cuda_rng is not None else []
        self.running = True
        try:
            with zero3_isolated(self.zero3_offload if self._zero3 else None, runtime.model), \
                    torch.random.fork_rng(devices=devices), runtime.shadow():
                torch.set_rng_state(job.rng)
                for d, state in zip(devices, job.cuda_rng or []):
                    torch.cuda.set_rng_state(state, d)
                runtime.apply_plan(actions, rows)
                try:
                    runtime.model(*job.args, **job.kwargs)
                except _Stopped:
                    pass
                hidden = captured.pop("h")
                hidden = hidden if isinstance(hidden, torch.Tensor) else next(
                    x for x in hidden if isinstance(x, torch.Tensor))
                torch.autograd.grad(hidden, params, grad_outputs=job.grad, allow_unused=True)
        finally:
            self.running = False
            handle.remove()
            for arrival in arrivals:
                arrival.remove()
            runtime._plan, runtime._rows, runtime._plan_source, runtime.gc_forward = saved

    def _arrival(self, i: int, on_grad: Callable[[int, torch.Tensor], None]):
        def arrived(grad: torch.Tensor) -> torch.Tensor:
            on_grad(i, grad)
            self._sample()
            return grad.new_zeros(()).expand(grad.shape)  # what autograd.grad keeps: no bytes
        return arrived

    # ------------------------------------------------------------------ memory
    def _layer_params(self) -> list[list[torch.Tensor]]:
        """The trainable parameters of each decoder layer, in layer order, each once."""
        seen: set[int] = set()
        groups = []
        for layer in self.scheduler.runtime._layers:
            group = [p for p in layer.module.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in group)
            groups.append(group)
        return [g for g in groups if g]

    def _pieces(self, job: Any, accumulators: bool) -> list[list[torch.Tensor]]:
        """Consecutive decoder layers' trainable parameters, in pieces whose gradients fit
        what the budget leaves (NOTE [ What a pass holds ]); ``accumulators``: validation's D
        and G are held too."""
        groups = self._layer_params()
        params = [p for g in groups for p in g]
        if not params:
            return []
        transient = max(8 * numel(p) + numel(p) * p.element_size() for p in params)
        need = [sum(held_bytes(p, accumulators) for p in g) for g in groups]
        spare = self._spare_bytes(job)
        pieces, current, held = [], [], 0
        for group, n in zip(groups, need):
            if current and spare is not None and held + n + transient > spare:
                pieces.append(current)
                current, held = [], 0
            current, held = current + group, held + n
        pieces.append(current)
        if spare is not None and max(need) + transient > spare and not self._warned_pieces:
            self._warned_pieces = True
            logger.info("ds_hilore: a matched pass holds %.1f MiB of gradients per decoder layer, "
                        "more than the memory budget leaves at the optimizer step (%.1f MiB): its "
                        "passes run layer by layer and may exceed the budget.",
                        (max(need) + transient) / 2**20, spare / 2**20)
        self.pieces = max(self.pieces, len(pieces))
        return pieces

    def _spare_bytes(self, job: Any) -> int | None:
        """What the budget leaves for a pass's gradients now, the min over ranks: the budget,
        less what is in use, less the pass's own activations; None without a budget."""
        bucket = job.bucket
        if bucket.budget_bytes is None or bucket.profile is None:
            return None
        profile = bucket.profile
        activations = max(0, profile.gc_peak_bytes - profile.baseline_bytes) + \
            (bucket.plan.peak_over_gc_bytes if bucket.plan is not None else 0)
        spare = float(bucket.budget_bytes - in_use_bytes(self._device()) - activations)
        collective = self.scheduler.runtime.collective
        if collective is not None:
            spare = -collective.all_reduce_max_float([-spare])[0]
        return int(spare)

    def _device(self) -> torch.device:
        param = next((p for g in self._layer_params() for p in g), None)
        return param.device if param is not None else torch.device("cpu")

    def _open_meter(self) -> None:
        device = self._device()
        self._meter = DevicePeak(device) if device.type == "cuda" else None
        self._peak_now = 0
        self._sample()

    def _sample(self) -> None:
        if self._meter is not None:
            self._meter.sample()
        else:
            self._peak_now = max(self._peak_now, in_use_bytes("cpu"))

    def _close_meter(self) -> None:
        peak = self._meter.close() if self._meter is not None else self._peak_now
        self._meter = None
        self.peak_bytes = max(self.peak_bytes or 0, peak)

    # ------------------------------------------------------------------ over ranks
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

    def _least(self, value: float) -> float:
        """The min over ranks of a finite value. A calibration sample's exposure term is this
        rank's (its microbatch's exposure); with the error agreed (``_agree``) but not it, each
        rank's risk model drifted from the others', and the plans each rank re-solves from its
        own model (``_plan_for_rows``) could differ -- a rank-local R that hangs ZeRO-3. The
        least exposure makes the larger, more cautious susceptibility, the same everywhere."""
        collective = self.scheduler.runtime.collective
        if collective is None:
            return value
        return -collective.all_reduce_max_float([-value])[0]
