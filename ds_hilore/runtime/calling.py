"""A decoder layer's call under HiLoRe: where a microbatch begins, the layer's frame, its
rows split by a prediction (NOTE [ Kept rows only ] in rows.py), the gate and hooks on its
output. The part of ``HiLoReRuntime`` (core.py) that runs layers; its state lives on the
runtime."""

from __future__ import annotations

import functools
import logging
import weakref

import torch
import torch.utils.checkpoint

from ds_hilore.runtime import packed, report, rows
from ds_hilore.runtime.bundle import CapturePlan, LayerFrame
from ds_hilore.runtime.calls import drop_cache, hidden_input
from ds_hilore.runtime.elision import gradient_entry
from ds_hilore.runtime.microbatch import Microbatch
from ds_hilore.runtime.registry import mark_last_hidden
from ds_hilore.runtime.replay import RngState
from ds_hilore.runtime.units import LayerUnits, outside_compile
from ds_hilore.runtime.zero_backward import gate

logger = logging.getLogger("ds_hilore")

_MAX_MICROBATCHES_KEPT = 64
_SKIP_MEMORY = 32  # microbatches after a skipped backward whose all-R layers keep their frames


class LayerCalls:
    """Runs the layers of ``HiLoReRuntime`` (core.py)."""

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
        if layer is not self._layers[0]:
            return
        hidden = hidden_input(args, getattr(function, "keywords", {}))  # (B, T, H)
        if self._handed_rows is not None:
            self._check_handed(hidden)
        if not begun:
            self._run_when_units_known()
        if not begun and self._plans_forward():
            self.policy.begin_forward((hidden,), {}, replayable=False)

    def _check_handed(self, hidden: torch.Tensor) -> None:
        """A prediction (``expect``) is one value per row of the forward it precedes; one of
        another length is not used (the plan and the rows then ignore it): said once. A packed
        row of several sequences is one row, and a prediction cannot run part of it apart."""
        handed, self._handed_rows = self._handed_rows, None
        rows = hidden.shape[0] if hidden.dim() >= 2 else 1
        if handed == rows:
            return
        packed = (" Where one row packs several sequences, they run its layers together: a "
                  "prediction cannot run part of a row apart." if rows == 1 else "")
        logger.log(logging.DEBUG if self._warned_handed else logging.WARNING,  # said once
                   "ds_hilore: expect() was handed %d values before a forward of %d rows: not "
                   "used (one value per row of the next training forward).%s", handed, rows,
                   packed)
        self._warned_handed = True

    def _plans_forward(self) -> bool:
        return (self.policy is not None and self.enabled and torch.is_grad_enabled()
                and not self._probing and all(layer.split is not None for layer in self._layers))

    # ------------------------------------------------------------------ per layer call
    @outside_compile  # NOTE [ Compiled layers ] (units.py)
    def _run_layer(self, layer: LayerUnits, function, args: tuple):
        if not torch.is_grad_enabled():
            return function(*args)
        if self._weights.wants_leaf is not None and self._leaf_hooks_due(args, function):
            self._weights.wants_leaf()  # NOTE [ Leaf hooks, when a cast needs them ] (install.py)
        function, args = self._without_cache(layer, function, args)
        if layer.split is None:
            return self._discover(layer, function, args)
        mb = self._microbatch_for(layer, args, function)
        if self.gc_forward:
            return self._run_as_gc(layer, mb, function, args)
        if mb.split is not None:
            return self._run_split(layer, mb, function, args)
        return self._run_frame(layer, mb, function, args)

    def _leaf_hooks_due(self, args: tuple, function) -> bool:
        """Whether this layer call may save a cast of a frozen weight: autocast on for its
        device, or a layer holding a floating weight other than fp32."""
        if self._not_fp32 is None:
            self._not_fp32 = any(p.is_floating_point() and p.dtype != torch.float32
                                 for layer in self._layers for p in layer.module.parameters())
        if self._not_fp32:
            return True
        device = hidden_input(args, getattr(function, "keywords", None) or {}).device.type
        return torch.is_autocast_enabled(device)

    def _run_frame(self, layer: LayerUnits, mb: Microbatch, function, args: tuple):
        """The layer's call through its frame (bundle.py), the gate and hooks on its output."""
        plan = self._capture_plan(layer)
        if mb.rows_refused:  # planned for kept rows, run whole: nothing kept (NOTE [ Kept rows only ])
            plan = CapturePlan(["R"] * len(layer.units))
        if self._checkpointed(layer, plan, mb, function, args):
            return self._run_checkpointed(layer, mb, function, args)
        whole = self._keeps_everything(layer, plan, mb, function, args)
        known = whole is not None and layer.row_safe is not None and layer.whole_known(whole)
        last = layer.index == self._last_active
        if known and not last:
            return self._run_whole(layer, mb, function, args, whole)
        frame = LayerFrame(layer, function, args, plan, mb)
        frame.whole_key = whole  # its bytes serve the calls without a frame at this shape
        if known:  # the last layer: a frame for the microbatch's checks, not for keeping
            frame.kept_whole, mb.top_frame = True, frame
            frame.whole_held = mb.whole[layer.index] = layer.whole_bytes[whole]
        if mb.packed is not False:  # one-row inputs only: position_ids are (1, T) for any batch
            mb.packed = frame.batch == 1 and self._packed_sequences(mb, frame, function)
        mb.frames[layer.index] = weakref.ref(frame)
        mb.last_layer = layer.index
        out = frame.run()
        if layer.row_safe is None and mb.split is None:
            self._learn_rows(layer, frame, out)
        frame.elision_ok, frame.check_every_layer = gradient_entry(out)
        hidden = _hidden_of(out)
        if hidden is not None and hidden.requires_grad:
            if last and self.zero_backward_skip:  # NOTE [ A backward of zeros ] in zero_backward.py
                if self._trainable is None:  # listed once per optimizer step (end_step)
                    self._trainable = [p for p in self.model.parameters() if p.requires_grad]
                gated = gate(hidden, mb, self._trainable)
                out = _replaced(out, hidden, gated)
                hidden, mb.gated = gated, True
                mb.predicted_zero = getattr(self.policy, "predicted_zero", False)
            hidden.register_hook(functools.partial(self._elision.on_layer_grad, mb, weakref.ref(frame), last))
            if last:
                mark_last_hidden(mb, hidden)  # NOTE [ The last layer's output, marked ] (registry.py)
        if last:
            mb.batch, mb.seq_len = frame.batch, frame.seq_len
            self._summarise(mb)
        return out

    def _run_split(self, layer: LayerUnits, mb: Microbatch, function, args: tuple):
        """NOTE [ Kept rows only ] in rows.py: the rows predicted zero without autograd, the
        kept ones through the frame, put back in the batch's order."""
        split = mb.split
        if layer is self._layers[0] and rows.internal_outputs_recorded():
            self._refuse_rows(mb, "transformers records the layers' internal outputs")
            return self._run_frame(layer, mb, function, args)
        device = hidden_input(args, getattr(function, "keywords", None) or {}).device
        uncalled = split.index("zero" if split.zero else "probe", device)
        zero_function, zero_args = rows.select(function, args, uncalled, split.batch)
        with torch.no_grad():
            zero_out = zero_function(*zero_args)
        if len(split.kept) < split.batch:
            function, args = rows.select(function, args, split.index("kept", device), split.batch)
        out = self._run_frame(layer, mb, function, args)
        return rows.merge(out, zero_out, split, mb) if split.zero else out

    def _refuse_rows(self, mb: Microbatch, why: str) -> None:
        """A microbatch planned for its kept rows runs whole instead, all R (nothing kept:
        within any budget); the same on every rank (what refuses is the model's or the
        script's). Said once."""
        mb.split, mb.rows_refused = None, True
        if not self._warned_rows:
            self._warned_rows = True
            logger.info("ds_hilore: a microbatch predicted partly zero runs its rows whole, all "
                        "recomputed (%s): its zero rows' backward is not skipped.", why)

    def _learn_rows(self, layer: LayerUnits, frame: LayerFrame, out) -> None:
        """Whether ``layer`` may be called by rows (NOTE [ Kept rows only ]): it drew no random
        numbers, and its outputs can be put back together by rows. Learnt at its first call."""
        draws = not RngState(frame.device).same_as(frame.rng)
        layer.row_safe = not draws and rows.mergeable(out, frame.batch)
        if draws and not self._warned_rows:
            self._warned_rows = True
            logger.warning("ds_hilore: %s draws random numbers in training (dropout): the rows of "
                           "a microbatch predicted zero are not run apart from the others (their "
                           "masks would not be the whole batch's); they are elided as before. "
                           "GRPO actors usually train with dropout off.",
                           type(layer.module).__name__)

    def can_split(self) -> bool:
        """Whether microbatches may be run by rows (NOTE [ Kept rows only ]): every layer known
        safe, and ``elide_zero_rows`` not false. The same on every rank."""
        return self.config.elide_zero_rows is not False and bool(self._layers) and all(
            layer.row_safe for layer in self._layers)

    def _take_split(self, args: tuple, function) -> "rows.RowSplit | None":
        """The rows of the microbatch beginning: the policy's decision, or without one the
        prediction handed to ``expect`` (agreed over ranks whose module calls must match)."""
        split, expected = self._split_next, self._expected_next
        self._split_next = self._expected_next = None
        hidden = hidden_input(args, getattr(function, "keywords", None) or {})
        batch, length = (hidden.shape[0], hidden.shape[1]) if hidden.dim() >= 2 else (1, 1)
        if self.policy is None and expected is not None:
            ok = len(expected) == batch and rows.splittable(batch, length) and self.can_split()
            zero = ok and any(x == 0 for x in expected)
            if self.matched_calls and self.collective is not None:
                zero, cannot = self.collective.all_reduce_max([int(zero), int(not ok)])
                ok = ok and not cannot
            split = rows.plan_split(expected, batch, self.matched_calls) if ok and zero else None
        return split if split is not None and split.batch == batch else None

    # NOTE [ A layer that keeps nothing ]
    # A layer whose every unit is R keeps nothing but its input, as gradient checkpointing
    # does: its frame (a pack hook on every saved tensor, slot and weight bookkeeping, the
    # recompute's replay) would only cost host time. It runs under ``torch.utils.checkpoint``
    # (non-reentrant, RNG preserved, stopping early as HiLoRe's own re-run does: the same
    # gradients, bitwise), with the elision's hook on its output as any layer (a forward that
    # stops below the last layer is still seen). Not the last HiLoRe layer, whose frame carries
    # the microbatch's checks at the top of the backward (the coefficients, the leak check, a
    # skipped backward of zeros, which then never reaches the checkpointed layers); not on a
    # profiled microbatch (every unit measured), one whose units' token norms are wanted, one
    # predicted zero (NOTE [ A microbatch predicted zero ] in plan/scheduler.py: its frames
    # skip their recompute where no gate skips the backward), nor one run by its kept rows
    # (NOTE [ Kept rows only ] in rows.py: a layer not yet known row-safe learns it from its
    # frame). The same on every rank: the plan and the prediction's verdict are. A microbatch
    # found zero only after its forward, under ZeRO-3 (no gate), recomputes such a layer
    # where a frame would have read stand-ins.
    # Where the gate may skip the layers' backward (NOTE [ A backward of zeros ] in
    # zero_backward.py), a checkpointed layer below a gate that hands it no gradient still
    # recomputes when autograd reaches its nodes (their saved tensors are unpacked before the
    # gradients are looked at), where a frame skips it; the gradients are the same (the gate
    # hands the zeros to the parameters either way). So the layer is checkpointed there only
    # where sequences are not elided one by one (``elide_zero_rows`` false or ``"whole"``, as
    # on accelerators by default: a frame leaves an elided sequence out of its re-run, which a
    # checkpoint would re-run), and while skips are rare: none in the last ``_SKIP_MEMORY``
    # microbatches (groups shuffled across microbatches, no prediction: a microbatch all zero
    # comes about 1 in 256 with 8 sequences and half the groups zero). Once a skip is seen,
    # such layers keep their frames for that many microbatches (a microbatch per group: skips
    # are common); a skip that was predicted does not count (its microbatch ran through
    # frames). Each rank decides for itself: the graph, and so the order in which gradients
    # reach ZeRO 1-2's reductions, is the same either way.
    def _checkpointed(self, layer: LayerUnits, plan, mb: Microbatch, function, args) -> bool:
        if self._frame_wanted(layer, mb) or layer.row_safe is None \
                or any(a != "R" for a in plan.actions):
            return False
        if not self.zero_backward_skip:
            return True
        device = hidden_input(args, getattr(function, "keywords", None) or {}).device
        return mb.index - self._skipped_at > _SKIP_MEMORY and self.elision_mode(device) is not True

    def _frame_wanted(self, layer: LayerUnits, mb: Microbatch) -> bool:
        """Whether ``layer`` runs through its frame for more than what it keeps, whatever its
        plan: the last HiLoRe layer, or any layer of a microbatch that wants its frames (NOTE
        [ A layer that keeps nothing ])."""
        return layer.index == self._last_active or self._frames_wanted(mb)

    def _frames_wanted(self, mb: Microbatch) -> bool:
        """Whether every layer of ``mb`` runs through a frame that keeps: a profiled microbatch,
        token norms of every unit wanted, rows split or predicted zero (NOTE [ A layer that
        keeps everything ])."""
        return mb.profile is not None or mb.norms_all or mb.split is not None \
            or getattr(self.policy, "predicted_zero", False)

    # NOTE [ A layer that keeps everything ]
    # A layer whose every unit is H, in a microbatch that keeps what autograd keeps -- no
    # pointwise tensor re-derived (``mb.derive`` false: NOTE [ Derived tensors ] in derived.py)
    # and no zero sequence's bytes taken out of its storages (elision off or ``"whole"`` on this
    # device, or the policy keeps them whole: ``Scheduler.keeps_whole``) -- stores through its
    # frame exactly what autograd saves without one; the pack hook on every saved tensor, the
    # weights' recognition and the slots' bookkeeping only cost host time (a few ms per layer
    # and microbatch where layers are small). It runs as the model does without checkpointing,
    # with the elision's hook on its output as any layer. Its bytes are reported as its frame
    # counted them for inputs of the same shapes (and autocast), less the exposure's token norms
    # only a frame computes: the first call at a shape runs through the frame, later ones
    # without it. A layer keeps the bytes of its most recent shapes only (lengths that vary
    # per step never come back; ``LayerUnits.learn_whole``), and a microbatch takes those of
    # its own when it runs (``mb.whole``): its summary, made again at its loss, reads them
    # after later forwards of other shapes may have made the layer forget them.
    # The last HiLoRe layer keeps a frame for the microbatch's own work -- the coefficients'
    # shapes, the elision's flags and the check at the top of the backward, the summary -- but
    # that frame keeps nothing (``kept_whole``: no pack hook, no inputs held, nothing of it
    # downgraded; its bytes the learnt ones). No saved tensor holds it, so the microbatch does
    # (``top_frame``) until the top of its backward, which then reads the checks left
    # (``settle``) where the frame's first unpack would have: whether the last layer keeps
    # through its frame may differ between ranks, the point of that read and all-reduce may not.
    # Not where a frame is wanted for more than keeping: a profiled microbatch, one whose token
    # norms are wanted or that a matched pass weighs by its units' exposure (calibration, the
    # held-out ranking: the frames' token norms give it), rows split or predicted zero; nor
    # where the layer's parameters are partitioned between calls (ZeRO-3, FSDP), which a frame
    # references rather than holds. Below a gate that skips the backward (NOTE [ A backward of
    # zeros ] in zero_backward.py) its nodes get no gradient and have nothing to recompute:
    # allowed there, unlike a layer that keeps nothing. What it gives up: a microbatch whose
    # every sequence is zero keeps its bytes here (a frame would drop them; within the budget,
    # which priced them), and its units cannot be downgraded after its forward. Whether a layer
    # runs so may differ between ranks (a shape met first on one of them): no collective depends
    # on it, neither path issues one in the forward, and the backward's first reads are made at
    # the top of the last layer either way.
    def _keeps_everything(self, layer: LayerUnits, plan, mb: Microbatch, function,
                          args: tuple) -> tuple | None:
        """The shape key of a call that may run without a frame (NOTE [ A layer that keeps
        everything ]), else None."""
        if mb.derive or mb.pass_job is not None or self._frames_wanted(mb) \
                or any(a != "H" for a in plan.actions) \
                or any(rows is not None for rows in plan.rows) \
                or self._weights.partitioned(layer.module):
            return None
        keywords = getattr(function, "keywords", None) or {}
        device = hidden_input(args, keywords).device
        if self.elision_mode(device) is True and not (
                self.policy is not None and self.policy.keeps_whole(mb)):
            return None
        autocast = torch.get_autocast_dtype(device.type) \
            if torch.is_autocast_enabled(device.type) else None
        return _shapes(args) + _shapes(tuple(keywords.items())) + (autocast,)

    def _run_whole(self, layer: LayerUnits, mb: Microbatch, function, args: tuple, key: tuple):
        mb.whole[layer.index] = layer.whole_bytes[key]
        return self._without_frame(layer, mb, function(*args), functools.partial(
            self._elision.on_layer_grad, mb, _NO_FRAME, False))

    def _run_checkpointed(self, layer: LayerUnits, mb: Microbatch, function, args: tuple):
        mb.checkpointed.add(layer.index)
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        return self._without_frame(layer, mb, out, functools.partial(
            self._checkpointed_grad, mb, len(layer.units)))

    @staticmethod
    def _without_frame(layer: LayerUnits, mb: Microbatch, out, on_grad):
        """A layer run without its frame: the microbatch's last layer so far, ``on_grad`` on
        the gradient at its output (the elision's hook, as a frame's layer has)."""
        mb.last_layer = layer.index
        hidden = _hidden_of(out)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(on_grad)
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
        hidden = _hidden_of(out)
        if hidden is not None and hidden.requires_grad:
            mark_last_hidden(mb, hidden)
            hidden.register_hook(functools.partial(self._gc_top_grad, mb))
        for unit in self._units:  # the units report the latest microbatch
            unit.action, unit.nbytes = "R", 0
        mb.summary.update(index=mb.index, actions={"H": 0, "L": 0, "R": len(self._units), "E": 0},
                          bytes={a: 0 for a in "HLRE"}, counters=mb.counters, as_gc=True)
        return out

    def _gc_top_grad(self, mb: Microbatch, grad: torch.Tensor) -> None:
        mb.gc_backward_begun = True  # no loss of it is to come (NOTE [ Which forward a loss is of ])
        if self.policy is not None:
            self._elision.late.reseed(mb)
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
            self._mb.split = self._take_split(args, function)  # NOTE [ Kept rows only ] in rows.py
            self._mb.summary["position"] = self._n_microbatches - self._step_first  # in the step
            self._live_mbs.add(self._mb)
            self._n_microbatches += 1
            self._step.append(self._mb.summary)
            if len(self._step) > _MAX_MICROBATCHES_KEPT:
                del self._step[0]
            if self.policy is not None and not self._probing:
                self.policy.begin_microbatch(self._mb)
            elif self.policy is None and not self._probing:  # a plan set by hand: nothing to agree
                self._mb.local_checks = self.collective is not None and not self.matched_calls
            if self._mb.local_checks:  # NOTE [ A microbatch of its own ] in agreement.py
                self._elision.late.seed()
                self._mb.late_reads = self._elision.late.reads
        return self._mb

    def _summarise(self, mb: Microbatch) -> None:
        report.summarise(self._layers, mb)


def _NO_FRAME():  # noqa: N802 -- a dead weak reference: a checkpointed layer has no frame
    return None


def _shapes(values) -> tuple:
    """What a layer's saved bytes depend on among its arguments: each tensor's shape, dtype
    and whether it requires grad, through tuples, lists and (name, value) pairs; the rest by
    type (a cache, a flag)."""
    out = []
    for x in values:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, x.requires_grad))
        elif isinstance(x, (tuple, list)):
            out.append(_shapes(x))
        else:
            out.append(x if isinstance(x, (str, int, float, bool, type(None))) else type(x))
    return tuple(out)


def _replaced(out, old: torch.Tensor, new: torch.Tensor):
    """``out`` (a layer's output: a tensor, or a tuple / list holding it) with ``old`` as ``new``."""
    if out is old:
        return new
    return type(out)(new if x is old else x for x in out)


def _hidden_of(out) -> torch.Tensor | None:
    """The hidden states among a layer's outputs: the tensor, or the first tensor of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    return next((x for x in (out if isinstance(out, (tuple, list)) else ())
                 if isinstance(x, torch.Tensor)), None)
