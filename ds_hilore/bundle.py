"""Saved-tensor capture for one decoder-layer call: H / L / R storage and deterministic recompute.

NOTE [ Layer frames ]
Each call of a decoder layer with gradients on gets a ``LayerFrame``. The layer runs under a
``saved_tensors_hooks`` pair; every tensor autograd saves goes through ``LayerFrame._pack``,
which attributes it to the sub-block (unit) whose child module is executing and returns a
``_Slot`` handle:

* weights are never captured (DESIGN.md §4 rule 1): a trainable weight, a view of one, a
  frozen (LoRA base) weight or an autocast cast of a weight becomes a ``_WeightRef`` that
  rebuilds the tensor from the parameter on unpack;
* tensors sharing storage with the layer's inputs are referenced: the inputs are retained
  anyway, exactly as gradient checkpointing retains them (rule 2);
* activations of an ``H`` unit are kept as they are, of an ``L`` unit packed per sequence, of an
  ``R`` unit dropped. Exposure may split a unit per sequence: row blocks kept ``H``, packed
  ``L`` or elided ``E`` (a sequence whose loss coefficients are all zero: NOTE [ Exact zeros ]).

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
import dataclasses
import functools
import time
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._errors import HiLoReError, bug
from .exposure import input_norms
from .units import LayerUnits

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A packed group costs its payload plus one fp32 scale: narrower rows (a norm's (B, T, 1) rstd)
# would grow when "compressed". 16 keeps int8 and fp8 below a bf16 original by 1.6x or more.
_MIN_PACK_GROUP = 16

# NOTE [ Exact zeros ]
# A sequence whose loss coefficients are all exactly zero receives exactly zero gradient at
# every position of every layer (causal attention never mixes sequences), so its saved values
# only ever meet zeros in backward: any finite stand-in gives bitwise-equal parameter
# gradients. The stand-in is 1 for floats, not 0: backward formulas that divide by a saved
# value (sqrt, division, negative powers) would turn 0 / 0 into NaN, and 0 · NaN stays NaN.
# Integer and bool tensors get 0 (always a valid index). Whole-microbatch elision skips the
# recompute only when every rank agrees, or ZeRO-3's collectives would diverge.


def _stand_in_value(dtype: torch.dtype):
    return 1 if dtype.is_floating_point else 0


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


# --------------------------------------------------------------------------- slots and storage

class WeightRef:
    """A parameter (or a view or autocast cast of one) referenced, never copied (rule 1)."""

    __slots__ = ("param", "dtype", "size", "stride", "offset")

    def __init__(self, param: nn.Parameter, dtype: torch.dtype | None, t: torch.Tensor):
        self.param, self.dtype = param, dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        w = self.param.detach()
        if self.dtype is not None and w.dtype != self.dtype:
            w = w.to(self.dtype)  # same cast autocast made in forward: bitwise equal
        return w.as_strided(self.size, self.stride, self.offset)


_WEIGHT, _INPUT, _ACT = 0, 1, 2


class Counters:
    """What the frames of one microbatch measured (added up as they run)."""

    __slots__ = ("pack_s", "unpack_s", "recompute_s", "recomputed_units", "nonfinite_slices",
                 "rel_errors")

    def __init__(self):
        self.pack_s = self.unpack_s = self.recompute_s = 0.0  # seconds
        self.recomputed_units = self.nonfinite_slices = 0
        self.rel_errors: list[float] = []  # relative L2 error of each packed slice


class _Slot:
    """The handle autograd keeps for one saved tensor."""

    __slots__ = ("frame", "pos", "kind", "ref", "weight", "stored", "view", "consumed", "__weakref__")

    def __init__(self, frame: "LayerFrame", pos: int, kind: int):
        self.frame, self.pos, self.kind = frame, pos, kind
        self.ref = self.weight = self.stored = self.view = None
        self.consumed = False

    def empty(self) -> bool:
        return self.kind == _ACT and self.ref is None and self.stored is None

    def take(self) -> torch.Tensor | None:
        """The saved value, dropped from the slot (it is unpacked once per backward)."""
        if self.ref is not None:
            t, self.ref = self.ref, None
        elif self.stored is not None:
            t = self.stored.view(self.view)
        else:
            return None
        if self.stored is not None:
            self.stored.release()
            self.stored = None
        self.consumed = True
        return t


class PackedRows:
    """Sequences ``start .. stop - 1`` of a storage packed by one codec call (per-token scales
    keep the rows independent: one call per run of sequences instead of one per sequence)."""

    __slots__ = ("packed", "start", "stop")

    def __init__(self, packed, start: int, stop: int):
        self.packed, self.start, self.stop = packed, start, stop


class Stored:
    """One activation storage kept by a unit: whole, or as per-sequence row blocks.

    Whole: the tensors saved by forward are referenced as they are (bitwise exact, no copy).
    Rows: ``parts[i]`` is a tensor copy (H), a ``PackedRows`` shared by a run of sequences (L),
    or None (E: a stand-in).
    """

    __slots__ = ("base", "rows", "block", "group", "parts", "pending", "slots", "buffer", "nbytes",
                 "dtype", "device", "codec", "packable", "weak", "counters")

    def __init__(self, t: torch.Tensor, rows: int, block: int | None, group: int, codec,
                 packable: bool, counters: "Counters"):
        self.packable, self.counters = packable, counters
        self.base = t.detach().as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        self.rows, self.block, self.group, self.codec = rows, block, group, codec
        self.parts: list | None = None
        self.pending = 0
        self.slots: list = []  # weak refs of the slots holding a whole reference
        self.buffer = None
        self.nbytes = t.untyped_storage().nbytes()  # bytes
        self.dtype, self.device = t.dtype, t.device
        self.weak = StorageWeakRef(t.untyped_storage())

    @property
    def sliceable(self) -> bool:
        return self.block is not None

    def attach(self, slot: _Slot, t: torch.Tensor) -> None:
        self.pending += 1
        slot.stored = self
        slot.view = (t.size(), t.stride(), t.storage_offset())
        if self.parts is None:
            slot.ref = t.detach()  # an alias: no copy, and no reference cycle through grad_fn
            self.slots.append(weakref.ref(slot))

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.base = self.parts = self.buffer = None

    def row_states(self) -> list[str]:
        if self.parts is None:
            return ["H"] * self.rows
        return ["E" if p is None else "H" if isinstance(p, torch.Tensor) else "L" for p in self.parts]

    def set_rows(self, rows, action: str) -> None:
        """Move the given sequences to L (pack) or E (drop); frees their bytes at once."""
        if not self.sliceable or (self.parts is None and self.base is None):
            return
        target = sorted(set(rows))
        if self.parts is None:  # split: sequences that stay H are copied out, the rest packed
            blocks = self.base.view(self.rows, self.block)  # (B, block)
            parts = [None if i in target else blocks[i].clone() for i in range(self.rows)]
            if action == "L":
                for start, stop in _runs(target):
                    self._pack_run(blocks[start:stop], start, parts)
            for ref in self.slots:
                slot = ref()
                if slot is not None:
                    slot.ref = None
            self.slots.clear()
            self.parts, self.base = parts, None
            return
        if action == "E":
            runs = {id(p): p for i in target if isinstance(p := self.parts[i], PackedRows)}
            for i in target:
                self.parts[i] = None
            for run in runs.values():  # re-cut the runs so the elided rows' bytes are freed
                keep = [i for i in range(run.start, run.stop) if self.parts[i] is run]
                for start, stop in _runs(keep):
                    self.parts[start:stop] = [self._sub_run(run, start, stop)] * (stop - start)
            return
        for i in target:
            if action == "L" and isinstance(self.parts[i], torch.Tensor):
                self._pack_run(self.parts[i].view(1, -1), i, self.parts)

    def _sub_run(self, run: PackedRows, start: int, stop: int) -> PackedRows:
        """Sequences start .. stop - 1 of ``run`` as a run of their own (rows copied, not re-coded:
        per-token and per-block scales keep every row independent)."""
        per_seq = run.packed.shape[0] // (run.stop - run.start)  # packed rows per sequence
        lo, hi = (start - run.start) * per_seq, (stop - run.start) * per_seq
        payload, scales = run.packed.payload[lo:hi].clone(), run.packed.scales[lo:hi].clone()
        packed = dataclasses.replace(run.packed, payload=payload, scales=scales,
                                     shape=(hi - lo, run.packed.shape[1]),
                                     nbytes=payload.untyped_storage().nbytes()
                                     + scales.untyped_storage().nbytes())
        return PackedRows(packed, start, stop)

    def _pack_run(self, rows: torch.Tensor, start: int, parts: list) -> None:
        """Pack sequences ``start ..`` (rows: (n, block), contiguous) into ``parts``."""
        begin = time.perf_counter()
        packed = self.codec.pack(rows.view(-1, self.group))  # (tokens, features)
        self.counters.pack_s += time.perf_counter() - begin
        if packed is not None:
            run = PackedRows(packed, start, start + rows.shape[0])
            parts[start:run.stop] = [run] * rows.shape[0]
            self.counters.rel_errors.append(float(packed.rel_error))
        elif rows.shape[0] > 1:  # non-finite somewhere: find the sequence, pack the others
            for k in range(rows.shape[0]):
                self._pack_run(rows[k:k + 1], start + k, parts)
        else:  # this sequence stays exact; its non-finite values are never propagated
            self.counters.nonfinite_slices += 1
            parts[start] = rows[0].clone()

    def view(self, spec) -> torch.Tensor:
        if self.parts is None:
            return self.base.as_strided(*spec)
        if self.buffer is None:
            start = time.perf_counter()
            buffer = torch.empty(self.rows * self.block, dtype=self.dtype, device=self.device)
            blocks = buffer.view(self.rows, self.block)  # (B, block)
            for run in {id(p): p for p in self.parts if isinstance(p, PackedRows)}.values():
                # each run decoded once, straight into place
                self.codec.unpack(run.packed, out=blocks[run.start:run.stop].view(-1, self.group))
            for i, part in enumerate(self.parts):
                if part is None:
                    blocks[i].fill_(_stand_in_value(self.dtype))
                elif isinstance(part, torch.Tensor):
                    blocks[i].copy_(part)
            self.buffer = buffer
            self.counters.unpack_s += time.perf_counter() - start
        return self.buffer.as_strided(*spec)

    def bytes_by_action(self) -> dict[str, int]:
        """Bytes held now, by the action of the row blocks holding them."""
        if self.parts is None:
            return {"H": self.nbytes if self.base is not None else 0}
        out = {"H": 0, "L": 0}
        for p in self.parts:
            if isinstance(p, torch.Tensor):
                out["H"] += p.untyped_storage().nbytes()
        out["L"] = sum(run.packed.nbytes for run in {id(p): p for p in self.parts
                                                      if isinstance(p, PackedRows)}.values())
        return out


def _runs(indices: list[int]):
    """Sorted indices as (start, stop) runs of consecutive values."""
    start = prev = None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            yield start, prev + 1
            start = prev = i
    if start is not None:
        yield start, prev + 1


def row_block(t: torch.Tensor, rows: int) -> int | None:
    """Elements per sequence when ``t``'s storage splits into ``rows`` contiguous per-sequence blocks.

    True for every activation of a decoder layer: dim 0 is B, or B·T for flattened linear
    inputs, and dim 0 is outermost in memory (DESIGN.md §4). None otherwise (broadcast rotary
    tables, masks, scalars): such tensors are kept whole.
    """
    if t.dim() == 0 or rows <= 0 or t.shape[0] % rows:
        return None
    numel = t.untyped_storage().nbytes() // t.element_size()
    if numel % rows or numel * t.element_size() != t.untyped_storage().nbytes():
        return None
    block = numel // rows
    if t.stride(0) * (t.shape[0] // rows) != block:
        return None
    extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:]) if n > 0)
    return block if extent < t.stride(0) else None


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
        self.slots: list[list] = [[] for _ in range(n)]  # weak refs of _Slot, pack order
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

    def _pack(self, t: torch.Tensor) -> _Slot:
        pos = self.current
        self.shapes[pos].append((t.shape, t.dtype))
        weight = self.ctx.weight_ref(t, self.layer.module)
        if weight is not None:
            slot = _Slot(self, pos, _WEIGHT)
            slot.weight = weight
        elif t.untyped_storage().data_ptr() in self.input_ptrs:
            slot = _Slot(self, pos, _INPUT)
            slot.ref = t.detach()
        else:
            slot = _Slot(self, pos, _ACT)
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
        packable = (block is not None and t.dtype in _FLOAT_DTYPES and ptr not in self.boundary
                    and block >= self.ctx.min_pack_numel and self.ctx.codec is not None
                    and group >= _MIN_PACK_GROUP)
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
                if slot is not None and slot.kind == _ACT and slot.stored is not None:
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
    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if slot.kind == _WEIGHT:
            return slot.weight.get()
        if slot.kind == _INPUT:
            return slot.ref
        t = slot.take()
        if t is None and self.skip_zero_recompute:
            shape, dtype = self.shapes[slot.pos][self._index(slot)]
            slot.consumed = True
            return torch.full(shape, _stand_in_value(dtype), dtype=dtype, device=self.args[0].device)
        if t is None:
            self._recompute(slot.pos)
            t = slot.take()
            if t is None:
                raise bug(f"saved tensor of {self.layer.units[slot.pos].name} not regenerated")
        return t

    def _index(self, slot: _Slot) -> int:
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
