"""Profiling: what each recovery unit costs, measured on the running model, per shape bucket.

NOTE [ Profiling ]
A shape bucket's first microbatches run all-R (as gradient checkpointing does), so HiLoRe never
needs more memory than GC on a shape it has not measured. While they run:

* recompute time: the unit's forward, timed between its first child call and the next unit's
  (what R re-runs in the backward; under ZeRO-3 less the parameter fetches of those calls,
  NOTE [ Timed the same way ]);
* H bytes: the storages the recompute re-creates, counted once per storage, exactly as
  ``LayerFrame`` would keep them (weights and the layer's inputs are never kept: not counted;
  what enters a unit, its first call's input, is kept whole: in the re-run its own storage, as
  in the forward), and the (B, T) fp32 token norms of the unit's input, which an H or L unit
  holds until the backward while a codec is on (exposure's token weights, ``input_norms``);
* L bytes, pack and unpack time, and the codec's relative error: each re-created tensor is
  packed and unpacked once more, one tensor at a time, with the runtime's own code path
  (``Stored.set_rows``), so at most one tensor's packed copy is alive beyond GC's own memory;
  the token norms as in H;
* capture time: building the storage records of H (bookkeeping only: H keeps references),
  and what H and L do in the forward besides keeping a tensor, and R does not (NOTE [ Timed
  the same way ]; in pack time too);
* derived tensors (NOTE [ Derived tensors ] in runtime/derived.py): no bytes; the time of the
  pointwise op that re-derives them, which H and L both pay in the backward, and the bytes they
  would hold if kept (a plan storing every unit whole keeps them when those fit: ``derives``);
* fast-forward bytes: what a layer keeps of its first unit when only a later unit is recomputed:
  the outputs the later unit reads and, at a call after which the RNG moved (a dropout drew),
  a snapshot of its state (``RngState``: host tensors, 5 KiB of the CPU's memory; none of an
  accelerator's);
* GC's peak: the whole process, measured around the microbatch, forward, loss and backward
  (``torch.cuda.max_memory_allocated`` on CUDA; on CPU read after every aten op, NOTE [ Tracked
  on CPU ] in plan/metering.py), the max over the profiled microbatches. The trials above
  (packing, unpacking, re-deriving a tensor once more) are measurement only: the CPU reading
  pauses while they run (``_Sample.tracker``), and the profile's clock stops while it reads.
* on CPU, GC's peak before the backward reaches the layers and in each layer's backward (NOTE
  [ The backward's memory, layer by layer ]).

The first profiled microbatch of a bucket warms up (codec compilation, allocator); the plan uses
the median over the rest. Nothing is derived from FLOPs: on a CPU a codec can cost more than the
recompute it saves, and must then lose.

NOTE [ The backward's memory, layer by layer ]
A kept unit is alive from its forward until its own backward has run; GC peaks where it
recomputes, in the backward of the last layers. So a plan's peak is not GC's plus every byte it
keeps: at the backward of layer k only the layers before k still hold theirs, and layer k's own
H tensors replace what GC re-creates there. Measured on ``hilore bench --model paper-cpu`` (8
layers; MiB above the microbatch's start, GC's peak 79.2 in layer 7's backward, 52.8 before the
backward reaches the layers): layer 7 stored whole (28.9 MiB kept) peaked at 79.3, layer 0
stored whole at 108.2; layers 4-7 packed (38 MiB) at 104.7, their own backward each 3.3 MiB
under GC's (a packed tensor is decoded when its node runs, a recompute re-creates the whole
layer at once). So the profile's tracked window (CPU) reads GC's peak per phase: before the
first layer's recompute (the forward, the loss, the LM head's backward: ``None``) and from each
layer's recompute to the next one's (``_Sample.layer_backward``); ``BucketProfile`` keeps what
each phase leaves under GC's peak (``top_room_bytes``, ``layer_room_bytes``: the least over
the profiled microbatches that read every phase; 0 where none did) and the allocator prices a
plan at its highest phase (``allocate``, NOTE [ A plan priced phase by phase ] there). CUDA's peak counter
cannot be split without resetting it (NOTE [ Shared peak counters ] in runtime/memory.py):
there every room is 0, and a plan is priced as GC's peak plus every byte it keeps.

NOTE [ Non-finite tensors ]
Some saved tensors hold infinities by design: with a padding mask, SDPA saves an additive
(B, 1, T, T) mask of 0 and -inf. The int8 codec carries -inf exactly (NOTE [ -inf in int8 ] in
runtime/codecs.py); fp8 e4m3, and any codec given NaN or +inf, cannot pack them (the per-row
scale would be inf), and the runtime learns that only when it reads the microbatch's checks after the forward
(NOTE [ One read per microbatch ] in runtime/storage.py): the unit then pays the pack
and the recompute. It cannot keep just that tensor whole instead -- which tensor it is shows
only on the device, and reading it per tensor in the forward is what the deferred checks avoid.
So a unit in which the profile met a non-finite packable tensor is excluded from L (its L bytes
are its H bytes: ``allocate.unit_options`` then offers no L and no split), exact and costing only
that unit's compression. Its non-finite samples are dropped from the codec error and counted
(``nonfinite_tensors``): an infinite norm would turn the unit's error into NaN.

NOTE [ Timed the same way ]
Every action's cost is what it adds to the step against the others, measured with one clock
(``_Sample.now``: a synchronize first on CUDA, then the host's), so that neither side is timed
with its Python costs and the other without:
* R re-runs the unit's forward in the backward, without HiLoRe's forward bookkeeping: the
  unit's forward is timed between unit boundaries, less the weight recognition done inside
  it (``Microbatch.weight_ref``: every action recognizes the weights a unit saves in the
  forward; the re-run does not), timed on the host (the cast's proof is deferred, NOTE
  [ One read per microbatch ] in runtime/storage.py), so no synchronize is added inside it;
  on CPU the clock also stops while the memory tracker reads (what is left of its cost is a
  Python dispatch per op, NOTE [ Tracked on CPU ] in plan/metering.py);
* H and L pay, per saved tensor, the derivable check (NOTE [ Derived tensors ]) and, once
  per unit, the token norms of its input (exposure's token weights, ``input_norms``), timed
  in the profiled backward as the capture is (the norms on the layer's input: the same op on
  a tensor of the unit input's shape) and added to both ``capture_s`` (H) and ``pack_s`` (L):
  the plain costs a loaded profile sets carry it, and a split (S) pays it once more on its
  packed share, an overestimate of a few microseconds;
* an H or L unit before an R unit of its layer pays, at each of its calls, a fast-forward's
  record and RNG snapshot (``RngState``, compared with the state it would reuse): timed on
  the host in the profiled forward where the runtime takes it, at the call's exit, left out
  of the unit's interval, and added to ``capture_s`` and ``pack_s`` of every unit a later one
  follows -- also where no later unit is R, an overestimate of a few microseconds per call;
* under ZeRO-3, every action pays a unit's parameter gathers once in the backward (R's re-run
  fetches what the backward then uses), so the profiled forward's fetches (DeepSpeed's module
  hooks, ``fetch_sub_module``: gather, prefetch, wait) are timed with the same clock and left
  out of every interval, as the tracker's readings are (``_Sample.fetches_left_out``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import sys
import time
from typing import Any

import torch

from ds_hilore.grpo.exposure import input_norms
from ds_hilore.runtime.memory import in_use_bytes
from ds_hilore.runtime.replay import FastForward, RngState
from ds_hilore.runtime.storage import Counters

# where DeepSpeed's ZeRO-3 fetches a module's parameters (NOTE [ Timed the same way ])
_ZERO3_COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"


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
    nonfinite_tensors: int = 0  # packable tensors holding inf / NaN: no L (NOTE [ Non-finite tensors ])

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
    # NOTE [ The backward's memory, layer by layer ]: GC's peak less its peak before the
    # layers' backward, and in each layer's (by position); 0: not read
    top_room_bytes: int = 0
    layer_room_bytes: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"key": list(self.key), "gc_peak_bytes": self.gc_peak_bytes,
                "baseline_bytes": self.baseline_bytes, "repeats": self.repeats,
                "seconds": self.seconds, "top_room_bytes": self.top_room_bytes,
                "layer_room_bytes": list(self.layer_room_bytes),
                "units": [dataclasses.asdict(u) for u in self.units]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BucketProfile":
        return cls(key=tuple(data["key"]), units=[UnitCost(**u) for u in data["units"]],
                   gc_peak_bytes=int(data["gc_peak_bytes"]), baseline_bytes=int(data["baseline_bytes"]),
                   repeats=int(data["repeats"]), seconds=float(data["seconds"]),
                   top_room_bytes=int(data.get("top_room_bytes", 0)),
                   layer_room_bytes=[int(x) for x in data.get("layer_room_bytes", [])])

    def rooms(self) -> tuple[int, list[int]] | None:
        """(room before the layers' backward, room per layer position), None where nothing was
        read (NOTE [ The backward's memory, layer by layer ])."""
        if not self.top_room_bytes and not any(self.layer_room_bytes):
            return None
        n_layers = self.n_layers() if self.units else len(self.layer_room_bytes)
        layers = list(self.layer_room_bytes[:n_layers])
        return self.top_room_bytes, layers + [0] * (n_layers - len(layers))

    def n_layers(self) -> int:
        """Layer positions the units span."""
        return 1 + max((u.layer for u in self.units), default=-1)


class _Sample:
    """One profiled microbatch: what the runtime reports while it runs (duck-typed
    ``mb.profile``, see ``LayerFrame``)."""

    clock = staticmethod(time.perf_counter)  # host seconds (NOTE [ Timed the same way ])

    def __init__(self, units, device: torch.device):
        self.device = device
        self.costs = {u.name: UnitCost(u.name, u.kind, -1, u.pos) for u in units}
        self._layer_of = {u.name: u.layer_index for u in units}
        self._seen: set[tuple[int, int, int]] = set()  # (frame, unit, storage) counted once
        self._errors: dict[str, list[float]] = {}  # unit -> [sum err^2, sum norm^2]
        self._warm: set[tuple] = set()  # (shape, dtype) the codec has run on
        self._normed: set[tuple[int, int]] = set()  # (frame, unit) whose token norms were timed
        self._inputs: dict[tuple[int, int], tuple] = {}  # (frame, unit) -> (unit name, input shape, dtype)
        self._rng_states: dict[int, list[int]] = {}  # frame -> digests: its entry's, each call's exit
        self.fetch_s = 0.0  # ZeRO-3: seconds the profiled forwards spent fetching parameters
        self.overhead_s = 0.0  # seconds spent measuring (not part of any unit's cost)
        self.peak_bytes = 0  # CPU: in-use bytes sampled at every layer boundary, both ways
        self.tracker = None  # CPU: the op-level window reading this microbatch (memory.PeakTracker)

    def sample_memory(self) -> None:
        self.peak_bytes = max(self.peak_bytes, in_use_bytes(self.device))

    def now(self, device: torch.device) -> float:
        """Seconds, after a synchronize on CUDA (NOTE [ Timed the same way ])."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return self.host_now()

    def host_now(self) -> float:
        """Host seconds, less those the memory tracker spent reading (CPU) and ZeRO-3's forward
        spent fetching parameters (NOTE [ Timed the same way ])."""
        return self.clock() - (self.tracker.spent_s if self.tracker is not None else 0.0) - self.fetch_s

    @contextlib.contextmanager
    def fetches_left_out(self, device: torch.device):
        """Around a profiled layer forward: under ZeRO-3, the parameter fetches of DeepSpeed's
        module hooks (``fetch_sub_module``: the gather, the prefetch, the wait) are timed and
        left out of the clock (NOTE [ Timed the same way ])."""
        coordinator = getattr(sys.modules.get(_ZERO3_COORDINATOR), "PartitionedParameterCoordinator", None)
        fetch = vars(coordinator).get("fetch_sub_module") if coordinator is not None else None
        if fetch is None:
            yield
            return

        @functools.wraps(fetch)
        def timed(*args, **kwargs):
            begin = self.now(device)
            try:
                return fetch(*args, **kwargs)
            finally:
                self.fetch_s += self.now(device) - begin

        coordinator.fetch_sub_module = timed
        try:
            yield
        finally:
            coordinator.fetch_sub_module = fetch

    def layer_backward(self, frame) -> None:
        """The backward recomputes ``frame``'s layer: the tracker's readings from here to the
        next layer's recompute are that layer's (NOTE [ The backward's memory, layer by layer ])."""
        if self.tracker is not None:
            self.tracker.enter_phase(frame.layer.index)

    def unit_time(self, unit, seconds: float) -> None:
        self.costs[unit.name].recompute_s += seconds
        self.sample_memory()

    def weight_recognition(self, unit, seconds: float) -> None:
        """Forward seconds of recognizing a weight the unit saves: not what R re-runs
        (NOTE [ Timed the same way ])."""
        self.costs[unit.name].recompute_s -= seconds

    def unit_input(self, frame, pos: int, x: torch.Tensor) -> None:
        """Unit ``pos`` of ``frame`` begins on ``x``: the forward of an H / L unit keeps its
        token norms (``input_norms``) until the backward; counted in ``finish``."""
        self._inputs[(id(frame), pos)] = (frame.layer.units[pos].name, tuple(x.shape), x.dtype)

    def fast_forward(self, frame, pos: int, call: int, output) -> None:
        """Call ``call`` of unit ``pos`` returned ``output``: what a fast-forward of it keeps
        when a later unit of the layer is R (the outputs in the cut, and the RNG state at its
        exit when that moved since the state it would reuse), and the seconds the forward of
        an H / L unit spends taking it (NOTE [ Timed the same way ]). Measurement only: out of
        the recompute time of the unit whose interval is open."""
        begin = self.host_now()
        cost = self.costs[frame.layer.units[pos].name]
        with self.tracker.paused() if self.tracker is not None else contextlib.nullcontext():
            start = self.host_now()
            rng = RngState(frame.device)
            rng.same_as(rng)  # the runtime compares it with the state it would reuse
            ff = FastForward(output, call, frame.split.cut, rng)
            seconds = self.host_now() - start
            cost.ff_bytes += ff.nbytes() + (rng.nbytes() if self._rng_moved(frame, pos, call, rng) else 0)
            cost.capture_s += seconds
            cost.pack_s += seconds
            del rng, ff  # freed before the tracker reads again
        spent = self.host_now() - begin
        self.costs[frame.layer.units[frame.clock[-1][0]].name].recompute_s -= spent
        self.overhead_s += spent

    def _rng_moved(self, frame, pos: int, call: int, rng: RngState) -> bool:
        """Whether the runtime would keep a snapshot of its own at the exit of ``call``: the RNG
        moved since the state it would reuse (``LayerFrame._leave_child``), the previous call's
        exit when that call is of the same unit, else that or, when the unit before is R, the
        layer's entry (moved from either counts). Compared by digest: no snapshot is kept."""
        states = self._rng_states.setdefault(id(frame), [_digest(frame.rng)])
        here = _digest(rng)
        same_unit = call > 0 and frame.split.unit_of_call(call - 1) == pos
        reused = {states[-1]} if same_unit else {states[0], states[-1]}
        states.append(here)
        return reused != {here}

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
        with self.tracker.paused() if self.tracker is not None else contextlib.nullcontext():
            self._measure_tensor(frame, pos, t, derived, begin)

    def _measure_tensor(self, frame, pos: int, t: torch.Tensor, derived, begin: float) -> None:
        """``saved_tensor``'s trials: measurement only, none of it GC's memory."""
        unit = frame.layer.units[pos]
        cost = self.costs[unit.name]
        cost.rows, cost.sliceable = frame.batch, frame.sliceable
        bookkeeping = self._bookkeeping(frame, pos, t)  # NOTE [ Timed the same way ]
        cost.capture_s += bookkeeping
        cost.pack_s += bookkeeping
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

    def _bookkeeping(self, frame, pos: int, t: torch.Tensor) -> float:
        """Seconds of what H and L do in the forward for ``t`` besides keeping it: the
        derivable check, and once per unit the token norms (NOTE [ Timed the same way ])."""
        start = self.now(t.device)
        frame._derivable(pos, t)
        if frame.ctx.codec is not None and (id(frame), pos) not in self._normed:
            self._normed.add((id(frame), pos))
            first = next((x for x in frame.args if isinstance(x, torch.Tensor)), None)
            if first is not None:
                input_norms(first)  # (B, T) fp32, as the forward of an H / L unit computes it
        return self.now(t.device) - start

    def _measure_codec(self, stored, t: torch.Tensor, cost: UnitCost, scratch: Counters) -> None:
        # timed: the pack a training microbatch runs, without the error sums; the error comes
        # from a measured pack of the same elements, not timed (NOTE [ Measured or not ] in
        # runtime/codecs.py: the runtime measures one microbatch in codec_error_interval)
        a, b = stored.spans[0][0], stored.spans[-1][1]  # every sequence: one run, as set_rows packs it
        errors = stored.codec.pack_async(stored.base[a:b].view(-1, stored.group)).stats
        scratch.measure = False
        shape = (tuple(t.shape), t.dtype)
        if shape not in self._warm:  # compilation and first-call costs are not the codec's
            self._warm.add(shape)
            warm = type(stored)(t, stored.rows, stored.block, stored.group, stored.codec, True,
                                Counters(measure=False), None)
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
        runs = [errors.tolist()]  # [sum err^2, sum norm^2]
        if not all(math.isfinite(e) and math.isfinite(n) for e, n in runs):
            cost.nonfinite_tensors += 1  # dropped: NOTE [ Non-finite tensors ]
            return
        for e, n in runs:
            acc[0] += e
            acc[1] += n

    def finish(self, layer_positions: dict[int, int]) -> list[UnitCost]:
        for name, shape, dtype in self._inputs.values():  # the token norms an H / L unit holds
            norms = input_norms(torch.empty(shape, dtype=dtype, device="meta"))
            if norms is not None:
                self.costs[name].h_bytes += norms.untyped_storage().nbytes()
                self.costs[name].l_bytes += norms.untyped_storage().nbytes()
        for name, cost in self.costs.items():
            cost.layer = layer_positions[self._layer_of[name]]
            cost.recompute_s = max(cost.recompute_s, 0.0)  # a recognition at a unit boundary
            e, n = self._errors.get(name, (0.0, 0.0))  # finite samples only
            cost.rel_error = (e / n) ** 0.5 if n > 0 else 0.0  # nothing packed: no error
            exclude_nonfinite(cost)
        return list(self.costs.values())


class Profiler:
    """Collects the profiled microbatches of one shape bucket and folds them into a
    ``BucketProfile`` (medians, the first sample dropped as warm-up when there are more)."""

    def __init__(self, key: tuple[int, int], repeats: int):
        self.key, self.repeats = key, repeats
        self.samples: list[list[UnitCost]] = []
        self.peaks: list[int | None] = []  # None: a timed sample, not metered (CPU)
        self.phases: list[dict | None] = []  # layer position (None: before them) -> room
        self.layers = 0  # HiLoRe's layers
        self.baselines: list[int] = []
        self.starts: list[int | None] = []  # in use at each sample's start, less gradients
        self.steps: list[int] = []  # the step each sample was taken in
        self.tokens: list[int] = []  # the tokens (sequences x positions) of each sample
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return len(self.samples) >= self.repeats

    def ready(self, timed: int) -> bool:
        """Whether the bucket can be planned with ``timed`` timed samples of the run (every
        bucket's, NOTE [ A bucket learns from the others ]): once it has its own measured
        microbatch and the run has the timings ``repeats`` asks for, or once it has them all."""
        return self.done or (bool(self.samples) and timed >= max(1, self.repeats - 1))

    def timed(self) -> list[tuple[int, list[UnitCost]]]:
        """(tokens, unit costs) of the samples whose times count: all but the first (a new
        shape's first microbatch warms the allocator up)."""
        return list(zip(self.tokens[1:], self.samples[1:]))

    def sample(self, units, device: torch.device, tokens: int = 0) -> _Sample:
        sample = _Sample(units, device)
        sample.tokens = tokens
        return sample

    def add(self, sample: _Sample, layer_positions: dict[int, int], peak: int | None, baseline: int,
            step: int = 0, phases: dict | None = None, start: int | None = None) -> None:
        """``phases``: the tracked window's peak per layer index (None: before the layers'
        backward), where it was read; kept as what each leaves under the window's own peak."""
        self.samples.append(sample.finish(layer_positions))
        self.tokens.append(getattr(sample, "tokens", 0))
        self.peaks.append(peak)
        self.layers = len(layer_positions)
        top = max(phases.values()) if phases and peak is not None else None
        self.phases.append(None if top is None else
                           {(k if k is None else layer_positions[k]): top - v
                            for k, v in phases.items() if k is None or k in layer_positions})
        self.baselines.append(baseline)
        self.starts.append(start)
        self.steps.append(step)
        self.seconds += sample.overhead_s

    # NOTE [ The baseline of the samples that count ]
    # A bucket's baseline (in use at a forward's start) is the least over its samples but the
    # first, like its times. The first microbatch of a shape -- of the process, often -- leaves
    # memory behind that stays: the CPU's kernel libraries' caches and buffers, allocated at
    # their first use (37 MiB in a fresh process with a 2-layer, 128-wide model), held by every
    # later microbatch's peak. Taken from before it, the baseline read that much low: GC's peak
    # above it (scaled to a bucket's other lengths) read that much high, and the plan's check,
    # which takes what is in use at a microbatch's start beyond the baseline as growth that is
    # not the plan's (NOTE [ Growth that is not the plan's ] in checks.py), took it off every
    # peak it read (an overshoot of that size went unseen) or, under an absolute budget,
    # charged it again to GC's peak, which held it already. The first sample's own peak holds
    # it too, and where it is the last of its step (one microbatch a step: no gradient
    # accumulation) nothing later in that step tells its leftovers from the growth after the
    # step's start (``_shifts``), which raised that peak by them once more: GC's peak read them
    # twice. So there GC's peak is the largest over the later samples, which start with the
    # leftovers (a first sample longer than every later one then reads GC's peak low: a smaller
    # budget, never a larger one); elsewhere it is the largest over them all.
    def result(self, grown: dict[int, int] | None = None, now: int | None = None,
               timed: list[tuple[int, list[UnitCost]]] | None = None) -> BucketProfile:
        """``grown``: step -> the memory that appeared after that step's start, up to now;
        ``now``: what is in use at this step's start, less gradients (NOTE [ Memory that
        appears after profiling ] in plan/metering.py): each sample's peak and baseline are
        raised by what appeared after it (``_shifts``), so samples from before an optimizer's
        first step are read as if taken now. ``timed``: the run's timed samples, every bucket's
        (NOTE [ A bucket learns from the others ]); the times are theirs, per token, at this
        bucket's tokens, where this bucket has fewer timed samples of its own than ``repeats``
        asks."""
        used = self.samples[1:] if len(self.samples) > 1 else self.samples
        units = []
        for per_unit in zip(*used):
            first = per_unit[0]
            merged = dataclasses.replace(first)
            for field in _TIMES + ("rel_error",):
                setattr(merged, field, statistics.median(getattr(u, field) for u in per_unit))
            for field in ("h_bytes", "l_bytes", "ff_bytes", "derived_bytes", "nonfinite_tensors"):
                setattr(merged, field, max(getattr(u, field) for u in per_unit))  # exact: the largest
            exclude_nonfinite(merged)
            units.append(merged)
        if timed and not self.done:
            units = per_token_times(units, timed, statistics.median(self.tokens) or 1)
        shift = self._shifts(grown or {}, now)
        top, layers = self._rooms(self.layers)
        # NOTE [ The baseline of the samples that count ]
        first = 1 if len(self.baselines) > 1 else 0
        # the first sample left out where it is also the last of its step
        skip = 1 if first and self.steps[0] not in self.steps[1:] else 0
        peaks = [p + d for p, d in zip(self.peaks[skip:], shift[skip:]) if p is not None] or \
            [p + d for p, d in zip(self.peaks, shift) if p is not None]
        return BucketProfile(self.key, units, gc_peak_bytes=max(peaks),
                             baseline_bytes=min(b + d for b, d in zip(self.baselines[first:],
                                                                      shift[first:])),
                             repeats=len(used), seconds=self.seconds, top_room_bytes=top,
                             layer_room_bytes=layers)

    def _shifts(self, grown: dict[int, int], now: int | None) -> list[int]:
        """What appeared after each sample, up to ``now``: after its step's start, and after
        the start of the next sample of its step (the sample's own, for the step's last), which
        holds what the sample left behind (NOTE [ Memory that appears after profiling ] in
        plan/metering.py)."""
        shifts = []
        for i, step in enumerate(self.steps):
            shift = grown.get(step, 0)
            later = [s for s, k in zip(self.starts[i + 1:], self.steps[i + 1:])
                     if k == step and s is not None]
            start = later[0] if later else self.starts[i]
            if now is not None and start is not None:
                shift = min(shift, max(0, now - start))
            shifts.append(shift)
        return shifts

    def _rooms(self, n_layers: int) -> tuple[int, list[int]]:
        """What each phase leaves under its window's peak, the least over the metered samples
        that read every phase; all 0 where none did (NOTE [ The backward's memory, layer by
        layer ]). A microbatch whose backward recomputed no layer (every sequence's loss
        coefficient zero: NOTE [ Exact zeros ] in runtime/storage.py) read its whole backward
        before the layers': it says nothing of them."""
        keys = [None, *range(n_layers)]
        read = [phases for p, phases in zip(self.peaks, self.phases)
                if p is not None and phases is not None and all(k in phases for k in keys)]
        rooms = [min(phases[k] for phases in read) if read else 0 for k in keys]
        return rooms[0], rooms[1:]


_TIMES = ("recompute_s", "capture_s", "pack_s", "unpack_s", "derive_s")


def per_token_times(units: list[UnitCost], timed: list[tuple[int, list[UnitCost]]],
                    tokens: float) -> list[UnitCost]:
    """NOTE [ A bucket learns from the others ]
    Every shape bucket used to be profiled from scratch: ``profile_microbatches`` all-R
    microbatches of its own (the first a warm-up, the rest timed), then leave-one-out; on a run
    whose lengths vary per step, each of three buckets paid it again, and none was planned
    until one length had come three times. What depends on the shape is mostly proportional
    to its tokens -- a unit's recompute, codec and bookkeeping times (its ops are per token;
    attention's quadratic part is small at these lengths) -- while what bounds memory must be
    measured, never extrapolated. So the run's timed samples (every bucket's microbatches but
    each bucket's first) are pooled per token: a bucket is planned once it has one profiled
    microbatch of its own, which measures every unit's bytes, the codec's error and GC's
    whole-process peak (and on CPU its phases), and the run has ``profile_microbatches - 1``
    timed samples; each unit's times are the pool's median seconds per token at the
    bucket's tokens (times only rank the options; the plan's peak is checked as every plan's
    is). Leave-one-out runs once per run, on the first bucket planned: its verdict (the layers
    that do not pay) holds for the others (``Scheduler._start_loo``)."""
    out = []
    for k, cost in enumerate(units):
        theirs = [(n, sample[k]) for n, sample in timed
                  if n > 0 and k < len(sample) and sample[k].name == cost.name]
        if theirs:
            cost = dataclasses.replace(cost, **{f: tokens * statistics.median(
                getattr(c, f) / n for n, c in theirs) for f in _TIMES})
        out.append(cost)
    return out


def _digest(rng: RngState) -> int:
    """An RNG snapshot's state, to compare with another's without keeping it."""
    states = [rng.cpu] + ([rng.device[1]] if rng.device is not None else [])
    return hash(tuple(s.numpy().tobytes() for s in states))


def exclude_nonfinite(cost: UnitCost) -> None:
    """No L for a unit whose profile met a non-finite packable tensor: the runtime would pack
    it, fail the check and recompute (NOTE [ Non-finite tensors ])."""
    if cost.nonfinite_tensors:
        cost.l_bytes = cost.h_bytes
