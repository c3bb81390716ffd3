"""The recovery runtime: HiLoRe as a model's activation checkpointing.

``attach(model, config)`` finds the recovery units, makes every decoder layer run through a
``LayerFrame`` (bundle.py) when gradient checkpointing is on, and keeps the per-microbatch state
the scheduler, the GRPO losses and the DeepSpeed engine talk to.

NOTE [ Switching ]
transformers' decoder layers call ``self._gradient_checkpointing_func(forward, *args)`` when
their ``gradient_checkpointing`` flag is set, in training mode, with gradients on. Attaching puts
a ``_LayerCall`` there and sets the flag; ``gradient_checkpointing_enable()`` /
``gradient_checkpointing_disable()`` reach ``_set_gradient_checkpointing`` on the model, which is
wrapped (``_Toggle``) so that "on" means HiLoRe and "off" means plain autograd. Under
``torch.no_grad()`` the layers never call the function: nothing is captured.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import logging
import weakref
from typing import Any, Mapping

import torch
import torch.nn as nn

from ds_hilore._errors import HiLoReError, HiLoReNameError
from ds_hilore.config import HiLoReConfig
from ds_hilore.grpo import exposure, handoff
from ds_hilore.runtime import discovery
from ds_hilore.runtime.bundle import CapturePlan, LayerFrame, drop_cache, hidden_input
from ds_hilore.runtime.codecs import codec_from_config, relative_errors
from ds_hilore.runtime.elision import Elision, gradient_entry
from ds_hilore.runtime.microbatch import Microbatch
from ds_hilore.runtime.storage import Counters
from ds_hilore.runtime.units import (
    LayerUnits,
    Unit,
    find_layers,
    is_checkpointing_layer,
    outside_compile,
)
from ds_hilore.runtime.weights import WeightRecognizer

logger = logging.getLogger("ds_hilore")

ACTIONS = ("H", "L", "R")
_ATTACHED: "weakref.WeakSet[HiLoReRuntime]" = weakref.WeakSet()
_MAX_MICROBATCHES_KEPT = 64
_UNPLANNED_WARNING_MICROBATCHES = 32  # training microbatches without any plan before it is said
_MAX_GRAPH_WALK = 10_000  # autograd nodes visited to find which forward log-probs came from


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


def find_runtime(model: nn.Module | None = None) -> "HiLoReRuntime | None":
    """The runtime attached to ``model`` (or to a module containing it), else the only one."""
    live = [rt for rt in list(_ATTACHED) if rt.attached]
    if model is not None:
        for rt in live:
            if rt.model is model or any(m is model for m in rt.model.modules()):
                return rt
        return None
    return live[0] if len(live) == 1 else None


class _LayerCall:
    """Installed as a decoder layer's ``_gradient_checkpointing_func``."""

    def __init__(self, runtime: "HiLoReRuntime", layer: LayerUnits):
        self.runtime, self.layer = runtime, layer

    def __call__(self, function, *args, **kwargs):
        if kwargs:
            function = functools.partial(function, **kwargs)
        return self.runtime._run_layer(self.layer, function, args)


class _ForwardWrapper:
    """Instance ``forward`` of a layer named by ``layer_pattern`` that has no checkpoint hook."""

    def __init__(self, runtime: "HiLoReRuntime", layer: LayerUnits, forward):
        self.runtime, self.layer, self.forward = runtime, layer, forward

    def __call__(self, *args, **kwargs):
        if self.runtime.enabled and self.layer.module.training and torch.is_grad_enabled():
            return self.runtime._run_layer(self.layer, functools.partial(self.forward, **kwargs), args)
        return self.forward(*args, **kwargs)


class _Toggle:
    """Wraps a transformers model's ``_set_gradient_checkpointing`` (NOTE [ Switching ])."""

    def __init__(self, runtime: "HiLoReRuntime", original):
        self.runtime, self.original = runtime, original

    def __call__(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
        kwargs = {} if gradient_checkpointing_func is None else {
            "gradient_checkpointing_func": gradient_checkpointing_func}
        self.original(enable=enable, every_n_layers=every_n_layers, **kwargs)
        self.runtime._switch(enable, every_n_layers)
        self.runtime._last_toggle = (self.original, enable, every_n_layers, kwargs)


class HiLoReRuntime:
    """HiLoRe attached to one model. See ``attach``."""

    def __init__(self, model: nn.Module, config: HiLoReConfig):
        self.model, self.config = model, config
        self.collective = None  # set by engine.py for multi-rank runs
        # NOTE [ Policy ]: what decides the plan (ds_hilore.plan's scheduler), or None: the plan
        # of set_plan / force_plan holds. The runtime calls it at fixed points and never
        # imports it: begin_forward(args, kwargs) before a training forward of the model,
        # begin_microbatch(mb) at its first layer, keeps_whole(mb) and after_coefficients(mb) once
        # ω and exposure are known, top_grad(mb, grad) when the backward reaches the last layer,
        # end_step().
        self.policy = None
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
        self._live_mbs: "weakref.WeakSet[Microbatch]" = weakref.WeakSet()
        self._elision = Elision(self)
        self._warned_cache = False
        self._warned_packed = False
        self._warned_ambiguous = False  # coefficients that name no forward (_microbatch_of)
        self._saved: list = []  # what attach changed, for detach
        self._hooks: list = []  # hook handles attach registered, for detach
        if not config.enabled:
            return
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
        self.script_checkpointing = _checkpointing_on(self._layers)
        self._install()
        self._probe()
        if config.activate == "with_checkpointing":
            self.follow_script_checkpointing()

    # ------------------------------------------------------------------ public API
    @property
    def units(self) -> tuple[Unit, ...]:
        """The recovery units in execution order (read-only)."""
        return self._units

    @property
    def enabled(self) -> bool:
        """True while HiLoRe is the model's (switched-on) activation checkpointing."""
        return self.attached and self._switched_on

    def detach(self) -> None:
        """Restore the model as it was before ``attach``."""
        if not self.attached:
            return
        for obj, name, had, old in reversed(self._saved):
            if had:
                setattr(obj, name, old)
            else:
                obj.__dict__.pop(name, None)
        self._saved.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._last_toggle is not None:  # the user's last switch holds for HF checkpointing
            original, enable, every_n_layers, kwargs = self._last_toggle
            original(enable=enable, every_n_layers=every_n_layers, **kwargs)
        self.attached = False
        self._mb = None
        _ATTACHED.discard(self)

    # NOTE [ The script's checkpointing ]
    # HiLoRe replaces gradient checkpointing; it must not add recomputation where the script
    # trained without it. ``activate`` says where it turns on:
    # * ``always``: attaching turns it on (the contract of ds_hilore.attach / initialize: the
    #   caller asked for it by name);
    # * ``with_checkpointing``: only where the script turned checkpointing on -- a decoder layer
    #   had transformers' ``gradient_checkpointing`` flag set when HiLoRe attached, or the script
    #   calls ``gradient_checkpointing_enable()`` later (NOTE [ Switching ]); until then the model
    #   runs plain autograd, as without ds_hilore. Layers with no such flag (``layer_pattern``
    #   layers) have no choice to read: HiLoRe is on for them.
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

    def set_plan(self, plan: Mapping[str, str] | str, rows: Mapping[str, tuple[str, ...]] | None = None):
        """Capture actions for the next microbatches; ``force_plan`` still overrides them.

        The caller takes the choice over: the allocator (``runtime.policy``) stops deciding, as
        with ``force_plan``.

        Args:
            plan: ``"H"``, ``"L"``, ``"R"`` for every unit, or unit name (globs allowed) -> action.
            rows: optional per-sequence actions (``"H"``/``"L"``/``"E"``) for H/L units.
        """
        self.policy = None
        self.apply_plan(plan, rows)

    def apply_plan(self, plan: Mapping[str, str] | str, rows: Mapping[str, tuple[str, ...]] | None = None):
        """``set_plan`` for the policy: the same checks, the policy stays in charge."""
        if not isinstance(plan, str) and self._units:
            names = [u.name for u in self._units]
            unmatched = [p for p in plan if not any(fnmatch.fnmatchcase(n, p) for n in names)]
            if unmatched:
                raise HiLoReError(f"set_plan: patterns {unmatched} match no recovery unit; unit "
                                  f"names look like {names[0]!r}.")
        if isinstance(plan, str):
            self._check_action(plan, "set_plan")
        self._plan = {u.name: self._check_action(_lookup(plan, u.name, self._plan[u.name]), "set_plan")
                      for u in self._units}
        self._plan_source = plan
        rows = dict(rows or {})
        for name, actions in rows.items():
            self._unit(name)
            for action in actions:
                if action not in ("H", "L", "E"):
                    raise HiLoReError(f"set_plan rows[{name!r}]: unknown action {action!r}; "
                                      "per-sequence actions are 'H', 'L' or 'E'.")
                if action == "L":
                    self._check_action(action, f"set_plan rows[{name!r}]")
        self._rows = rows

    def plan_actions(self) -> list[str]:
        """The capture action of every unit, in unit order, after ``force_plan``."""
        return [self.config.force_plan_for(u.name) or self._plan[u.name] for u in self._units]

    def sync_plan(self) -> str:
        """Make every rank capture with rank 0's plan; returns the plan hash.

        A collective: every rank calls it at the same point (``ds_hilore.initialize`` and each
        optimizer step do). ZeRO-3 gathers parameters in a recompute, so ranks whose plans
        differed would issue different collectives and hang.
        """
        if self.collective is not None and self._units:
            actions = self.collective.broadcast_actions([self._plan[u.name] for u in self._units])
            self._plan = dict(zip((u.name for u in self._units), actions))
        digest = self.plan_hash()
        logger.debug("hilore plan %s", digest)
        return digest

    def plan_hash(self) -> str:
        return hashlib.sha1("".join(self.plan_actions()).encode()).hexdigest()[:12]

    def downgrade(self, name: str, action: str, rows=None) -> None:
        """Lower the fidelity of a unit captured in the current microbatch; frees bytes at once.

        H -> L, H -> R, L -> R, and H/L -> E for sequences whose loss coefficients are zero.
        ``rows`` (sequence indices) apply to L and E; R is per unit.
        """
        unit = self._unit(name)
        frame = self._mb.frame(unit.layer_index) if self._mb is not None else None
        if frame is None:
            raise HiLoReError(f"downgrade({name!r}): no microbatch of this unit is alive; call it "
                              "between the forward and the backward of a microbatch.")
        pos = unit.pos
        current = frame.plan.actions[pos]
        allowed = {"H": {"L", "R", "E"}, "L": {"L", "R", "E"}, "R": {"R"}}[current]
        if action not in allowed:
            raise HiLoReError(f"downgrade({name!r}, {action!r}): the unit was captured as "
                              f"{current!r}; allowed: {sorted(allowed)} (fidelity only goes down).")
        if action == "R" and rows is not None:
            raise HiLoReError(f"downgrade({name!r}, 'R', rows=...): R is per unit; pass rows=None.")
        if action == "L" and self._codec is None:
            raise HiLoReError(f"downgrade({name!r}, 'L'): low_precision is 'none'; set it to 'int8' "
                              "or 'fp8_e4m3' in the \"hilore\" block.")
        frame.downgrade(pos, action, rows)
        self._summarise(self._mb)

    def expect(self, exposure, step_exposure: float | None = None) -> None:
        """Predicted exposure of the next microbatch's sequences, before its forward: the plan
        splits them by it, never stores those predicted 0 and spends the memory they leave.

        Args:
            exposure: (B,) per sequence, e.g. ``ds_hilore.grpo.exposure.predicted(advantages,
                response_mask)`` (|A_i| x response tokens). Only when a zero means a zero loss
                coefficient: on-policy, beta = 0, no entropy bonus; otherwise do not call this.
            step_exposure: optional, the same summed over the optimizer step's microbatches on
                every rank (the risk then reads the microbatch against its step).

        Does nothing without the allocator (``set_plan`` / ``force_plan`` decide then).
        """
        if self.policy is not None:
            values = exposure.tolist() if isinstance(exposure, torch.Tensor) else exposure
            self.policy.expect(values, step_exposure)

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
        frames = mb.live_frames()
        _check_coefficients(coefficients, frames[0], offset)
        mb.coefficients = coefficients.detach()
        if self.config.exposure_source == "hidden_grad":
            return  # the user asked for the automatic source only
        self._elision.apply(mb, mb.coefficients, offset, source="analytic")

    def _microbatch_of(self, logp: torch.Tensor | None) -> "Microbatch | None":
        """The live microbatch whose last layer output ``logp`` was computed from."""
        live = [mb for mb in list(self._live_mbs) if mb.live_frames()]
        if logp is not None and logp.grad_fn is not None and len(live) > 1:
            found = _first_reached(logp, {mb.last_hidden_fn: mb for mb in live
                                          if mb.last_hidden_fn is not None})
            if found is not None:
                return found
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
        return {} if self._mb is None else {k: v.tolist() for k, v in self._mb.exposure.items()}

    @property
    def token_weights(self) -> torch.Tensor | None:
        """|ω| (analytic) or ‖∂L/∂h_t‖ (automatic) of the current microbatch on hidden positions (B, T)."""
        return None if self._mb is None else self._mb.token_weights

    @property
    def stats(self) -> dict[str, Any]:
        """Measurements of the last optimizer step (or of the step in progress before any)."""
        mbs = self._last_step if self._last_step is not None else self._step
        mbs = [self._microbatch_stats(m) for m in mbs]
        out = {"actions": _sum_dicts(m["actions"] for m in mbs),
               "bytes": _sum_dicts(m["bytes"] for m in mbs),
               "microbatches": mbs, "peak_bytes": None,
               "grad_error_est": None, "grad_error_measured": None}
        for key in ("recomputed_units", "pack_s", "unpack_s", "recompute_s", "nonfinite_slices"):
            out[key] = sum(m[key] for m in mbs)
        errors = relative_errors([e for m in mbs for e in m.pop("_packed_stats")])
        out["packed_rel_error_max"] = max(errors, default=0.0)
        if self.policy is not None:  # peak, budget, error estimates, plans (ds_hilore.plan)
            out.update(self.policy.stats)
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

    def end_step(self) -> None:
        """Close the optimizer step: ``stats`` now reports it."""
        if self.policy is not None:
            self.policy.end_step()
            self._warn_if_never_planned()
        self._last_step, self._step = self._step, []

    def _warn_if_never_planned(self) -> None:
        """Said once: the policy has run many microbatches and planned none (HiLoRe is GC)."""
        wanted = max(_UNPLANNED_WARNING_MICROBATCHES, 4 * self.config.profile_microbatches)
        if self._warned_unplanned or self._n_microbatches < wanted:
            return
        self._warned_unplanned = True
        plans = self.policy.stats.get("plans") or {}
        if any(plan is not None for plan in plans.values()):
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
        state = {"version": 1, "plan": dict(self._plan), "microbatches_seen": self._n_microbatches}
        if self.policy is not None:  # profiles, calibration: a resume does not measure again
            state["policy"] = self.policy.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != 1:
            raise HiLoReError(f"unknown ds_hilore state version {state.get('version')!r}")
        known = {u.name for u in self._units}
        self._plan.update({k: v for k, v in state.get("plan", {}).items() if k in known})
        self._n_microbatches = int(state.get("microbatches_seen", 0))
        if self.policy is not None and state.get("policy"):
            self.policy.load_state_dict(state["policy"])

    # ------------------------------------------------------------------ installation
    def _install(self) -> None:
        for layer in self._layers:
            module = layer.module
            if is_checkpointing_layer(module):
                self._remember(module, "_gradient_checkpointing_func")
                self._remember(module, "gradient_checkpointing")
                module._gradient_checkpointing_func = _LayerCall(self, layer)
                module.gradient_checkpointing = True
            else:
                self._remember(module, "forward")
                module.forward = _ForwardWrapper(self, layer, module.forward)
        try:
            from transformers import PreTrainedModel
        except ImportError:
            PreTrainedModel = ()
        for module in self.model.modules():
            if PreTrainedModel and isinstance(module, PreTrainedModel):
                self._remember(module, "_set_gradient_checkpointing")
                module._set_gradient_checkpointing = _Toggle(self, module._set_gradient_checkpointing)
        self._hooks.append(self.model.register_forward_pre_hook(self._begin_forward, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(self._end_forward))
        # the leaf module running names the weight an autocast cast comes from (weights.py)
        for layer in self._layers:
            for leaf in layer.module.modules():
                if next(leaf.children(), None) is None and next(leaf.parameters(False), None) is not None:
                    self._hooks.append(leaf.register_forward_pre_hook(self._enter_leaf))
                    self._hooks.append(leaf.register_forward_hook(self._leave_leaf))
        self.attached = True
        _ATTACHED.add(self)

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
        if self._plans_forward() and module.training:
            self._forward_begun = True
            self.policy.begin_forward(args, kwargs)

    @outside_compile  # NOTE [ Compiled layers ] (units.py)
    def _end_forward(self, module, args, output) -> None:
        self._forward_begun = False  # a forward that ran no HiLoRe layer begins nothing later

    def _begin_at_layer(self, layer: LayerUnits, args: tuple, function) -> None:
        """A forward that did not pass through the model's pre-hook: begin it here."""
        begun, self._forward_begun = self._forward_begun, False
        if not begun and layer is self._layers[0] and self._plans_forward():
            hidden = hidden_input(args, getattr(function, "keywords", {}))  # (B, T, H)
            self.policy.begin_forward((hidden,), {}, replayable=False)

    def _plans_forward(self) -> bool:
        return (self.policy is not None and self.enabled and torch.is_grad_enabled()
                and not self._probing and all(layer.split is not None for layer in self._layers))

    def _enter_leaf(self, module, args) -> None:
        self._weights.leaf = module

    def _leave_leaf(self, module, args, output) -> None:
        self._weights.leaf = None

    def _remember(self, obj, name: str) -> None:
        self._saved.append((obj, name, name in obj.__dict__, obj.__dict__.get(name)))

    def _switch(self, enable: bool, every_n_layers: int = 1) -> None:
        """HiLoRe on / off; with ``every_n_layers`` N > 1 only every N-th layer is HiLoRe's, the
        others keep their activations (plain autograd), as transformers defines it."""
        self._switched_on = enable
        self._every_n_layers = every_n_layers
        self._last_active = self._layers[(len(self._layers) - 1) // every_n_layers * every_n_layers].index
        for position, layer in enumerate(self._layers):
            if is_checkpointing_layer(layer.module):
                layer.module.gradient_checkpointing = enable and position % every_n_layers == 0
                layer.module._gradient_checkpointing_func = _LayerCall(self, layer)

    # ------------------------------------------------------------------ discovery
    def _probe(self) -> None:
        """Find every layer's units now, with one small forward (``discovery.probe``); other
        models, or a probe that fails, find their units at the first training forward."""
        if all(layer.split is not None for layer in self._layers):
            return
        self._probing, warned = True, self._warned_cache
        self._warned_cache = True  # the probe's own cache is dropped quietly
        try:
            failure = discovery.probe(self.model)
        finally:
            self._probing, self._warned_cache = False, warned
            self._mb, self._step, self._n_microbatches = None, [], 0
        if failure:  # said once, at attach; the first training forward finds the units instead
            logger.info("ds_hilore: %s; recovery units will be found at the first training "
                        "forward.", failure)

    def _discover(self, layer: LayerUnits, function, args: tuple):
        device = hidden_input(args, getattr(function, "keywords", {})).device
        out, split = discovery.discover(layer, function, args, device,
                                        lambda t: self._weights(t, layer.module) is not None)
        for other in self._layers:  # at the probe, every layer proves itself
            if other is layer or (not self._probing and other.split is None
                                  and other.signature == layer.signature):
                other.set_split(split)
        self._renumber()
        return out

    def _renumber(self) -> None:
        """Number the units found so far; check force_plan once every layer has its units."""
        self._units = tuple(u for layer in self._layers for u in layer.units)
        for index, unit in enumerate(self._units):
            unit.index = index
        self._plan = {u.name: self._plan.get(u.name) or _lookup(self._plan_source, u.name, "R")
                      for u in self._units}
        if self._units and all(layer.units for layer in self._layers):
            unmatched = self.config.unmatched_force_plan_patterns([u.name for u in self._units])
            if unmatched:
                raise HiLoReNameError(f"hilore.force_plan patterns {unmatched} match no recovery unit; "
                                      f"unit names look like {self._units[0].name!r} (all: runtime.units). "
                                      "Fix the globs, or remove the keys that match nothing.")

    # ------------------------------------------------------------------ per layer call
    @outside_compile  # NOTE [ Compiled layers ] (units.py)
    def _run_layer(self, layer: LayerUnits, function, args: tuple):
        if not torch.is_grad_enabled():
            return function(*args)
        function, args = self._without_cache(layer, function, args)
        if layer.split is None:
            return self._discover(layer, function, args)
        mb = self._microbatch_for(layer, args, function)
        frame = LayerFrame(layer, function, args, self._capture_plan(layer), mb)
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
            hidden.register_hook(functools.partial(self._elision.on_layer_grad, mb, weakref.ref(frame), last))
            if last:
                mb.last_hidden_fn = id(hidden.grad_fn)
        if last:
            mb.batch, mb.seq_len = frame.batch, frame.seq_len
            self._summarise(mb)
        return out

    def _without_cache(self, layer: LayerUnits, function, args: tuple):
        function, args, dropped = drop_cache(layer.module, function, args)
        if dropped and not self._warned_cache:
            logger.warning("ds_hilore: the KV cache passed to %s is dropped while HiLoRe is on "
                           "(a recompute would read what the forward wrote); pass use_cache=False "
                           "to the training forward to silence this.", type(layer.module).__name__)
            self._warned_cache = True
        return function, args

    def _packed_sequences(self, mb: Microbatch, frame: LayerFrame, function) -> bool:
        """Whether the microbatch packs several sequences into one row (position_ids restart,
        as OpenRLHF and TRL's padding-free mode produce); if so, hands ``frame`` its segments.
        Read once per microbatch, and only for one-row inputs (and once more for a layer whose
        attention mask is another tensor than the first layer's).

        NOTE [ Packed sequences ]
        A packed row holds several sequences: segment k is the token range [s_k, e_k), s_k
        the positions where position_ids restart at 0 (and 0). The segments are the
        microbatch's sequences wherever rows are otherwise: per-sequence slices (of storages
        proven token-major: storage.segment_spans; others are kept whole), packing, exposure
        (one value per segment), zero detection and elision, and the elision checks (the
        gradient at the elided segments' token ranges). Per-sequence plans (set_plan rows) give
        one action per segment, or one for the whole row.
        Unlike rows, segments of one row can see each other: attention mixes them unless its
        mask keeps each query inside its own segment. An earlier segment with zero
        coefficients read by a later one gets gradient *inside* a layer, where no check at a
        layer's output sees it -- eliding it would be wrong. So a segment is elided only when
        (a) the attention mask of every layer is a tensor proving that no query attends
        outside its segment (transformers builds such a mask from packed position_ids when no
        attention_mask is passed; checked here on the device, with the segments), or (b) it
        and every segment after it have zero coefficients: in a causal model nothing reads
        the last tokens. Otherwise (a plain causal mask, or no mask tensor: SDPA's is_causal,
        flash-attention's varlen) a zero segment followed by a non-zero one stays kept: exact.
        The check at the last layer's output still decides between E and R as for rows
        (NOTE [ Checked elision ] in elision.py); a layer mixing tokens outside its attention
        (a convolution) would send gradient to an elided segment through the layer below's
        output, which the per-layer flags catch: an error, never a silent wrong gradient.
        """
        keywords = getattr(function, "keywords", None) or {}
        position_ids = keywords.get("position_ids")
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
                or position_ids.shape[0] != 1 or position_ids.shape[1] < 2 \
                or position_ids.shape[1] != frame.seq_len:
            return False
        mask = keywords.get("attention_mask")
        if mb.packed is None:  # the first layer: find the segments (one read)
            starts = position_ids[0] == 0
            starts[0] = True
            mixing = _segments_mix(mask, starts)
            values = torch.cat([starts, mixing.view(1)]).tolist()  # the one read
            bounds = [t for t, v in enumerate(values[:-1]) if v]
            if len(bounds) < 2:
                return False
            mb.segments = list(zip(bounds, bounds[1:] + [frame.seq_len]))
            mb.mask_independence = {_mask_key(mask): not values[-1]}
            if not self._warned_packed:
                logger.warning("ds_hilore: packed sequences (one row, restarting position_ids): "
                               "slices, exposure and elision act per packed sequence (segment). "
                               "A segment with zero loss coefficients is elided only where the "
                               "attention mask keeps segments apart, or when no later segment "
                               "has coefficients (exact either way).")
                self._warned_packed = True
        key = _mask_key(mask)
        if key not in mb.mask_independence:  # another mask (e.g. a sliding-window layer)
            starts = torch.zeros(frame.seq_len, dtype=torch.bool, device=position_ids.device)
            starts[[s for s, _ in mb.segments]] = True
            mb.mask_independence[key] = not bool(_segments_mix(mask, starts))
        frame.set_segments(mb.segments, mb.mask_independence[key])
        return True

    def _microbatch_for(self, layer: LayerUnits, args: tuple, function) -> Microbatch:
        """A layer index not above the previous one starts a new forward: a new microbatch."""
        if self._mb is None or layer.index <= self._mb.last_layer:
            self._begin_at_layer(layer, args, function)
            self._mb = Microbatch(self._n_microbatches, self)
            self._live_mbs.add(self._mb)
            self._n_microbatches += 1
            self._step.append(self._mb.summary)
            if len(self._step) > _MAX_MICROBATCHES_KEPT:
                del self._step[0]
            if self.policy is not None and not self._probing:
                self.policy.begin_microbatch(self._mb)
        return self._mb

    def _capture_plan(self, layer: LayerUnits) -> CapturePlan:
        actions = [self.config.force_plan_for(u.name) or self._plan[u.name] for u in layer.units]
        rows = [self._rows.get(u.name) for u in layer.units]
        return CapturePlan(actions, rows)

    def _summarise(self, mb: Microbatch) -> None:
        actions, nbytes = {a: 0 for a in "HLRE"}, {a: 0 for a in "HLRE"}
        for layer in self._layers:
            frame = mb.frame(layer.index)
            if frame is None:
                continue
            for pos, unit in enumerate(layer.units):
                action, held = frame.unit_summary(pos)
                unit.action, unit.nbytes = action, sum(held.values())
                actions[action] += 1
                for k, v in held.items():
                    nbytes[k] += v
        mb.summary.update(index=mb.index, actions=actions, bytes=nbytes, counters=mb.counters,
                          exposure_source=mb.source, exact_zero_sequences=len(mb.zero_rows))

    @staticmethod
    def _microbatch_stats(summary: dict) -> dict[str, Any]:
        c: Counters = (summary.get("counters") or Counters()).resolve()
        return {"index": summary.get("index"), "actions": dict(summary.get("actions", {})),
                "bytes": dict(summary.get("bytes", {})), "recomputed_units": c.recomputed_units,
                "pack_s": c.pack_s, "unpack_s": c.unpack_s, "recompute_s": c.recompute_s,
                "nonfinite_slices": c.nonfinite_slices, "_packed_stats": list(c.packed_stats),
                "exposure_source": summary.get("exposure_source"),
                "exact_zero_sequences": summary.get("exact_zero_sequences", 0)}

    # ------------------------------------------------------------------ helpers
    def _unit(self, name: str) -> Unit:
        for unit in self._units:
            if unit.name == name:
                return unit
        raise HiLoReError(f"no recovery unit named {name!r}; units look like {self._units[0].name!r}")

    def _check_action(self, action: str, where: str) -> str:
        if action not in ACTIONS:
            raise HiLoReError(f"{where}: unknown action {action!r}; allowed: {list(ACTIONS)}")
        if action == "L" and self._codec is None:
            raise HiLoReError(f"{where}: action 'L' needs low_precision 'int8' or 'fp8_e4m3' in the "
                              "\"hilore\" block (it is 'none').")
        return action


def _checkpointing_on(layers: list[LayerUnits]) -> bool:
    """Whether the script turned gradient checkpointing on for these layers (NOTE [ The
    script's checkpointing ]): a transformers layer's flag is set, or no layer has the flag."""
    flagged = [layer.module for layer in layers if is_checkpointing_layer(layer.module)]
    return not flagged or any(getattr(m, "gradient_checkpointing", False) for m in flagged)


def _mask_key(mask) -> tuple | None:
    if not isinstance(mask, torch.Tensor):
        return None
    return (mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), mask.dtype)


def _segments_mix(mask, starts: torch.Tensor) -> torch.Tensor:
    """() bool on the device: whether the attention mask lets a query see a key of another
    segment (``starts``: (T,) True at each segment's first token). True (mixing assumed) for
    anything but a (1, heads or 1, T, T) boolean mask (True: attend) or additive float mask
    (its dtype's minimum or -inf: masked)."""
    seq_len = starts.shape[0]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[0] != 1 \
            or tuple(mask.shape[-2:]) != (seq_len, seq_len) \
            or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        return torch.ones((), dtype=torch.bool, device=starts.device)
    segment = starts.long().cumsum(0)  # (T,) segment number of every token
    mixing = torch.zeros((), dtype=torch.bool, device=mask.device)
    chunk = max(1, (1 << 24) // seq_len)  # query rows at a time: bounded temporary memory
    for q0 in range(0, seq_len, chunk):
        block = mask[0, :, q0:q0 + chunk]  # (heads, q, T)
        allowed = block if block.dtype == torch.bool else block > torch.finfo(block.dtype).min
        cross = segment[q0:q0 + chunk, None].to(mask.device) != segment[None].to(mask.device)
        mixing = mixing | (allowed.any(0) & cross).any()
    return mixing.to(starts.device)


def _lookup(plan: Mapping[str, str] | str, name: str, default: str) -> str:
    if isinstance(plan, str):
        return plan
    found = default
    for pattern, action in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            found = action
    return found


def _check_coefficients(coefficients: torch.Tensor, frame: LayerFrame, offset: int | None) -> None:
    if coefficients.shape[0] != frame.batch:
        raise HiLoReError(f"{coefficients.shape[0]} sequences of coefficients, but the microbatch's "
                          f"forward had {frame.batch}; pass those of the same microbatch (one row "
                          "per sequence).")
    exposure.align(coefficients[:0], frame.seq_len, offset)  # raises if ω does not fit


def _sum_dicts(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _receive_coefficients(coefficients: torch.Tensor, logp: torch.Tensor, model: nn.Module | None) -> None:
    """ω published by a ``ds_hilore.grpo`` loss goes to the runtime of the model it came from:
    ``model``'s, else the only one attached, else the one whose live forward ``logp`` was
    computed from (an actor and a critic both attached, no ``model=`` given)."""
    runtime = find_runtime(model)
    if runtime is None and model is None:
        runtime = _runtime_of(logp)
    if runtime is not None and runtime.enabled:
        runtime.set_coefficients(coefficients, logp=logp)


def _runtime_of(logp: torch.Tensor) -> "HiLoReRuntime | None":
    """The attached runtime with a live microbatch whose last layer output ``logp`` comes from."""
    return _first_reached(logp, {mb.last_hidden_fn: rt for rt in list(_ATTACHED) if rt.attached
                                 for mb in list(rt._live_mbs)
                                 if mb.last_hidden_fn is not None and mb.live_frames()})


def _first_reached(logp: torch.Tensor, wanted: dict):
    """The value of ``wanted`` (keyed by ``id`` of a layer output's grad_fn) whose node the
    autograd graph of ``logp`` reaches first, walking back at most ``_MAX_GRAPH_WALK`` nodes
    (the LM head is a few nodes above the last layer's output); None when none is reached."""
    seen, todo = set(), [logp.grad_fn] if logp.grad_fn is not None else []
    while todo and len(seen) < _MAX_GRAPH_WALK:
        node = todo.pop()
        if id(node) in wanted:
            return wanted[id(node)]
        if id(node) not in seen:
            seen.add(id(node))
            todo.extend(n for n, _ in node.next_functions if n is not None)
    return None


handoff.subscribe(_receive_coefficients)
