"""The recovery runtime: HiLoRe as a model's activation checkpointing.

``attach(model, config)`` finds the recovery units, makes every decoder layer run through a
``LayerFrame`` (bundle.py) when gradient checkpointing is on, and keeps the per-microbatch state
the scheduler, the GRPO losses and the DeepSpeed engine talk to.

Around it: install.py changes the model (hooks, NOTE [ Switching ], discovery), registry.py
finds a model's runtime and routes the losses' ω, packed.py finds packed sequences.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any, Mapping

import torch
import torch.nn as nn

from ds_hilore._errors import HiLoReError
from ds_hilore.config import HiLoReConfig
from ds_hilore.grpo import exposure
from ds_hilore.runtime import packed, report
from ds_hilore.runtime.bundle import LayerFrame
from ds_hilore.runtime.calls import drop_cache, hidden_input
from ds_hilore.runtime.codecs import codec_from_config
from ds_hilore.runtime.collective import collective_for_attach
from ds_hilore.runtime.elision import Elision, gradient_entry
from ds_hilore.runtime.install import (Installation, checkpointing_on, reduces_in_hooks,
                                       refuse_unsupported_wrappers)
from ds_hilore.runtime.microbatch import Microbatch
from ds_hilore.runtime.plans import ACTIONS, Plans
from ds_hilore.runtime.registry import ATTACHED as _ATTACHED  # noqa: F401 (importable here)
from ds_hilore.runtime.registry import find_runtime, first_reached, sharing
from ds_hilore.runtime.units import LayerUnits, Unit, find_layers, outside_compile
from ds_hilore.runtime.weights import WeightRecognizer
from ds_hilore.runtime.zero_backward import gate

__all__ = ["ACTIONS", "HiLoReRuntime", "attach", "find_runtime"]

logger = logging.getLogger("ds_hilore")

_MAX_MICROBATCHES_KEPT = 64
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


class HiLoReRuntime(Installation, Plans):
    """HiLoRe attached to one model. See ``attach``."""

    def __init__(self, model: nn.Module, config: HiLoReConfig):
        self.model, self.config = model, config
        # NOTE [ One decision for every rank ] in collective.py: made at attach, several ranks
        self.collective = None
        # NOTE [ A backward of zeros ] in zero_backward.py: off where gradient hooks reduce every
        # gradient as it is made (ZeRO stages 1-3: engine.py; DDP, FSDP: at attach, below)
        self.zero_backward_skip = True
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
        splits them by it, never stores those predicted 0 and spends the memory they leave.

        Args:
            exposure: (B,) per sequence, e.g. ``ds_hilore.grpo.exposure.predicted(advantages,
                response_mask)`` (|A_i| x response tokens). Only when a zero means a zero loss
                coefficient: on-policy, beta = 0, no entropy bonus; otherwise do not call this.
            step_exposure: optional, the same summed over the optimizer step's microbatches on
                every rank (the risk then reads the microbatch against its step).
            exposed_microbatches: optional, with ``step_exposure``: how many of those
                microbatches (on every rank) have a non-zero prediction; the step's error
                tolerance is then shared by them alone (those predicted zero pack nothing).

        Does nothing without the allocator (``set_plan`` / ``force_plan`` decide then).
        """
        if self.policy is not None:
            values = exposure.tolist() if isinstance(exposure, torch.Tensor) else exposure
            self.policy.expect(values, step_exposure, exposed_microbatches)

    def set_coefficients(self, coefficients: torch.Tensor, offset: int | None = None,
                         logp: torch.Tensor | None = None) -> None:
        """Hand the loss coefficients ω (B, T') of a microbatch to the runtime, before its backward.

        Column j of ω belongs to hidden position ``offset + j``; by default ω ends at position
        T - 2 (the hidden state at t produces the log-prob of token t + 1), which is where
        ``logits[:, :-1]`` / ``logits_to_keep`` log-probs come from. ``logp`` (the log-probs ω
        was computed from) names the microbatch when several forwards are alive; without it,
        the latest forward is meant. Sequences whose ω is exactly zero are elided from every H/L
        unit (NOTE [ Exact zeros ] in storage.py); exposure is computed per unit and sequence.
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
        _check_coefficients(coefficients, frames[0], offset)
        mb.coefficients = coefficients.detach()
        self._elision.apply(mb, mb.coefficients, offset, source="analytic")

    def _microbatch_of(self, logp: torch.Tensor | None) -> "Microbatch | None":
        """The live microbatch whose last layer output ``logp`` was computed from."""
        live = [mb for mb in list(self._live_mbs) if mb.live_frames()]
        as_gc = self._mb is not None and self._mb.as_gc  # nothing of it to elide or weigh
        candidates = live + ([self._mb] if as_gc else [])
        if logp is not None and logp.grad_fn is not None and len(candidates) > 1:
            found = first_reached(logp, {mb.last_hidden_fn: mb for mb in candidates
                                         if mb.last_hidden_fn is not None})
            if found is not None:
                return None if found.as_gc else found
        if as_gc:
            return None
        if len(live) > 1:  # every step alike: said once, then at DEBUG
            logger.log(logging.DEBUG if self._warned_ambiguous else logging.WARNING,
                       "ds_hilore: %d forwards are alive and the coefficients do not say which "
                       "one they belong to; nothing is elided. Pass logp= to set_coefficients "
                       "(policy_loss does).", len(live))
            self._warned_ambiguous = True
            return None
        return live[0] if live else None

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
        self._mb, self._step = None, []
        try:
            yield
        finally:
            self._mb, self._step, self._n_microbatches, units = saved
            for unit, (action, nbytes) in zip(self._units, units):
                unit.action, unit.nbytes = action, nbytes

    def check_late(self) -> None:
        """Before an optimizer step, on every rank at the same point: raises on every rank if
        a backward on any rank sent gradient to elided sequences (NOTE [ Collective elision ]
        in elision.py)."""
        self._elision.flush_late()

    def end_step(self, step: int | None = None) -> None:
        """Close the optimizer step: ``stats`` now reports it, as step ``step`` (default: the
        previous one's number plus one). Raises if a backward since the last read sent
        gradient to elided sequences (NOTE [ Checked elision ] in elision.py)."""
        self._elision.flush_late()
        if self.policy is not None:
            self.policy.end_step()
            self._warn_if_never_planned()
        self._last_step, self._step = self._step, []
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

    # NOTE [ Where a microbatch begins ]
    # The policy plans a microbatch before its first layer runs. A forward of the model itself
    # reaches the pre-hook on the model (begin_forward with the model's own arguments, which
    # the matched passes can replay). Trainers also run the decoder layers without calling the
    # model: the backbone alone (``model.model(...)``, a fused-loss head), a critic's
    # ``forward_value`` calling the transformer inside it. Those forwards begin at the first
    # layer's call instead, keyed by its hidden states' (B, T) -- the key the model's
    # input_ids give for the same batch -- and are not replayed (no matched pass: the
    # arguments the model would need are not known there).
    @outside_compile  # NOTE [ Compiled layers ] (units.py)
    def _begin_forward(self, module, args, kwargs) -> None:
        if module.training:
            self._run_when_units_known()
        if self._plans_forward() and module.training:
            self._forward_begun = True
            self.policy.begin_forward(args, kwargs)

    @outside_compile  # NOTE [ Compiled layers ] (units.py)
    def _end_forward(self, module, args, output) -> None:
        self._forward_begun = False  # a forward that ran no HiLoRe layer begins nothing later
        if output is None and self.policy is not None:  # it raised: no backward will come
            self.policy.forward_failed()

    def _begin_at_layer(self, layer: LayerUnits, args: tuple, function) -> None:
        """A forward that did not pass through the model's pre-hook: begin it here."""
        begun, self._forward_begun = self._forward_begun, False
        if not begun and layer is self._layers[0]:
            self._run_when_units_known()
        if not begun and layer is self._layers[0] and self._plans_forward():
            hidden = hidden_input(args, getattr(function, "keywords", {}))  # (B, T, H)
            self.policy.begin_forward((hidden,), {}, replayable=False)

    def _plans_forward(self) -> bool:
        return (self.policy is not None and self.enabled and torch.is_grad_enabled()
                and not self._probing and all(layer.split is not None for layer in self._layers))

    # ------------------------------------------------------------------ per layer call
    @outside_compile  # NOTE [ Compiled layers ] (units.py)
    def _run_layer(self, layer: LayerUnits, function, args: tuple):
        if not torch.is_grad_enabled():
            return function(*args)
        function, args = self._without_cache(layer, function, args)
        if layer.split is None:
            return self._discover(layer, function, args)
        mb = self._microbatch_for(layer, args, function)
        if self.gc_forward:
            return self._run_as_gc(layer, mb, function, args)
        plan = self._capture_plan(layer)
        if self._checkpointed(layer, plan, mb):
            return self._run_checkpointed(layer, mb, function, args)
        frame = LayerFrame(layer, function, args, plan, mb)
        if mb.packed is not False:  # one-row inputs only: position_ids are (1, T) for any batch
            mb.packed = frame.batch == 1 and self._packed_sequences(mb, frame, function)
        mb.frames[layer.index] = weakref.ref(frame)
        mb.last_layer = layer.index
        out = frame.run()
        frame.elision_ok, frame.check_every_layer = gradient_entry(out)
        last = layer.index == self._last_active
        hidden = out if isinstance(out, torch.Tensor) else next(
            (x for x in (out if isinstance(out, (tuple, list)) else ()) if isinstance(x, torch.Tensor)), None)
        if hidden is not None and hidden.requires_grad:
            if last and self.zero_backward_skip:  # NOTE [ A backward of zeros ] in zero_backward.py
                gated = gate(hidden, mb)
                out = _replaced(out, hidden, gated)
                hidden, mb.gated = gated, True
            hidden.register_hook(functools.partial(self._elision.on_layer_grad, mb, weakref.ref(frame), last))
            if last:
                mb.last_hidden_fn = id(hidden.grad_fn)
        if last:
            mb.batch, mb.seq_len = frame.batch, frame.seq_len
            self._summarise(mb)
        return out

    # NOTE [ A layer that keeps nothing ]
    # A layer whose every unit is R keeps nothing but its input, as gradient checkpointing
    # does: its frame (a pack hook on every saved tensor, slot and weight bookkeeping, the
    # recompute's replay) would only cost host time. It runs under ``torch.utils.checkpoint``
    # (non-reentrant, RNG preserved, stopping early as HiLoRe's own re-run does: the same
    # gradients, bitwise), with the elision's hook on its output as any layer (a forward that
    # stops below the last layer is still seen). Not the last HiLoRe layer, whose frame carries
    # the microbatch's checks at the top of the backward (the coefficients, the leak check, a
    # skipped backward of zeros, which then never reaches the checkpointed layers); not on a
    # profiled microbatch (every unit measured), one whose units' token norms are wanted, nor
    # one predicted zero (NOTE [ A microbatch predicted zero ] in plan/scheduler.py: its frames
    # skip their recompute where no gate skips the backward). The same on every rank: the plan
    # and the prediction's verdict are. A microbatch found zero only after its forward, under
    # ZeRO 1-3 (no gate), recomputes such a layer where a frame would have read stand-ins.
    def _checkpointed(self, layer: LayerUnits, plan, mb: Microbatch) -> bool:
        return layer.index != self._last_active and mb.profile is None and not mb.norms_all \
            and all(a == "R" for a in plan.actions) \
            and not getattr(self.policy, "predicted_zero", False)

    def _run_checkpointed(self, layer: LayerUnits, mb: Microbatch, function, args: tuple):
        mb.checkpointed.add(layer.index)
        mb.last_layer = layer.index
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        hidden = out if isinstance(out, torch.Tensor) else next(
            (x for x in (out if isinstance(out, (tuple, list)) else ()) if isinstance(x, torch.Tensor)), None)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(functools.partial(self._checkpointed_grad, mb, len(layer.units)))
        return out

    def _checkpointed_grad(self, mb: Microbatch, units: int, grad: torch.Tensor | None) -> None:
        """The gradient reached a checkpointed layer's output: its backward, recompute
        included, runs next (a skipped backward of zeros never gets here)."""
        if grad is not None:  # None: a skipped backward of zeros passes by, recomputing nothing
            mb.counters.recomputed_units += units
        self._elision.on_layer_grad(mb, _NO_FRAME, False, grad)

    def _run_as_gc(self, layer: LayerUnits, mb: Microbatch, function, args: tuple):
        """The layer as gradient checkpointing runs it (``torch.utils.checkpoint``,
        non-reentrant): nothing captured, nothing elided; the policy still sees the gradient at
        the last layer's output (a leave-one-out timing ends with the backward)."""
        mb.as_gc, mb.last_layer = True, layer.index
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        if layer.index != self._last_active:
            return out
        hidden = out if isinstance(out, torch.Tensor) else next(
            (x for x in (out if isinstance(out, (tuple, list)) else ()) if isinstance(x, torch.Tensor)), None)
        if hidden is not None and hidden.requires_grad:
            mb.last_hidden_fn = id(hidden.grad_fn)
            if self.policy is not None:
                hidden.register_hook(functools.partial(self._gc_top_grad, mb))
        for unit in self._units:  # the units report the latest microbatch
            unit.action, unit.nbytes = "R", 0
        mb.summary.update(index=mb.index, actions={"H": 0, "L": 0, "R": len(self._units), "E": 0},
                          bytes={a: 0 for a in "HLRE"}, counters=mb.counters, as_gc=True)
        return out

    def _gc_top_grad(self, mb: Microbatch, grad: torch.Tensor) -> None:
        self.policy.top_grad(mb, grad)

    def elision_mode(self, device: torch.device) -> bool | str:
        """``elide_zero_rows`` as it applies on ``device``, "auto" resolved (NOTE [ Stand-ins on
        accelerators ] in elision.py): true elides every sequence whose loss coefficients are
        all zero, ``"whole"`` only a microbatch whose every sequence is, and whose layers'
        backward is then skipped, false nothing."""
        setting = self.config.elide_zero_rows
        if setting != "auto":
            return setting
        if device.type == "cpu":
            return True
        if not self._warned_elision:
            self._warned_elision = True
            logger.info("ds_hilore: on %s only microbatches whose every sequence has zero loss "
                        "coefficients are elided, their layers' backward skipped (elide_zero_rows "
                        "\"auto\"; true elides every such sequence there)", device.type)
        return "whole"

    def _without_cache(self, layer: LayerUnits, function, args: tuple):
        function, args, dropped = drop_cache(layer.module, function, args)
        if dropped and not self._warned_cache:
            logger.warning("ds_hilore: the KV cache passed to %s is dropped while HiLoRe is on "
                           "(a recompute would read what the forward wrote); pass use_cache=False "
                           "to the training forward to silence this.", type(layer.module).__name__)
            self._warned_cache = True
        return function, args

    def _packed_sequences(self, mb: Microbatch, frame: LayerFrame, function) -> bool:
        """NOTE [ Packed sequences ] in packed.py; said once per runtime."""
        found = packed.packed_sequences(mb, frame, function)
        if found and not self._warned_packed:
            logger.warning("ds_hilore: packed sequences (one row, restarting position_ids): "
                           "slices, exposure and elision act per packed sequence (segment). "
                           "A segment with zero loss coefficients is elided only where the "
                           "attention mask keeps segments apart, or when no later segment "
                           "has coefficients (exact either way).")
            self._warned_packed = True
        return found

    def _microbatch_for(self, layer: LayerUnits, args: tuple, function) -> Microbatch:
        """A layer index not above the previous one starts a new forward: a new microbatch."""
        if self._mb is None or layer.index <= self._mb.last_layer:
            self._begin_at_layer(layer, args, function)
            self._mb = Microbatch(self._n_microbatches, self)
            self._mb.summary["position"] = self._n_microbatches - self._step_first  # in the step
            self._live_mbs.add(self._mb)
            self._n_microbatches += 1
            self._step.append(self._mb.summary)
            if len(self._step) > _MAX_MICROBATCHES_KEPT:
                del self._step[0]
            if self.policy is not None and not self._probing:
                self.policy.begin_microbatch(self._mb)
        return self._mb

    def _summarise(self, mb: Microbatch) -> None:
        report.summarise(self._layers, mb)


def _NO_FRAME():  # noqa: N802 -- a dead weak reference: a checkpointed layer has no frame
    return None


def _replaced(out, old: torch.Tensor, new: torch.Tensor):
    """``out`` (a layer's output: a tensor, or a tuple / list holding it) with ``old`` as ``new``."""
    if out is old:
        return new
    return type(out)(new if x is old else x for x in out)


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


def _check_coefficients(coefficients: torch.Tensor, frame: LayerFrame, offset: int | None) -> None:
    if coefficients.shape[0] != frame.batch and frame.segments is not None:
        raise HiLoReError(f"{coefficients.shape[0]} rows of coefficients for a forward of one "
                          f"packed row ({len(frame.segments)} sequences, {frame.seq_len} tokens): "
                          "hand them as that row, (1, T'), each sequence's at its tokens (e.g. "
                          "compute the loss on the packed row's log-probs), or set "
                          "hilore.exposure_source to 'hidden_grad' to read them from the gradient.")
    if coefficients.shape[0] != frame.batch:
        raise HiLoReError(f"{coefficients.shape[0]} sequences of coefficients, but the microbatch's "
                          f"forward had {frame.batch}; pass those of the same microbatch (one row "
                          "per sequence).")
    exposure.align(coefficients[:0], frame.seq_len, offset)  # raises if ω does not fit
