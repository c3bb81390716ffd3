"""The recovery runtime: HiLoRe as a model's activation checkpointing.

``attach(model, config)`` finds the recovery units, makes every decoder layer run through a
``LayerFrame`` (bundle.py) when gradient checkpointing is on, and keeps the per-microbatch state
the scheduler, the GRPO losses and the DeepSpeed engine talk to.

Around it: install.py changes the model (hooks, NOTE [ Switching ], discovery), registry.py
finds a model's runtime and routes the losses' ω, packed.py finds packed sequences.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Mapping

import torch
import torch.nn as nn

from ds_hilore._errors import HiLoReError
from ds_hilore.config import HiLoReConfig
from ds_hilore.grpo import exposure
from ds_hilore.runtime import report
from ds_hilore.runtime.bundle import LayerFrame
from ds_hilore.runtime.calling import LayerCalls
from ds_hilore.runtime.codecs import codec_from_config
from ds_hilore.runtime.collective import collective_for_attach
from ds_hilore.runtime.elision import Elision
from ds_hilore.runtime.install import (Installation, checkpointing_on, reduces_in_hooks,
                                       refuse_unsupported_wrappers)
from ds_hilore.runtime.microbatch import Microbatch
from ds_hilore.runtime.plans import ACTIONS, Plans
from ds_hilore.runtime.registry import ATTACHED as _ATTACHED  # noqa: F401 (importable here)
from ds_hilore.runtime.registry import find_runtime, first_reached, reached_by, sharing
from ds_hilore.runtime.units import LayerUnits, Unit, find_layers
from ds_hilore.runtime.unpredicted import ZeroSeen
from ds_hilore.runtime.weights import WeightRecognizer

__all__ = ["ACTIONS", "HiLoReRuntime", "attach", "find_runtime"]

logger = logging.getLogger("ds_hilore")

_UNPLANNED_WARNING_MICROBATCHES = 32  # training microbatches without any plan before it is said


def attach(model: nn.Module, config: HiLoReConfig | Mapping | str | None = None) -> "HiLoReRuntime":
    """Make HiLoRe the activation checkpointing of ``model`` and turn it on.

    Args:
        model: a transformers causal LM (optionally wrapped by peft) or any module whose decoder
            layers are named by ``layer_pattern`` / ``attn_children`` / ``mlp_children``.
        config: a ``HiLoReConfig``, a dict of the ``"hilore"`` block, or a ds_config path.
    Returns:
        The runtime; ``runtime.detach()`` restores the model. With ``enabled: false`` the model
        is left untouched.
    Raises:
        HiLoReError: no recognisable decoder layers; the message says which keys name them.
    """
    return HiLoReRuntime(model, HiLoReConfig.coerce(config) if config is not None
                         else HiLoReConfig())


class HiLoReRuntime(Installation, Plans, LayerCalls):
    """HiLoRe attached to one model. See ``attach``."""

    def __init__(self, model: nn.Module, config: HiLoReConfig):
        self.model, self.config = model, config
        # NOTE [ One decision for every rank ] in collective.py: made at attach, several ranks
        self.collective = None
        # NOTE [ A backward of zeros ] in zero_backward.py: off where gradient hooks reduce every
        # gradient as it is made (ZeRO stages 1-3: engine.py; DDP, FSDP: at attach, below)
        self.zero_backward_skip = True
        # NOTE [ Kept rows only ] in rows.py: every rank makes the same module calls (ZeRO-3 and
        # FSDP gather parameters in module hooks; engine.py sets it per ZeRO stage)
        self.matched_calls = False
        self._split_next = None  # the rows of the next microbatch, as the policy split them
        self._expected_next = None  # without a policy: the prediction for the next microbatch
        self._handed_rows = None  # how many values the last expect() handed (``_check_handed``)
        self._warned_handed = False
        self._warned_rows = False
        self._zero_seen = ZeroSeen()  # NOTE [ Zero sequences found late ] in unpredicted.py
        # NOTE [ Policy ]: what decides the plan (ds_hilore.plan's scheduler), or None: the plan
        # of set_plan / force_plan holds. The runtime calls it at fixed points and never
        # imports it: begin_forward(args, kwargs) before a training forward of the model,
        # begin_microbatch(mb) at its first layer, keeps_whole(mb) and after_coefficients(mb) once
        # ω and exposure are known, top_grad(mb, grad) when the backward reaches the last layer,
        # forward_failed() when a forward of the model raised, end_step().
        self.policy = None
        # the forward in progress runs as gradient checkpointing, HiLoRe out of the way (the
        # policy sets it before the forward: NOTE [ Never slower than GC ] in plan/validate.py)
        self.gc_forward = False
        self.attached = False
        self._switched_on = True
        self._last_toggle = None
        self._layers: list[LayerUnits] = []
        self._units: tuple[Unit, ...] = ()
        self._plan: dict[str, str] = {}
        self._rows: dict[str, tuple[str, ...]] = {}
        self._codec = None
        self._mb: Microbatch | None = None
        self._n_microbatches = 0
        self._step: list[dict] = []
        self._last_step: list[dict] | None = None
        self._steps_closed = 0  # the number of the last step end_step closed (stats["step"])
        self._step_first = 0  # index of the step in progress's first microbatch
        self._trainable: list | None = None  # the gate's parameters, listed once per step
        # the last microbatch whose layers' backward was skipped (NOTE [ A layer that keeps
        # nothing ] in calling.py)
        self._skipped_at = -(1 << 62)
        self._live_mbs: "weakref.WeakSet[Microbatch]" = weakref.WeakSet()
        self._elision = Elision(self)
        self._warned_elision = False
        self._warned_cache = False
        self._warned_packed = False
        self._warned_ambiguous = False  # coefficients that name no forward (_microbatch_of)
        self._saved: list = []  # what attach changed, for detach
        self._hooks: list = []  # hook handles attach registered, for detach
        self._when_units: list = []  # actions waiting for the units to be known (when_units_known)
        if not config.enabled:
            return
        refuse_unsupported_wrappers(model)  # NOTE [ Data parallel wrappers ] in install.py
        self._layers = find_layers(model, config)
        self._weights = WeightRecognizer(layer.module for layer in self._layers)
        self._not_fp32: bool | None = None  # a layer holds a non-fp32 weight (_leaf_hooks_due)
        self._codec = codec_from_config(config)  # None for low_precision "none"
        self._plan_source: Mapping[str, str] | str = "R"  # until the allocator decides: as GC
        self._probing = False
        self._forward_begun = False  # the model's pre-hook began the forward in progress
        self._warned_unplanned = False
        self._every_n_layers = 1
        self._last_active = self._layers[-1].index  # the last layer that is HiLoRe's
        self._renumber()
        self.script_checkpointing = checkpointing_on(self._layers)
        _refuse_a_second_runtime(model)
        self.collective = collective_for_attach()  # every rank attaches together
        # NOTE [ A backward of zeros ]: off where hooks may reduce each gradient as it is made
        self.zero_backward_skip = self.collective is None and not reduces_in_hooks(model)
        self.matched_calls = self.collective is not None  # a wrapper's may gather parameters
        self._install()
        try:  # a failed attach leaves the model as it found it
            self._probe()
            if config.activate == "with_checkpointing":
                self.follow_script_checkpointing()
        except BaseException:
            self.detach()
            raise

    # ------------------------------------------------------------------ public API
    @property
    def units(self) -> tuple[Unit, ...]:
        """The recovery units in execution order (read-only)."""
        return self._units

    @property
    def enabled(self) -> bool:
        """True while HiLoRe is the model's (switched-on) activation checkpointing."""
        return self.attached and self._switched_on

    # NOTE [ The script's checkpointing ]
    # HiLoRe replaces gradient checkpointing; it must not add recomputation where the script
    # trained without it. ``activate`` says where it turns on:
    # * ``always``: attaching turns it on (the contract of ds_hilore.attach / initialize: the
    #   caller asked for it by name);
    # * ``with_checkpointing``: only where the script turned checkpointing on -- a decoder layer
    #   had transformers' ``gradient_checkpointing`` flag set when HiLoRe attached, or the script
    #   calls ``gradient_checkpointing_enable()`` later (NOTE [ Switching ] in install.py); until
    #   then the model runs plain autograd, as without ds_hilore. Layers with no such flag
    #   (``layer_pattern`` layers) have no choice to read: HiLoRe is on for them.
    # * ``auto``: ``always`` for attach / initialize, ``with_checkpointing`` for engines HiLoRe
    #   joins without a script change (DS_HILORE, python -m ds_hilore.run): there the script,
    #   not the user of ds_hilore, made the choice.
    def follow_script_checkpointing(self) -> None:
        """HiLoRe off when the script had not turned gradient checkpointing on (NOTE above);
        the script's ``gradient_checkpointing_enable()`` turns it on."""
        if self.attached and not self.script_checkpointing:
            self._switch(False)
            logger.info("ds_hilore: %s was trained without gradient checkpointing: HiLoRe stays "
                        "off until gradient_checkpointing_enable() (activate: %s).",
                        type(self.model).__name__, self.config.activate)

    def expect(self, exposure, step_exposure: float | None = None,
               exposed_microbatches: int | None = None) -> None:
        """Predicted exposure of the next microbatch's sequences, before its forward: the plan
        splits them by it, never stores those predicted 0 and spends the memory they leave;
        the sequences predicted 0 run their layers without autograd, and the layers' recompute
        and backward cost the others only (NOTE [ Kept rows only ] in rows.py). Under several
        ranks, call it on every rank before the same forward.

        Args:
            exposure: (B,) per sequence, e.g. ``ds_hilore.grpo.exposure.predicted(advantages,
                response_mask)`` (|A_i| x response tokens). Only when a zero means a zero loss
                coefficient: on-policy, beta = 0, no entropy bonus; otherwise do not call this.
            step_exposure: optional, the same summed over the optimizer step's microbatches on
                every rank (the risk then reads the microbatch against its step).
            exposed_microbatches: optional, with ``step_exposure``: how many of those
                microbatches (on every rank) have a non-zero prediction; the step's error
                tolerance is then shared by them alone (those predicted zero pack nothing).

        Without the allocator (``set_plan`` / ``force_plan``) only the rows are split.
        """
        values = exposure.tolist() if isinstance(exposure, torch.Tensor) else exposure
        self._handed_rows = None if values is None else len(values)
        self._zero_seen.predicted = self._zero_seen.predicted or values is not None
        if self.policy is not None:
            self.policy.expect(values, step_exposure, exposed_microbatches)
        elif self.config.exposure_source != "hidden_grad":
            self._expected_next = None if values is None else [float(x) for x in values]

    def set_coefficients(self, coefficients: torch.Tensor, offset: int | None = None,
                         logp: torch.Tensor | None = None) -> None:
        """Hand the loss coefficients ω (B, T') of a microbatch to the runtime, before its backward.

        Column j of ω belongs to hidden position ``offset + j``; by default ω ends at position
        T - 2 (the hidden state at t produces the log-prob of token t + 1), which is where
        ``logits[:, :-1]`` / ``logits_to_keep`` log-probs come from. ``logp`` (the log-probs ω
        was computed from) names the microbatch when several forwards are alive; without it,
        the one alive with HiLoRe's frames is meant (with several, nothing is elided, said
        once). Sequences whose ω is exactly zero are elided from every H/L unit
        (NOTE [ Exact zeros ] in storage.py); exposure is computed per unit and sequence.
        ``ds_hilore.grpo.policy_loss`` calls this by itself.
        """
        if coefficients.dim() != 2:
            raise HiLoReError(f"set_coefficients expects (B, T') coefficients, got "
                              f"{tuple(coefficients.shape)}")
        mb = self._microbatch_of(logp)
        if mb is None:
            return
        if self.config.exposure_source == "hidden_grad":
            return  # the user asked for the automatic source only
        frames = mb.live_frames()
        _check_coefficients(coefficients, frames[0], offset,
                            mb.split.batch if mb.split is not None else frames[0].batch)
        mb.coefficients = coefficients.detach()
        self._elision.apply(mb, mb.coefficients, offset, source="analytic")

    def _microbatch_of(self, logp: torch.Tensor | None) -> "Microbatch | None":
        """The live microbatch whose last layer output ``logp`` was computed from; None where
        that forward ran as GC (nothing of it to elide or weigh) or is not known.

        NOTE [ Which forward a loss is of ]
        Trainers may run several forwards before their losses (two microbatches, then one
        backward of the sum). Every such forward still alive is a candidate: those with frames
        and those run as GC -- a loss of a forward run as GC, computed after a later planned
        forward, once gave its coefficients to that later one, which had no room for them or,
        of the same shape, took them silently. With several candidates the loss's graph decides
        (NOTE [ The last layer's output, marked ] in registry.py); where it reaches none of
        them, nothing is elided, said once."""
        alive = list(self._live_mbs)
        live = [mb for mb in alive if mb.live_frames()]
        latest_gc = self._mb is not None and self._mb.as_gc
        walkable = logp is not None and logp.grad_fn is not None
        if not walkable:  # nothing to walk: the latest forward is meant
            candidates = live + ([self._mb] if latest_gc and self._mb not in live else [])
        else:
            candidates = live + [mb for mb in alive if mb.as_gc and mb not in live and (
                mb is self._mb or mb.last_hidden_marked and not mb.gc_backward_begun)]
        if all(mb.as_gc for mb in candidates):  # nothing of them to elide or weigh
            return None
        if len(candidates) == 1:
            return candidates[0]
        if walkable:
            found = first_reached(logp, reached_by(candidates))
            if found is not None:
                return None if found.as_gc else found
        logger.log(logging.DEBUG if self._warned_ambiguous else logging.WARNING,  # said once
                   "ds_hilore: %d forwards are alive and the coefficients do not say which "
                   "one they belong to; nothing is elided. Pass logp= to set_coefficients "
                   "(policy_loss does).", len(candidates))
        self._warned_ambiguous = True
        return None

    @property
    def exposure(self) -> dict[str, list[float]]:
        """E_{u,i} of the current microbatch: unit name -> one value per sequence (H/L units)."""
        if self._mb is None:
            return {}
        read = self._mb.exposure_lists()[1]  # as read with the coefficients
        return {k: read[k] if k in read else v.tolist() for k, v in self._mb.exposure.items()}

    @property
    def token_weights(self) -> torch.Tensor | None:
        """|ω| (analytic) or ‖∂L/∂h_t‖ (automatic) of the current microbatch on hidden positions (B, T)."""
        return None if self._mb is None else self._mb.token_weights

    @property
    def stats(self) -> dict[str, Any]:
        """Measurements of the last optimizer step ``end_step`` closed: read inside a step (before
        its ``end_step``, or ``engine.step()``), they describe the one before. Before any was
        closed, the step in progress. ``stats["step"]`` is the number of the step described
        (``ds_hilore.initialize``: DeepSpeed's ``global_steps`` after it; else counted from 1 by
        ``end_step``), and ``stats["microbatches"][k]["position"]`` that microbatch's position
        in it (0 for the first; ``"index"`` counts every microbatch of the runtime)."""
        closed = self._last_step is not None
        out = report.step_stats(self._last_step if closed else self._step, self.policy)
        out["step"] = self._steps_closed if closed else self._steps_closed + 1
        return out

    @contextlib.contextmanager
    def shadow(self):
        """A forward and backward that leave no trace in ``stats`` or in the units' reported
        actions (the scheduler's matched passes)."""
        saved = (self._mb, self._step, self._n_microbatches, [(u.action, u.nbytes) for u in self._units])
        handed, self._mb, self._step, self._handed_rows = self._handed_rows, None, [], None
        try:
            yield
        finally:
            self._mb, self._step, self._n_microbatches, units = saved
            self._handed_rows = handed  # a prediction is for the next training forward
            for unit, (action, nbytes) in zip(self._units, units):
                unit.action, unit.nbytes = action, nbytes

    def check_late(self) -> None:
        """Before an optimizer step, on every rank at the same point: raises on every rank if
        a backward on any rank sent gradient to elided sequences (NOTE [ Collective elision ]
        in agreement.py)."""
        self._elision.flush_late()

    def end_step(self, step: int | None = None) -> None:
        """Close the optimizer step: ``stats`` now reports it, as step ``step`` (default: the
        previous one's number plus one). Raises if a backward since the last read sent
        gradient to elided sequences (NOTE [ Checked elision ] in elision.py)."""
        self._elision.flush_late()
        self._zero_seen.end_step(self.collective)
        if self.policy is not None:
            self.policy.end_step()
            self._warn_if_never_planned()
        self._last_step, self._step = self._step, []
        self._trainable = None  # what trains may change between optimizer steps
        self._steps_closed = self._steps_closed + 1 if step is None else int(step)
        self._step_first = self._n_microbatches

    def _warn_if_never_planned(self) -> None:
        """Said once: the policy has run many microbatches and planned none (HiLoRe is GC)."""
        wanted = max(_UNPLANNED_WARNING_MICROBATCHES, 4 * self.config.profile_microbatches)
        if self._warned_unplanned or self._n_microbatches < wanted:
            return
        self._warned_unplanned = True
        plans = self.policy.stats.get("plans") or {}
        if any(plan is not None for plan in plans.values()):
            return
        if self._elision.stopped_short:  # NOTE [ Checked elision ]: no top, nothing measured
            logger.warning("ds_hilore: after %d training microbatches no shape has been planned: "
                           "HiLoRe has run as gradient checkpointing (all R). %d of their forwards "
                           "stopped below the last HiLoRe layer (%s), and a microbatch is measured "
                           "for a plan from that layer's output gradient. Fix: let training "
                           "forwards run every layer, or leave the layers they skip out of "
                           "hilore.layer_pattern.", self._n_microbatches,
                           self._elision.stopped_short,
                           next(x.name for x in self._layers if x.index == self._last_active))
            return
        logger.warning("ds_hilore: after %d training microbatches no shape has been planned: HiLoRe "
                       "has run as gradient checkpointing (all R). Shapes seen (batch x length, "
                       "rounded up to a power of two): %s; each needs profile_microbatches=%d "
                       "microbatches before it is planned. Fix: keep microbatch shapes steady "
                       "(pad to a few lengths), or lower profile_microbatches.",
                       self._n_microbatches, sorted(plans)[:8] or "none",
                       self.config.profile_microbatches)

    def state_dict(self) -> dict[str, Any]:
        """Learned state worth keeping across a resume: plan, and the policy's profiles and
        calibration."""
        state = {"version": 1, "plan": dict(self._plan), "microbatches_seen": self._n_microbatches,
                 "steps": self._steps_closed}
        if self.policy is not None:  # profiles, calibration: a resume does not measure again
            state["policy"] = self.policy.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != 1:
            raise HiLoReError(f"unknown ds_hilore state version {state.get('version')!r}")
        if self.policy is not None:  # a plan chosen by hand (set_plan, force_plan, the budget
            # below GC's fallback) holds; under the allocator, the saved one until it plans
            known = {u.name for u in self._units}
            self._plan.update({k: v for k, v in state.get("plan", {}).items() if k in known
                               and v in ACTIONS and (v != "L" or self._codec is not None)})
        self._n_microbatches = self._step_first = int(state.get("microbatches_seen", 0))
        self._steps_closed = int(state.get("steps", self._steps_closed))
        if self.policy is not None and state.get("policy"):
            self.policy.load_state_dict(state["policy"])

def _refuse_a_second_runtime(model: nn.Module) -> None:
    """One runtime per model: a second one on the same layers would capture each call twice,
    and the losses' coefficients would go to whichever the registry met first."""
    others = sharing(model)
    if others:
        raise HiLoReError(
            "a HiLoRe runtime is already attached to this model "
            f"({type(others[0].model).__name__}); "
            "detach it first (ds_hilore.find_runtime(model).detach(), or engine.destroy() for "
            "an engine of ds_hilore.initialize), or reuse it.")


def _check_coefficients(coefficients: torch.Tensor, frame: LayerFrame, offset: int | None,
                        batch: int) -> None:
    """``batch``: the forward's sequences (a frame of kept rows holds fewer: NOTE [ Kept rows
    only ] in rows.py)."""
    if coefficients.shape[0] != batch and frame.segments is not None:
        raise HiLoReError(f"{coefficients.shape[0]} rows of coefficients for a forward of one "
                          f"packed row ({len(frame.segments)} sequences, {frame.seq_len} tokens): "
                          "hand them as that row, (1, T'), each sequence's at its tokens (e.g. "
                          "compute the loss on the packed row's log-probs), or set "
                          "hilore.exposure_source to 'hidden_grad' to read them from the gradient.")
    if coefficients.shape[0] != batch:
        raise HiLoReError(f"{coefficients.shape[0]} sequences of coefficients, but the microbatch's "
                          f"forward had {batch}; pass those of the same microbatch (one row "
                          "per sequence).")
    exposure.align(coefficients[:0], frame.seq_len, offset)  # raises if ω does not fit
