"""Saved-tensor capture for one decoder-layer call: H / L / R storage and deterministic recompute.

NOTE [ Layer frames ]
Each call of a decoder layer with gradients on gets a ``LayerFrame``. The layer runs under a
``saved_tensors_hooks`` pair; every tensor autograd saves goes through ``LayerFrame._pack``,
which attributes it to the sub-block (unit) whose child module is executing and returns a
``Slot`` handle:

* weights are never captured (DESIGN.md §4 rule 1): a trainable weight, a view of one, a
  frozen (LoRA base) weight or an autocast cast of a weight becomes a ``WeightRef`` that
  rebuilds the tensor from the parameter on unpack;
* tensors sharing storage with the layer's inputs are referenced: the inputs are retained
  anyway, exactly as gradient checkpointing retains them (rule 2);
* activations of an ``H`` unit are kept as they are, of an ``L`` unit packed per sequence, of an
  ``R`` unit dropped. Exposure may split a unit per sequence: row blocks kept ``H``, packed
  ``L`` or elided ``E`` (a sequence whose loss coefficients are all zero; NOTE [ Exact zeros ]
  in storage.py).

On backward, the first unpack of an empty slot re-runs the layer from its inputs with the
forward's RNG and autocast state (NOTE [ Recompute ]).

NOTE [ Recompute ]
The re-run captures only the units that need it and stops as soon as the last of them is done.
A unit kept in H/L that precedes one being recomputed is fast-forwarded: its child modules are
swapped for stand-ins returning the cached output of the unit (retained at forward only when
the capture plan needs it) or shape-only placeholders for outputs that never leave the unit.
Skipping a unit skips its RNG draws, so the RNG state is snapshotted at every unit's entry in
forward (only when it differs from the previous snapshot) and restored there on re-run, and at
a fast-forwarded unit's exit, restored by its last stand-in, for layer-body code between units
(OPT's dropout after the attention); without them later dropout masks would silently differ.
A unit whose other children feed a later unit (a parallel block sharing a norm) is re-run, not
fast-forwarded. Recomputed tensors refill slots by their order within the unit, checked
against the forward's shapes and dtypes.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._errors import HiLoReError, bug
from .exposure import input_norms
from .storage import (ACT, FLOAT_DTYPES, INPUT, MIN_PACK_GROUP, WEIGHT, Slot, Stored, row_block,
                      stand_in_value)
from .units import LayerUnits


class _StopRecompute(Exception):
    """Raised by a stand-in module once every unit being recomputed has been regenerated."""


# --------------------------------------------------------------------------- RNG and autocast

class RngState:
    """The CPU RNG stream and the layer's device stream, captured together."""

    __slots__ = ("cpu", "device_type", "device")

    def __init__(self, device_type: str):
        self.cpu = torch.get_rng_state()
        self.device_type = device_type
        self.device = (torch.get_device_module(device_type).get_rng_state()
                       if device_type not in ("cpu", "meta") else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(self.device_type).set_rng_state(self.device)

    def same_as(self, other: "RngState") -> bool:
        return torch.equal(self.cpu, other.cpu) and (
            self.device is None or torch.equal(self.device, other.device))


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
            for d in dict.fromkeys(("cpu", device_type))]


@contextlib.contextmanager
def _replay_autocast(state, cache_enabled: bool):
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                               cache_enabled=cache_enabled))
        yield


def _spec(output):
    """Shapes of a module output, to build placeholders of it (NOTE [ Recompute ])."""
    return tree_map(lambda x: (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x,
                    output)


def _placeholder(spec):
    return tree_map(lambda x: torch.zeros((), dtype=x[1], device=x[2]).expand(x[0])
                    if isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], torch.dtype) else x,
                    spec, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3
                    and isinstance(x[1], torch.dtype))


def _detach_like(output):
    return tree_map(lambda x: x.detach().requires_grad_(x.requires_grad)
                    if isinstance(x, torch.Tensor) else x, output)


def _fast_forward_value(output):
    """What a fast-forwarded unit hands on: the first tensor of its last child's output.

    Attention modules return ``(output, weights)`` and decoder layers use only the first
    element; keeping the weights would hold a (B, heads, T, T) tensor alive for nothing. The
    other tensors become placeholders (NOTE [ Recompute ]).
    """
    leaves, spec = tree_flatten(output)
    first = next((i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)), None)
    leaves = [x.detach().requires_grad_(x.requires_grad) if i == first else _spec(x)
              for i, x in enumerate(leaves)]
    return leaves[first] if first is not None else None, (leaves, spec)


def _from_fast_forward(value):
    leaves, spec = value[1]
    return tree_unflatten([x if isinstance(x, torch.Tensor) else _placeholder(x) for x in leaves], spec)


class _StandIn(nn.Module):
    """Replaces a child module of a fast-forwarded unit during a re-run; no hooks run."""

    def __init__(self, make_output: Callable[[], Any]):
        super().__init__()
        self.make_output = make_output

    def forward(self, *args, **kwargs):
        return self.make_output()


def _stop():
    raise _StopRecompute


def _fast_forward_exit(value, rng: "RngState | None"):
    if rng is not None:
        rng.restore()
    return _from_fast_forward(value)


class CapturePlan:
    """What a layer call keeps: an action per unit and, for H/L units, per-sequence actions."""

    __slots__ = ("actions", "rows")

    def __init__(self, actions: list[str], rows: list[tuple[str, ...] | None] | None = None):
        self.actions = list(actions)
        self.rows = list(rows) if rows is not None else [None] * len(actions)

    def needs_fast_forward(self, pos: int) -> bool:
        return self.actions[pos] != "R" and "R" in self.actions[pos + 1:]


class LayerFrame:
    """One decoder-layer call with gradients: inputs, RNG/autocast state and saved-tensor slots."""

    def __init__(self, layer: LayerUnits, fn: Callable, args: tuple, plan: CapturePlan, ctx):
        self.layer, self.fn, self.args, self.plan, self.ctx = layer, fn, args, plan, ctx
        inputs = [x for x in tree_flatten((args, getattr(fn, "keywords", {})))[0]
                  if isinstance(x, torch.Tensor)]
        self.input_ptrs = {x.untyped_storage().data_ptr() for x in inputs}
        keywords = getattr(fn, "keywords", {})
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else \
            keywords.get("hidden_states", inputs[0])
        self.batch = hidden.shape[0]
        self.seq_len = hidden.shape[1] if hidden.dim() >= 2 else 1
        self.device_type = hidden.device.type
        n = len(layer.units)
        self.current = 0
        self.recomputing = False
        self.slots: list[list] = [[] for _ in range(n)]  # weak refs of Slot, pack order
        self.shapes: list[list] = [[] for _ in range(n)]  # (shape, dtype) per slot
        self.stored: list[list[Stored]] = [[] for _ in range(n)]  # every storage a unit keeps
        self._by_ptr: list[dict[int, Stored]] = [{} for _ in range(n)]  # dedupe (rule 4)
        self.boundary: set[int] = set()  # storages entering a unit: never packed (rule 2)
        self.unit_rng: list[RngState | None] = [None] * n
        self.ff_out: list[Any] = [None] * n  # unit output cached for fast-forward
        self.ff_rng: list[RngState | None] = [None] * n  # RNG state at that unit's exit
        self.child_outputs: dict[int, str] = {}  # storage ptr -> child whose output it is
        self.consumed: set[str] = set()  # children whose output a later unit reads
        self.out_specs: dict[str, Any] = {}
        self.child_order: list[str] = []
        self.rc_counts = [0] * n
        self.rc_need: set[int] = set()
        self.token_norms: list[torch.Tensor | None] = [None] * n  # (B, T) unit-input norms
        for unit, rows in zip(layer.units, plan.rows):
            if rows is not None and len(rows) != self.batch:
                raise HiLoReError(f"per-sequence plan of {unit.name} has {len(rows)} entries, but "
                                  f"this microbatch has {self.batch} sequences; set_plan(rows=...) "
                                  "must give one action per sequence of the next microbatch.")
        self.elided_rows: set[int] = set()  # sequences with zero loss coefficients
        self.skip_zero_recompute = False  # every rank agreed: all sequences elided

    # ------------------------------------------------------------------ forward
    def run(self):
        """The layer's forward under capture."""
        self.rng = RngState(self.device_type)
        self.autocast = _autocast_state(self.device_type)
        self.autocast_cache = torch.is_autocast_cache_enabled()
        with self._child_hooks(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.fn(*self.args)

    @contextlib.contextmanager
    def _child_hooks(self):
        handles = []
        for name, child in self.layer.module.named_children():
            handles.append(child.register_forward_pre_hook(
                lambda m, a, k, name=name: self._enter_child(name, a, k), with_kwargs=True))
            handles.append(child.register_forward_hook(
                lambda m, a, out, name=name: self._leave_child(name, out)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _enter_child(self, name: str, args, kwargs) -> None:
        pos = self.layer.child_unit[name]
        if self.recomputing:
            if pos != self.current and self.unit_rng[pos] is not None:
                self.unit_rng[pos].restore()
            self.current = pos
            return
        self.child_order.append(name)
        if pos != self.current or self.unit_rng[pos] is None:
            rng = RngState(self.device_type)
            prev = next((r for r in reversed(self.unit_rng[:pos]) if r is not None), self.rng)
            self.unit_rng[pos] = prev if rng.same_as(prev) else rng
            for x in (*args, *kwargs.values()):
                producer = self.child_outputs.get(x.untyped_storage().data_ptr()) \
                    if isinstance(x, torch.Tensor) else None
                if producer is not None and self.layer.child_unit[producer] < pos:
                    self.consumed.add(producer)  # read across units: see _fast_forwardable
            first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
            if first is not None:
                self.boundary.add(first.untyped_storage().data_ptr())
                if self.plan.actions[pos] != "R" and self.ctx.codec is not None:
                    self.token_norms[pos] = input_norms(first)  # exposure's token weights
        self.current = pos

    def _leave_child(self, name: str, output) -> None:
        if self.recomputing:
            return
        self.out_specs[name] = _spec(output)
        for x in tree_flatten(output)[0]:
            if isinstance(x, torch.Tensor):
                self.child_outputs[x.untyped_storage().data_ptr()] = name
        pos = self.layer.child_unit[name]
        if self.plan.needs_fast_forward(pos):
            self.ff_out[pos] = _fast_forward_value(output)  # the unit's last child wins
            # code of the layer body after the unit (e.g. a dropout) draws from the RNG as it is
            # at the unit's exit; a fast-forward must leave it there too
            rng = RngState(self.device_type)
            self.ff_rng[pos] = self.unit_rng[pos] if rng.same_as(self.unit_rng[pos]) else rng

    def _pack(self, t: torch.Tensor) -> Slot:
        pos = self.current
        self.shapes[pos].append((t.shape, t.dtype))
        weight = self.ctx.weight_ref(t, self.layer.module)
        if weight is not None:
            slot = Slot(self, pos, WEIGHT)
            slot.weight = weight
        elif t.untyped_storage().data_ptr() in self.input_ptrs:
            slot = Slot(self, pos, INPUT)
            slot.ref = t.detach()
        else:
            slot = Slot(self, pos, ACT)
            if self.plan.actions[pos] != "R":
                self._store(pos, t).attach(slot, t)
        self.slots[pos].append(weakref.ref(slot))
        return slot

    def _store(self, pos: int, t: torch.Tensor) -> Stored:
        ptr = t.untyped_storage().data_ptr()
        stored = self._by_ptr[pos].get(ptr)
        if stored is not None and not stored.weak.expired() and stored.dtype == t.dtype:
            return stored
        block = row_block(t, self.batch)
        group = t.shape[-1] if t.dim() and t.shape[-1] and block and block % t.shape[-1] == 0 else block
        packable = (block is not None and t.dtype in FLOAT_DTYPES and ptr not in self.boundary
                    and block >= self.ctx.min_pack_numel and self.ctx.codec is not None
                    and group >= MIN_PACK_GROUP)
        stored = Stored(t, self.batch, block, group or 1, self.ctx.codec, packable, self.ctx.counters)
        self._by_ptr[pos][ptr] = stored  # an address reused after free gets a new entry
        self.stored[pos].append(stored)
        rows = self.plan.rows[pos] or (self.plan.actions[pos],) * self.batch
        for action in ("E", "L"):
            selected = [i for i, a in enumerate(rows) if a == action]
            if selected and (action == "E" or packable):
                stored.set_rows(selected, action)
        return stored

    # ------------------------------------------------------------------ after forward
    def downgrade(self, pos: int, action: str, rows=None) -> None:
        """H -> L / E (per sequence), H or L -> R (whole unit); frees the bytes at once."""
        if action == "R":
            for ref in self.slots[pos]:
                slot = ref()
                if slot is not None and slot.kind == ACT and slot.stored is not None:
                    slot.stored.release()
                    slot.ref = slot.stored = None
            self.stored[pos].clear()
            self._by_ptr[pos].clear()
            self.plan.actions[pos] = "R"
            return
        rows = list(range(self.batch)) if rows is None else list(rows)
        for stored in self.stored[pos]:
            if action == "E" or stored.packable:
                stored.set_rows(rows, action)

    def unit_summary(self, pos: int) -> tuple[str, dict[str, int]]:
        """(action, bytes by action) of unit ``pos`` as it stands now."""
        if self.plan.actions[pos] == "R":
            return "R", {}
        states, total = set(), {"H": 0, "L": 0}
        for stored in self.stored[pos]:
            states.update(stored.row_states())
            for k, v in stored.bytes_by_action().items():
                total[k] += v
        if self.ff_out[pos] is not None and self.ff_out[pos][0] is not None:
            total["H"] += self.ff_out[pos][0].untyped_storage().nbytes()
        if self.token_norms[pos] is not None:  # exposure's token weights, (B, T) fp32
            total["H"] += self.token_norms[pos].untyped_storage().nbytes()
        action = "L" if "L" in states else "H" if "H" in states or not states else "E"
        return action, total

    # ------------------------------------------------------------------ backward
    def _unpack(self, slot: Slot) -> torch.Tensor:
        if slot.kind == WEIGHT:
            return slot.weight.get()
        if slot.kind == INPUT:
            return slot.ref
        t = slot.take()
        if t is None and self.skip_zero_recompute:
            shape, dtype = self.shapes[slot.pos][self._index(slot)]
            slot.consumed = True
            return torch.full(shape, stand_in_value(dtype), dtype=dtype, device=self.args[0].device)
        if t is None:
            self._recompute(slot.pos)
            t = slot.take()
            if t is None:
                raise bug(f"saved tensor of {self.layer.units[slot.pos].name} not regenerated")
        return t

    def _index(self, slot: Slot) -> int:
        return next(k for k, ref in enumerate(self.slots[slot.pos]) if ref() is slot)

    def _recompute(self, trigger: int) -> None:
        """Re-run the layer from its inputs to refill the empty slots (NOTE [ Recompute ])."""
        need = {trigger} | {p for p, refs in enumerate(self.slots)
                            if any((s := r()) is not None and s.empty() and not s.consumed for r in refs)}
        last = max(need)
        rerun = set(need) | {p for p in range(last) if not self._fast_forwardable(p)}
        start = time.perf_counter()
        self.rc_need, self.rc_counts = need, [0] * len(self.slots)
        self.current, self.recomputing = 0, True
        args = tuple(_detach_like(a) for a in self.args)
        fn = self.fn
        if isinstance(fn, functools.partial) and fn.keywords:  # detach keyword tensors too
            fn = functools.partial(fn.func, *fn.args, **_detach_like(fn.keywords))
        outer_rng = RngState(self.device_type)  # a recompute never advances the training RNG
        try:
            with self._stand_ins(rerun, last), torch.enable_grad(), \
                    _replay_autocast(self.autocast, self.autocast_cache), self._child_hooks(), \
                    torch.autograd.graph.saved_tensors_hooks(self._recompute_pack, _never_unpacked):
                self.rng.restore()
                try:
                    fn(*args)
                except _StopRecompute:
                    pass
        finally:
            self.recomputing = False
            outer_rng.restore()
        for p in need:
            if self.rc_counts[p] != len(self.shapes[p]):
                raise bug(f"recompute of {self.layer.units[p].name} saved {self.rc_counts[p]} tensors, "
                          f"forward saved {len(self.shapes[p])}")
        self.ff_out = [None] * len(self.ff_out)  # used; a second backward re-runs those units
        self.ff_rng = [None] * len(self.ff_rng)
        self.ctx.counters.recomputed_units += len(need)
        self.ctx.counters.recompute_s += time.perf_counter() - start

    @contextlib.contextmanager
    def _stand_ins(self, rerun: set[int], last: int):
        module = self.layer.module
        swapped = {}
        for name, pos in self.layer.child_unit.items():
            if pos in rerun and pos <= last:
                continue
            if pos > last:
                make = _stop
            elif name == self._last_child(pos):
                make = functools.partial(_fast_forward_exit, self.ff_out[pos], self.ff_rng[pos])
            else:
                make = (lambda spec=self.out_specs.get(name): _placeholder(spec))
            swapped[name] = module._modules[name]
            module._modules[name] = _StandIn(make)
        try:
            yield
        finally:
            module._modules.update(swapped)

    def _fast_forwardable(self, pos: int) -> bool:
        """Unit ``pos`` can be skipped on a re-run: its output is cached, and no later unit reads
        the output of one of its other children (a parallel block sharing a norm)."""
        last = self._last_child(pos)
        return self.ff_out[pos] is not None and all(
            c == last for c in self.consumed if self.layer.child_unit[c] == pos)

    def _last_child(self, pos: int) -> str | None:
        return next((c for c in reversed(self.child_order) if self.layer.child_unit[c] == pos), None)

    def _recompute_pack(self, t: torch.Tensor) -> None:
        pos = self.current
        k = self.rc_counts[pos]
        self.rc_counts[pos] += 1
        if pos not in self.rc_need:
            return None
        if k >= len(self.shapes[pos]) or self.shapes[pos][k] != (t.shape, t.dtype):
            raise bug(f"recompute of {self.layer.units[pos].name} diverged from forward at saved "
                      f"tensor {k}: {tuple(t.shape)} {t.dtype}")
        slot = self.slots[pos][k]()
        if slot is not None and slot.empty():
            slot.ref = t.detach()
            slot.consumed = False
        if all(self.rc_counts[p] == len(self.shapes[p]) for p in self.rc_need):
            # Everything needed is back: stop inside this op, as torch's non-reentrant checkpoint
            # does. Running on to the end of the module would fire its post-forward hooks, and
            # ZeRO-3's would release the parameters the current backward has just gathered.
            raise _StopRecompute
        return None


def _never_unpacked(_):
    raise bug("a tensor saved during recompute was unpacked")
