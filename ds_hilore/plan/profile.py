"""Profiling: what each recovery unit costs, measured on the running model, per shape bucket.

NOTE [ Profiling ]
A shape bucket's first microbatches run all-R (as gradient checkpointing does), so HiLoRe never
needs more memory than GC on a shape it has not measured. While they run:

* recompute time: the unit's forward, timed between its first child call and the next unit's
  (what R re-runs in the backward; under ZeRO-3 the parameter gathers of those calls included);
* H bytes: the storages the recompute re-creates, counted once per storage, exactly as
  ``LayerFrame`` would keep them (weights and the layer's inputs are never kept: not counted);
* L bytes, pack and unpack time, and the codec's relative error: each re-created tensor is
  packed and unpacked once more, one tensor at a time, with the runtime's own code path
  (``Stored.set_rows``), so at most one tensor's packed copy is alive beyond GC's own memory;
* capture time: building the storage records of H (bookkeeping only: H keeps references);
* derived tensors (NOTE [ Derived tensors ] in runtime/derived.py): no bytes; the time of the
  pointwise op that re-derives them, which H and L both pay in the backward, and the bytes they
  would hold if kept (a plan storing every unit whole keeps them when those fit: ``derives``);
* fast-forward bytes: what a layer keeps of its first unit when only a later unit is recomputed;
* GC's peak: the whole process, measured around the microbatch (
  ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the process's in-use bytes sampled at every
  unit boundary of the forward, every re-created tensor of the backward and the start and end of
  the backward -- no dispatch mode stays installed across the user's code).

The first profiled microbatch of a bucket warms up (codec compilation, allocator); the plan uses
the median over the rest. Nothing is derived from FLOPs: on a CPU a codec can cost more than the
recompute it saves, and must then lose.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from ds_hilore.runtime.memory import in_use_bytes
from ds_hilore.runtime.storage import Counters


@dataclasses.dataclass
class UnitCost:
    """Measured costs of one recovery unit on one shape bucket (medians over repeats)."""

    name: str
    kind: str  # "attn" | "mlp" | "block"
    layer: int  # position of the layer among HiLoRe's layers
    pos: int  # position of the unit within its layer
    recompute_s: float = 0.0  # seconds: the unit's forward, what R re-runs
    capture_s: float = 0.0  # seconds: keeping it H (storage bookkeeping)
    pack_s: float = 0.0  # seconds: packing every packable tensor of the unit (L)
    unpack_s: float = 0.0  # seconds: unpacking them in the backward (L)
    h_bytes: int = 0  # bytes kept by H
    l_bytes: int = 0  # bytes kept by L (unpackable tensors stay whole)
    ff_bytes: int = 0  # bytes a fast-forward of this unit keeps when a later unit is R
    rel_error: float = 0.0  # ||x - unpack(pack(x))|| / ||x|| over the unit's packed tensors
    derive_s: float = 0.0  # seconds: re-deriving its pointwise tensors in the backward (H, L)
    derived_bytes: int = 0  # bytes those tensors would hold if kept (not in h_bytes / l_bytes)
    rows: int = 1  # sequences of the profiled microbatch
    sliceable: bool = False  # kept per sequence: H/L splits by sequence are possible

    @property
    def utility_h(self) -> float:
        """Seconds an H saves against R (U(H) = t_recompute - t_capture - t_derive)."""
        return self.recompute_s - self.capture_s - self.derive_s

    @property
    def utility_l(self) -> float:
        """Seconds an L saves against R (U(L) = t_recompute - t_pack - t_unpack - t_derive)."""
        return self.recompute_s - self.pack_s - self.unpack_s - self.derive_s


@dataclasses.dataclass
class BucketProfile:
    """What a shape bucket costs: per-unit measurements and GC's whole-process peak."""

    key: tuple[int, int]  # (sequences, positions) of the bucket
    units: list[UnitCost]
    gc_peak_bytes: int  # per rank, all-R, the whole process
    baseline_bytes: int  # in use before the forward (weights, gradients, optimizer state)
    repeats: int  # profiled microbatches the medians come from
    seconds: float  # what profiling cost: the profiled microbatches' measuring overhead

    def to_dict(self) -> dict[str, Any]:
        return {"key": list(self.key), "gc_peak_bytes": self.gc_peak_bytes,
                "baseline_bytes": self.baseline_bytes, "repeats": self.repeats,
                "seconds": self.seconds, "units": [dataclasses.asdict(u) for u in self.units]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BucketProfile":
        return cls(key=tuple(data["key"]), units=[UnitCost(**u) for u in data["units"]],
                   gc_peak_bytes=int(data["gc_peak_bytes"]), baseline_bytes=int(data["baseline_bytes"]),
                   repeats=int(data["repeats"]), seconds=float(data["seconds"]))


class _Sample:
    """One profiled microbatch: what the runtime reports while it runs (duck-typed
    ``mb.profile``, see ``LayerFrame``)."""

    def __init__(self, units, device: torch.device):
        self.device = device
        self.costs = {u.name: UnitCost(u.name, u.kind, -1, u.pos) for u in units}
        self._layer_of = {u.name: u.layer_index for u in units}
        self._seen: set[tuple[int, int, int]] = set()  # (frame, unit, storage) counted once
        self._errors: dict[str, list[float]] = {}  # unit -> [sum err^2, sum norm^2]
        self._warm: set[tuple] = set()  # (shape, dtype) the codec has run on
        self.overhead_s = 0.0  # seconds spent measuring (not part of any unit's cost)
        self.peak_bytes = 0  # CPU: in-use bytes sampled at every layer boundary, both ways

    def sample_memory(self) -> None:
        self.peak_bytes = max(self.peak_bytes, in_use_bytes(self.device))

    def now(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def unit_time(self, unit, seconds: float) -> None:
        self.costs[unit.name].recompute_s += seconds
        self.sample_memory()

    def fast_forward(self, unit, nbytes: int) -> None:
        self.costs[unit.name].ff_bytes += nbytes

    def saved_tensor(self, frame, pos: int, t: torch.Tensor, derived=None) -> None:
        """A tensor the recompute of unit ``pos`` re-created: bytes and codec costs; or, when
        H / L would re-derive it (``derived``: (op, inputs), NOTE [ Derived tensors ]), no bytes
        and the time of the op."""
        begin = self.now(t.device)
        key = (id(frame), pos, t.untyped_storage().data_ptr())
        if key in self._seen:
            return
        self._seen.add(key)
        self.sample_memory()
        unit = frame.layer.units[pos]
        cost = self.costs[unit.name]
        cost.rows, cost.sliceable = frame.batch, frame.sliceable
        if derived is not None:
            op, inputs = derived
            start = self.now(t.device)
            op(*(source.view(spec) for source, spec in inputs))
            cost.derive_s += self.now(t.device) - start
            cost.derived_bytes += t.untyped_storage().nbytes()
            self.overhead_s += self.now(t.device) - begin
            return
        scratch = Counters()
        start = self.now(t.device)
        stored = frame.new_stored(pos, t, scratch)
        cost.capture_s += self.now(t.device) - start
        cost.h_bytes += stored.nbytes
        if not stored.packable:
            cost.l_bytes += stored.nbytes
        else:
            self._measure_codec(stored, t, cost, scratch)
        self.overhead_s += self.now(t.device) - begin

    def _measure_codec(self, stored, t: torch.Tensor, cost: UnitCost, scratch: Counters) -> None:
        shape = (tuple(t.shape), t.dtype)
        if shape not in self._warm:  # compilation and first-call costs are not the codec's
            self._warm.add(shape)
            warm = type(stored)(t, stored.rows, stored.block, stored.group, stored.codec, True,
                                Counters(), None)
            warm.set_rows(range(stored.rows), "L")
            warm._decode()
        start = self.now(t.device)
        stored.set_rows(range(stored.rows), "L")
        middle = self.now(t.device)
        stored._decode()
        cost.pack_s += middle - start
        cost.unpack_s += self.now(t.device) - middle
        cost.l_bytes += stored.bytes_by_action()["L"]
        acc = self._errors.setdefault(cost.name, [0.0, 0.0])
        for e, n in torch.stack(scratch.packed_stats).tolist():
            acc[0] += e
            acc[1] += n

    def finish(self, layer_positions: dict[int, int]) -> list[UnitCost]:
        for name, cost in self.costs.items():
            cost.layer = layer_positions[self._layer_of[name]]
            e, n = self._errors.get(name, (0.0, 0.0))
            cost.rel_error = (e / n) ** 0.5 if n > 0 else 0.0
        return list(self.costs.values())


class Profiler:
    """Collects the profiled microbatches of one shape bucket and folds them into a
    ``BucketProfile`` (medians, the first sample dropped as warm-up when there are more)."""

    def __init__(self, key: tuple[int, int], repeats: int):
        self.key, self.repeats = key, repeats
        self.samples: list[list[UnitCost]] = []
        self.peaks: list[int | None] = []  # None: a timed sample, not metered (CPU)
        self.baselines: list[int] = []
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return len(self.samples) >= self.repeats

    def sample(self, units, device: torch.device) -> _Sample:
        return _Sample(units, device)

    def add(self, sample: _Sample, layer_positions: dict[int, int], peak: int | None, baseline: int) -> None:
        self.samples.append(sample.finish(layer_positions))
        self.peaks.append(peak)
        self.baselines.append(baseline)
        self.seconds += sample.overhead_s

    def result(self) -> BucketProfile:
        used = self.samples[1:] if len(self.samples) > 1 else self.samples
        units = []
        for per_unit in zip(*used):
            first = per_unit[0]
            merged = dataclasses.replace(first)
            for field in ("recompute_s", "capture_s", "pack_s", "unpack_s", "derive_s", "rel_error"):
                setattr(merged, field, statistics.median(getattr(u, field) for u in per_unit))
            for field in ("h_bytes", "l_bytes", "ff_bytes", "derived_bytes"):  # exact: the largest
                setattr(merged, field, max(getattr(u, field) for u in per_unit))
            units.append(merged)
        return BucketProfile(self.key, units, gc_peak_bytes=max(p for p in self.peaks if p is not None),
                             baseline_bytes=min(self.baselines), repeats=len(used),
                             seconds=self.seconds)
