"""Saved-tensor capture for one decoder-layer call: H / L / R storage and deterministic recompute.

NOTE [ Layer frames ]
Each call of a decoder layer with gradients on gets a ``LayerFrame``. The layer runs under a
``saved_tensors_hooks`` pair; every tensor autograd saves goes through ``LayerFrame._pack``,
which attributes it to the sub-block (unit) whose child module is executing and returns a
``Slot`` handle:

* weights are never captured (NOTE [ Weights are never captured ] in weights.py): a trainable weight, a view of one, a
  frozen (LoRA base) weight or an autocast cast of a weight becomes a ``WeightRef`` that
  rebuilds the tensor from the parameter on unpack;
* tensors sharing storage with the layer's inputs are referenced: the inputs are retained
  anyway, exactly as gradient checkpointing retains them;
* activations of an ``H`` unit are kept as they are, of an ``L`` unit packed per sequence, of an
  ``R`` unit dropped. Exposure may split a unit per sequence: row blocks kept ``H``, packed
  ``L`` or elided ``E`` (a sequence whose loss coefficients are all zero; NOTE [ Exact zeros ]
  in storage.py). The sequences are the rows, or the segments of a packed row (NOTE [ Packed
  sequences ] in packed.py: ``set_segments``, storage.segment_spans).

On backward, the first unpack of an empty slot re-runs the layer from its inputs with the
forward's RNG and autocast state (NOTE [ Recompute ] in replay.py).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from ds_hilore._errors import HiLoReError, bug
from ds_hilore.grpo.exposure import input_norms
from ds_hilore.runtime.calls import batch_and_length, drop_cache, hidden_input
from ds_hilore.runtime.derived import Derived, Live, derivation, view_spec
from ds_hilore.runtime.replay import (
    FastForward,
    Replay,
    RngState,
    StopReplay,
    autocast_state,
    placeholder,
    replay_autocast,
)
from ds_hilore.runtime.slots import ACT, INPUT, WEIGHT, Slot
from ds_hilore.runtime.storage import (
    FLOAT_DTYPES,
    MIN_PACK_GROUP,
    MIN_PACK_WIDTH_DIVISOR,
    Stored,
    row_block,
    segment_spans,
    stand_in_value,
)
from ds_hilore.runtime.units import LayerUnits

# importable from here as before the re-runs and the call's arguments had modules of their own
__all__ = ["CapturePlan", "FastForward", "LayerFrame", "Replay", "RngState", "StopReplay",
           "autocast_state", "drop_cache", "hidden_input", "placeholder", "replay_autocast"]


class CapturePlan:
    """What a layer call keeps: an action per unit and, for H/L units, per-sequence actions."""

    __slots__ = ("actions", "rows")

    def __init__(self, actions: list[str], rows: list[tuple[str, ...] | None] | None = None):
        self.actions = list(actions)
        self.rows = list(rows) if rows is not None else [None] * len(actions)

    def needs_fast_forward(self, pos: int) -> bool:
        return self.actions[pos] != "R" and "R" in self.actions[pos + 1:]



class _Unit:
    """Per-unit state of one layer call: slots, what it stores, what a re-run needs."""

    __slots__ = ("slots", "shapes", "stored", "by_ptr", "nodes", "token_norms", "rc_count")

    def __init__(self):
        self.slots: list = []  # weak refs of Slot, pack order
        self.shapes: list = []  # (shape, dtype) per slot
        self.stored: list[Stored] = []  # every storage the unit keeps
        self.by_ptr: dict[int, Stored | Derived] = {}  # one entry per storage: kept once
        # (autograd node, output number) -> (source, view spec, dtype) of the tensors saved so
        # far, while the forward (or a profiled re-run) runs: what a Derived may be built from
        self.nodes: dict = {}
        self.token_norms: torch.Tensor | None = None  # (B, T) unit-input norms, for exposure
        self.rc_count = 0  # tensors saved so far by the current re-run


class LayerFrame:
    """One decoder-layer call with gradients: inputs, RNG/autocast state and saved-tensor slots."""

    def __init__(self, layer: LayerUnits, fn: Callable, args: tuple, plan: CapturePlan, ctx):
        self.layer, self.split, self.fn, self.args, self.plan, self.ctx = \
            layer, layer.split, fn, args, plan, ctx
        keywords = getattr(fn, "keywords", {})
        inputs = [x for x in tree_flatten((args, keywords))[0] if isinstance(x, torch.Tensor)]
        self.input_ptrs = {x.untyped_storage().data_ptr() for x in inputs}
        hidden = hidden_input(args, keywords)
        self.batch, self.seq_len = batch_and_length(hidden, keywords.get("attention_mask"))
        # hidden states with dimensions of their own (Gemma-3n's (streams, B, T, H), hyper-
        # connections' (B, T, streams, H)) are never sliced per sequence: nothing is proven
        self.sliceable = hidden.dim() <= 3
        # NOTE [ Worth a codec call ] (storage.py): narrower tensors stay whole
        self.min_pack_width = hidden.shape[-1] // MIN_PACK_WIDTH_DIVISOR if hidden.dim() else 0
        self.device = hidden.device
        self.units = [_Unit() for _ in layer.units]
        self.current = 0
        self.depth = 0
        self.entered: set[int] = set()  # units whose first call has run
        self.calls: list[str] = []  # child calls of this forward, in order
        self.follows = True  # the calls match discovery's: fast-forward is allowed
        self.boundary: set[int] = set()  # storages entering a unit: never packed (kept exact)
        self.ff: dict[int, FastForward] = {}  # call -> what a fast-forward of it hands on
        self.rc_need: set[int] = set()
        # NOTE [ Packed sequences ] (packed.py): the token ranges of the sequences packed into
        # this call's one row, and whether its attention mask proves they never see each other
        self.segments: list[tuple[int, int]] | None = None
        self.segments_independent = False
        self.segments_causal = True  # no query reads a later key (the mask did not deny it)
        self.elided_rows: set[int] = set()  # sequences with zero loss coefficients
        self.rows_dropped: set[int] = set()  # of those, the ones whose kept bytes were dropped
        self.elision_ok = True  # gradient enters only through the output (runtime decides)
        self.elision_checked = False  # the backward checks elided rows (same on every rank)
        self.check_every_layer = False  # hidden states are recorded: check this layer too
        self.skip_zero_recompute = False  # every rank agreed: all sequences elided
        # the shape key under which its bytes are learnt, where it keeps what autograd keeps
        # (NOTE [ A layer that keeps everything ] in calling.py)
        self.whole_key: tuple | None = None
        # the last layer keeping what autograd keeps: run without the pack hooks, its bytes
        # those learnt at ``whole_key`` (``whole_held``, taken when it ran); nothing of it is
        # downgraded (calling.py, same NOTE)
        self.kept_whole = False
        self.whole_held: list | None = None

    @property
    def sequences(self) -> int:
        """Sequences of the call: rows, or the segments of a packed row."""
        return len(self.segments) if self.segments is not None else self.batch

    def set_segments(self, segments, independent: bool, causal: bool = True) -> None:
        """Sequences packed into the one row of this call (token ranges), before ``run``."""
        if self.batch != 1 or not self.sliceable or not segments or segments[-1][1] != self.seq_len:
            return
        self.segments, self.segments_independent = list(segments), bool(independent)
        self.segments_causal = bool(causal)

    def _check_rows(self) -> None:
        n = self.sequences
        for pos, (unit, rows) in enumerate(zip(self.layer.units, self.plan.rows)):
            if rows is not None and len(rows) == 1 and self.segments is not None:
                self.plan.rows[pos] = tuple(rows) * n  # the packed row's action, per segment
            elif rows is not None and len(rows) != n:
                raise HiLoReError(f"per-sequence plan of {unit.name} has {len(rows)} entries, but "
                                  f"this microbatch has {n} sequences; set_plan(rows=...) "
                                  "must give one action per sequence of the next microbatch.")

    # ------------------------------------------------------------------ forward
    def run(self):
        """The layer's forward under capture (``kept_whole``: without it, autograd keeping
        what it saves; the frame then needs neither the call nor its inputs again)."""
        self._check_rows()
        if self.kept_whole:  # held by its microbatch until the top of its backward: no tensor
            fn, args = self.fn, self.args
            self.fn = self.args = None
            return fn(*args)
        self.rng = RngState(self.device)
        self.autocast = autocast_state(self.device.type)
        self.autocast_cache = torch.is_autocast_cache_enabled()
        profile = self.ctx.profile
        fetches = contextlib.nullcontext()
        if profile is not None:
            self.clock = [(0, profile.now(self.device))]
            fetches = profile.fetches_left_out(self.device)  # ZeRO-3 (NOTE [ Timed the same way ])
        try:
            with fetches, self._child_hooks(), \
                    torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = self.fn(*self.args)
        finally:
            for unit in self.units:  # autograd nodes hold slots, slots hold this frame: no cycle
                unit.nodes.clear()
        if profile is not None:  # NOTE [ Profiling ]: the forward of a unit is what R re-runs
            self.clock.append((None, profile.now(self.device)))
            for (pos, begin), (_, end) in zip(self.clock, self.clock[1:]):
                profile.unit_time(self.layer.units[pos], end - begin)
        return out

    @contextlib.contextmanager
    def _child_hooks(self):
        handles = []
        for name, child in self.layer.module.named_children():
            handles.append(child.register_forward_pre_hook(
                lambda m, a, k, name=name: self._enter_child(name, a, k), with_kwargs=True))
            handles.append(child.register_forward_hook(lambda m, a, out: self._leave_child(out)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _enter_child(self, name: str, args, kwargs) -> None:
        self.depth += 1
        if self.depth > 1:  # a child called from inside another child: part of that call
            return
        call = len(self.calls)
        self.calls.append(name)
        if self.follows and (call >= len(self.split.calls) or self.split.calls[call] != name):
            self.follows = False  # attribution stays consistent; only fast-forward is off
        pos = self.split.unit_of_call(call)
        if pos not in self.entered:
            self.entered.add(pos)
            if self.ctx.profile is not None and pos:
                self.clock.append((pos, self.ctx.profile.now(self.device)))
            first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
            if first is not None:
                self.boundary.add(first.untyped_storage().data_ptr())
                if (self.plan.actions[pos] != "R" or self.ctx.norms_all) and self.ctx.codec is not None:
                    self.units[pos].token_norms = input_norms(first)  # exposure's token weights
                if self.ctx.profile is not None and self.ctx.codec is not None:
                    self.ctx.profile.unit_input(self, pos, first)  # the norms H / L would hold
        self.current = pos

    def _leave_child(self, output) -> None:
        self.depth -= 1
        if self.depth:
            return
        call = len(self.calls) - 1
        pos = self.split.unit_of_call(call)
        if self.ctx.profile is not None and self.follows and pos + 1 < len(self.units):
            # what a fast-forward of this call would keep and cost when a later unit is recomputed
            self.ctx.profile.fast_forward(self, pos, call, output)
        if self.follows and self.plan.needs_fast_forward(pos):
            # code of the layer body after this call (e.g. a dropout) draws from the RNG as it
            # is at the call's exit; a fast-forward must leave it there too
            rng = RngState(self.device)
            prev = self.ff[call - 1].rng if call - 1 in self.ff else self.rng
            self.ff[call] = FastForward(output, call, self.split.cut,
                                        prev if rng.same_as(prev) else rng)
        self.current = self.split.unit_of_segment(2 * call + 2)

    def _pack(self, t: torch.Tensor) -> Slot:
        pos = self.current
        unit = self.units[pos]
        unit.shapes.append((t.shape, t.dtype))
        weight = self.ctx.weight_ref(t, self.layer.module)
        if weight is not None:
            slot = Slot(self, pos, WEIGHT)
            slot.weight = weight
            if weight.proof is not None:  # read once per microbatch (storage.py)
                self.ctx.counters.checks.append((weight.proof, weakref.ref(self), pos, "cast",
                                                 weakref.ref(slot)))
                weight.proof = None
        elif t.untyped_storage().data_ptr() in self.input_ptrs:
            slot = Slot(self, pos, INPUT)
            slot.ref = t.detach()
        else:
            slot = Slot(self, pos, ACT)
            if self.plan.actions[pos] != "R":
                stored = self._store(pos, t)
                stored.attach(slot, t)
                if self.ctx.derive and t.grad_fn is not None:
                    unit.nodes[(t.grad_fn, t.output_nr)] = (stored, slot.view, t.dtype)
        unit.slots.append(weakref.ref(slot))
        return slot

    def _store(self, pos: int, t: torch.Tensor) -> Stored:
        unit = self.units[pos]
        ptr = t.untyped_storage().data_ptr()
        stored = unit.by_ptr.get(ptr)
        if stored is not None and not stored.weak.expired() and stored.dtype == t.dtype:
            return stored
        how = self._derivable(pos, t)
        if how is not None:  # NOTE [ Derived tensors ] (derived.py): no bytes, no rows to plan
            unit.by_ptr[ptr] = derived = Derived(t, *how, self.ctx.counters)
            return derived
        stored = self.new_stored(pos, t, self.ctx.counters)
        unit.by_ptr[ptr] = stored  # an address reused after free gets a new entry
        unit.stored.append(stored)
        rows = self.plan.rows[pos] or (self.plan.actions[pos],) * self.sequences
        for action in ("E", "L"):
            selected = [i for i, a in enumerate(rows) if a == action]
            if selected and (action == "E" or stored.packable):
                stored.set_rows(selected, action)
        return stored

    def _derivable(self, pos: int, t: torch.Tensor):
        """(op, inputs) when unit ``pos`` can re-derive ``t`` from what it already saved
        (NOTE [ Derived tensors ] in derived.py); never a storage entering a unit or the layer."""
        ptr = t.untyped_storage().data_ptr()
        if not self.ctx.derive or ptr in self.boundary or ptr in self.input_ptrs:
            return None
        return derivation(t, self.units[pos].nodes)

    def new_stored(self, pos: int, t: torch.Tensor, counters) -> Stored:
        """How unit ``pos`` keeps the saved tensor ``t`` (whole; per sequence if sliceable;
        packable or not), before any sequence is packed or elided."""
        if self.segments is not None:  # token ranges of a packed row (storage.segment_spans)
            block = segment_spans(t, self.segments, self.seq_len) if self.sliceable else None
            tok = block[-1][1] // self.seq_len if block else None  # elements per token
            group = t.shape[-1] if block and t.shape[-1] and tok % t.shape[-1] == 0 else tok
            # the mean slice: one short segment (a pad token) does not keep the whole row whole
            per_sequence = sum(b - a for a, b in block) // len(block) if block else None
        else:
            block = row_block(t, self.batch, self.seq_len) if self.sliceable else None
            group = t.shape[-1] if t.dim() and t.shape[-1] and block and block % t.shape[-1] == 0 else block
            per_sequence = block
            tok = block // self.seq_len if block and self.seq_len else None  # elements per token
        packable = (block is not None and t.dtype in FLOAT_DTYPES
                    and t.untyped_storage().data_ptr() not in self.boundary
                    and per_sequence >= self.ctx.min_pack_numel and self.ctx.codec is not None
                    and group >= MIN_PACK_GROUP and (tok or 0) >= self.min_pack_width)
        return Stored(t, self.sequences, block, group or 1, self.ctx.codec, packable, counters,
                      (weakref.ref(self), pos))

    # ------------------------------------------------------------------ after forward
    def downgrade(self, pos: int, action: str, rows=None) -> None:
        """H -> L / E (per sequence), H or L -> R (whole unit); frees the bytes at once. Where
        the microbatch's peak is checked, what each storage or unit freed by E or R is told to
        its ``freed`` (NOTE [ A bound for a check in part ] in plan/checks.py)."""
        if self.kept_whole:  # autograd's own tensors: nothing to free, exact as they are
            return
        freed = self.ctx.freed
        if freed is None or action == "L":  # packing by exposure: the plan's own
            self._downgrade(pos, action, rows, None)
            return
        with freed.aside():  # its own copies are not the plan's
            self._downgrade(pos, action, rows, freed)

    def _downgrade(self, pos: int, action: str, rows, freed) -> None:
        unit = self.units[pos]
        if action == "R":
            if freed is not None:  # recomputed at its first unpack: all of it until then
                freed.add((self.layer.index, pos), sum(self.unit_summary(pos)[1].values()))
            for ref in unit.slots:
                slot = ref()
                if slot is not None and slot.kind == ACT and slot.stored is not None:
                    slot.stored.release()
                    slot.ref = slot.stored = None
            unit.stored.clear()
            unit.by_ptr.clear()
            unit.token_norms = None  # exposure weighs kept units only
            self.plan.actions[pos] = "R"
            if not self.plan.needs_fast_forward(pos):
                self._drop_fast_forward(pos)
            return
        rows = list(range(self.sequences)) if rows is None else list(rows)
        for stored in unit.stored:
            if action == "E" or stored.packable:
                before = stored.held_bytes() if freed is not None else 0
                stored.set_rows(rows, action)
                if freed is not None:  # decoded whole at its first unpack: until then
                    freed.add((self.layer.index, pos), before - stored.held_bytes(), stored)

    def _drop_fast_forward(self, pos: int) -> None:
        for call in [c for c in self.ff if self.split.unit_of_call(c) == pos]:
            del self.ff[call]

    def unit_summary(self, pos: int) -> tuple[str, dict[str, int]]:
        """(action, bytes by action) of unit ``pos`` as it stands now."""
        if self.plan.actions[pos] == "R":
            return "R", {}
        if self.kept_whole:  # learnt by a frame that ran the layer at these shapes
            return "H", {"H": self.whole_held[pos], "L": 0}
        unit = self.units[pos]
        states, total = set(), {"H": 0, "L": 0}
        for stored in unit.stored:
            states.update(stored.row_states())
            for k, v in stored.bytes_by_action().items():
                total[k] += v
        # a fast-forward's outputs; not the RNG state it may take (5 KiB host tensors, in the
        # profile's ff_bytes: NOTE [ Profiling ] in plan/profile.py)
        total["H"] += sum(ff.nbytes() for c, ff in self.ff.items()
                          if self.split.unit_of_call(c) == pos)
        if unit.token_norms is not None:  # exposure's token weights, (B, T) fp32
            total["H"] += unit.token_norms.untyped_storage().nbytes()
        action = "L" if "L" in states else "H" if "H" in states or not states else "E"
        return action, total

    # ------------------------------------------------------------------ backward
    def _unpack(self, slot: Slot) -> torch.Tensor:
        if torch.is_grad_enabled():  # backward runs with grad mode on only for create_graph=True
            raise HiLoReError(
                "a second-order backward (create_graph=True, or torch.autograd.grad(..., "
                "create_graph=True)) reached a layer under HiLoRe: its saved tensors are kept "
                "detached, so higher-order terms would be dropped silently. Run that computation "
                "with HiLoRe off (model.gradient_checkpointing_disable()).")
        self.ctx.settle()  # the checks left, read once (NOTE [ Two reads per microbatch ] in reads.py)
        freed = self.ctx.freed
        if freed is None:
            return self._take(slot)
        unit = (self.layer.index, slot.pos)  # NOTE [ A bound for a check in part ] (checks.py)
        with freed.aside(unit):  # decoding or recomputing what a downgrade freed: not the plan's
            t = self._take(slot)
        freed.unpacked(unit)
        return t

    def _take(self, slot: Slot) -> torch.Tensor:
        if slot.kind == WEIGHT:
            return slot.weight.get()
        if slot.kind == INPUT:
            return slot.ref
        t = slot.take()
        if t is None and self.skip_zero_recompute:
            shape, dtype = self.units[slot.pos].shapes[self._index(slot)]
            slot.consumed = True
            return torch.full(shape, stand_in_value(dtype), dtype=dtype, device=self.device)
        if t is None:
            self._recompute(slot.pos)
            t = slot.take()
            if t is None:
                raise bug(f"saved tensor of {self.layer.units[slot.pos].name} not regenerated")
        return t

    def _index(self, slot: Slot) -> int:
        return next(k for k, ref in enumerate(self.units[slot.pos].slots) if ref() is slot)

    def _recompute(self, trigger: int) -> None:
        """Re-run the layer from its inputs to refill the empty slots (NOTE [ Recompute ] in replay.py)."""
        need = {trigger} | {p for p, unit in enumerate(self.units)
                            if any((s := r()) is not None and s.empty() and not s.consumed
                                   for r in unit.slots)}
        last = max(need)
        skip = {}
        if self.follows and min(need) > 0:  # units before the first needed one: fast-forward
            calls = [c for c in range(len(self.calls)) if self.split.unit_of_call(c) < min(need)]
            if all(c in self.ff for c in calls):
                skip = {c: self.ff[c] for c in calls}
        stop = next((c for c in range(len(self.calls)) if self.split.unit_of_call(c) > last), None)
        self.rc_need = need
        for unit in self.units:
            unit.rc_count = 0
        profiled = self.ctx.profile is not None
        if profiled:  # NOTE [ The backward's memory, layer by layer ] in plan/profile.py
            self.ctx.profile.layer_backward(self)
        replay = Replay(self.layer.module, tuple(self.calls), skip, self._recompute_pack, stop,
                        self._rerun_call if profiled else None)
        boundary = self.boundary
        if profiled:  # the re-run's own storages enter its units (NOTE [ Profiling ])
            self.boundary = set()
        try:
            with self.ctx.counters.timed("recompute_s", self.device), \
                    replay_autocast(self.autocast, self.autocast_cache):
                replay.run(self.fn, self.args, self.rng)
        finally:
            self.boundary = boundary
            for unit in self.units:
                unit.nodes.clear()
        for p in need:
            if self.units[p].rc_count != len(self.units[p].shapes):
                raise bug(f"recompute of {self.layer.units[p].name} saved {self.units[p].rc_count} "
                          f"tensors, forward saved {len(self.units[p].shapes)}")
        self.ff.clear()  # used; a second backward re-runs those units
        self.ctx.counters.recomputed_units += len(need)

    def _rerun_call(self, call: int, args, kwargs) -> None:
        """A profiled re-run reaches ``call``: the input of a unit's first call enters the unit,
        as in the forward (``_enter_child``), and is never packed or derived."""
        if call and self.split.unit_of_call(call - 1) == self.split.unit_of_call(call):
            return
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
        if first is not None:
            self.boundary.add(first.untyped_storage().data_ptr())

    def _recompute_pack(self, segment: int, t: torch.Tensor) -> None:
        pos = self.split.unit_of_segment(segment)
        unit = self.units[pos]
        k = unit.rc_count
        unit.rc_count += 1
        if pos not in self.rc_need:
            return
        if k >= len(unit.shapes) or unit.shapes[k] != (t.shape, t.dtype):
            raise HiLoReError(
                f"the recompute of {self.layer.units[pos].name} ({type(self.layer.module).__name__}) "
                f"saved a different tensor than the forward at position {k} ({tuple(t.shape)} "
                f"{t.dtype}): the layer keeps state across calls in training (e.g. a recurrent "
                "state or cache kept on the module) that its discovery did not see. Exclude it "
                "with 'layer_pattern' in the \"hilore\" block, or disable hilore for this model.")
        slot = unit.slots[k]()
        if self.ctx.profile is not None and slot is not None and slot.kind == ACT:
            # bytes and codec costs, one at a time; a tensor H / L would re-derive costs none
            self.ctx.profile.saved_tensor(self, pos, t, self._derivable(pos, t))
            if self.ctx.derive and t.grad_fn is not None:
                unit.nodes[(t.grad_fn, t.output_nr)] = (Live(t), view_spec(t), t.dtype)
        if slot is not None and slot.empty():
            slot.ref = t.detach()
            slot.consumed = False
        if all(self.units[p].rc_count == len(self.units[p].shapes) for p in self.rc_need):
            raise StopReplay  # everything needed is back: stop inside this op (Replay)
