"""Saved tensors that a unit re-derives at unpack instead of keeping: the cheap pointwise ones.

NOTE [ Derived tensors ]
A gated MLP saves its gate projection g (for the activation's backward), the activation a = f(g)
and the up projection u (for the product's backward) and h = a * u (for the down projection's
weight gradient): four tensors of the intermediate width, two of which -- a and h -- are one
pointwise op away from the others. Kept whole (H) or packed (L), a unit keeps only g and u and
re-runs f and the product when the backward first reads a or h, from g and u as the unit keeps
them. That halves what a SwiGLU/GeGLU block costs under H and L, for an elementwise pass in the
backward; the matmuls, the part R pays for, are never re-run.

Which tensors qualify is read from autograd, not from module names, so every architecture gets
it where it applies and nothing elsewhere: the saved tensor (or the base of the view saved) must
be the output of one of ``OPS`` -- ops whose own backward saves every input it reads, so an
in-place change to an input after the op would fail autograd's version check for the op itself
before a derived value could be wrong -- never modified in place itself, dense and owning its
storage, and every input must be a tensor this unit has already saved (matched by the autograd
node and output that produced it). A meta-tensor run of the op must give the saved tensor's
shape, strides and dtype. The op re-runs on exactly the strides the forward saw, so under H the
value is bitwise the forward's on a deterministic device; under L it is computed from the
unpacked inputs (the same error the packed inputs carry, measured by calibration, not added to
the codec's per-tensor error). An elided sequence's inputs are stand-ins (1): f(1) is finite.

Deriving trades an elementwise pass for memory, so it runs only where memory is short: the
profiler records what the derived tensors would hold, and a policy whose plan stores every unit
whole with room for them too turns it off for the microbatch (``Scheduler.derives``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from ds_hilore._errors import bug

__all__ = ["OPS", "Derived", "Live", "derivation", "view_spec"]


def _silu(node):
    return F.silu


def _gelu(node):
    approximate = getattr(node, "_saved_approximate", "none")
    return lambda x: F.gelu(x, approximate=approximate)


def _mul(node):
    return torch.mul


# autograd node name -> (builds the forward op from the node, tensor inputs it takes)
OPS: dict[str, tuple[Callable, int]] = {
    "SiluBackward0": (_silu, 1),
    "GeluBackward0": (_gelu, 1),
    "MulBackward0": (_mul, 2),
}


def view_spec(t: torch.Tensor) -> tuple:
    """(size, stride, storage offset): how a saved tensor views its storage."""
    return t.size(), t.stride(), t.storage_offset()


def derivation(t: torch.Tensor, sources: dict) -> tuple[Callable, list] | None:
    """(op, [(source, view spec) per input]) when ``t``'s storage can be re-derived from tensors
    already saved (``sources``: (autograd node, output number) -> (source, view spec, dtype),
    the unit's saved tensors so far); None otherwise (NOTE [ Derived tensors ])."""
    p = t._base if t._is_view() else t
    node = p.grad_fn
    if node is None or type(node).__name__ not in OPS or p._version != 0 or not p.is_contiguous() \
            or p.storage_offset() != 0 or p.numel() * p.element_size() != p.untyped_storage().nbytes():
        return None
    build, arity = OPS[type(node).__name__]
    edges = node.next_functions
    if len(edges) != arity or any(fn is None for fn, _ in edges):
        return None
    inputs = [sources.get((fn, nr)) for fn, nr in edges]
    if any(x is None for x in inputs):
        return None
    op = build(node)
    specs = tuple((tuple(size), tuple(stride), dtype) for (_, (size, stride, _offset), dtype) in inputs)
    key = (type(node).__name__, getattr(node, "_saved_approximate", None), specs)
    if _meta_result(key, op) != (tuple(p.shape), p.stride(), p.dtype):
        return None
    return op, [(source, spec) for source, spec, _ in inputs]


_META: dict[tuple, tuple | None] = {}  # NOTE [ The meta run, once per shape ]


def _meta_result(key: tuple, op: Callable) -> tuple | None:
    """NOTE [ The meta run, once per shape ]
    Whether a derived tensor comes out with the forward's shape, strides and dtype is read from
    a run of its op on meta tensors -- Python reference kernels, about half a millisecond per
    saved tensor, which on small layers was the largest part of HiLoRe's host cost per
    microbatch. The answer depends only on the op and its inputs' sizes, strides and dtypes, so
    it is computed once per such key and looked up after: (size, stride, dtype) of the result,
    None where the op does not run on meta."""
    if key not in _META:
        if len(_META) > 4096:  # shapes that never come back: start over
            _META.clear()
        try:
            meta = op(*(torch.empty_strided(size, stride, dtype=dtype, device="meta")
                        for size, stride, dtype in key[2]))
            _META[key] = (tuple(meta.shape), meta.stride(), meta.dtype)
        except Exception:  # noqa: BLE001 -- an op that does not re-run on meta is not derived
            _META[key] = None
    return _META[key]


class Live:
    """A tensor alive as it is (a profiled re-run's), read like a ``Stored``: what a profile
    times a derivation on."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t.detach()

    def view(self, spec) -> torch.Tensor:
        return self.t.as_strided(*spec)


class Derived:
    """A storage the unit re-derives at first read from other storages it keeps (``Stored`` or
    ``Derived``): holds no bytes until then, and keeps its inputs alive until it is read."""

    __slots__ = ("op", "inputs", "shape", "dtype", "device", "weak", "pending", "buffer", "counters")

    def __init__(self, t: torch.Tensor, op: Callable, inputs: list, counters):
        p = t._base if t._is_view() else t
        self.op, self.inputs, self.counters = op, inputs, counters
        self.shape, self.dtype, self.device = p.shape, p.dtype, p.device
        self.weak = StorageWeakRef(p.untyped_storage())
        self.pending = 0
        self.buffer = None
        for source, _ in inputs:
            source.pending += 1  # released when this storage is read or dropped

    def attach(self, slot, t: torch.Tensor) -> None:
        self.pending += 1
        slot.stored = self
        slot.view = view_spec(t)

    def view(self, spec) -> torch.Tensor:
        if self.buffer is None:
            if not self.inputs:
                raise bug("a derived saved tensor was read after its inputs were released")
            # the inputs first: a packed one decodes in its own timed block, counted once
            args = [source.view(s) for source, s in self.inputs]
            with self.counters.timed("unpack_s", self.device):
                out = self.op(*args)
            if out.shape != self.shape or out.dtype != self.dtype:
                raise bug(f"a derived saved tensor came back {tuple(out.shape)} {out.dtype}, "
                          f"the forward's was {tuple(self.shape)} {self.dtype}")
            self.buffer = out
            self._release_inputs()
        return self.buffer.as_strided(*spec)

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.buffer = None
            self._release_inputs()

    def _release_inputs(self) -> None:
        inputs, self.inputs = self.inputs, []
        for source, _ in inputs:
            source.release()
