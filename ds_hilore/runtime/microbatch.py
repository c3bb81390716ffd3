"""The state of one microbatch: its layer frames, coefficients, measurements, deferred checks."""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any

import torch

from ds_hilore._errors import bug
from ds_hilore.runtime.bundle import LayerFrame
from ds_hilore.runtime.reads import read_once
from ds_hilore.runtime.storage import Counters

logger = logging.getLogger("ds_hilore")
_EPOCHS = itertools.count()


class Microbatch:
    """Per-microbatch state: the layer frames, the coefficients, the measurements."""

    def __init__(self, index: int, runtime):
        self.index = index
        self.epoch = next(_EPOCHS)  # unique for the process (NOTE [ Aliases, by address ] in weights.py)
        self.runtime = runtime  # its units, and its collective when several ranks run
        self.settled = False  # the checks left at the backward were read (settle)
        # its checks' decisions are this rank's own, read without an all-reduce: a microbatch
        # of a steady step, whose plan may not be the other ranks' (NOTE [ A steady step agrees
        # nothing before its forwards ] in plan/steady.py)
        self.local_checks = False
        self.late_reads = 0  # the late flags' reads when it began (``LateFlags.reseed``)
        self.codec = runtime._codec
        self.min_pack_numel = runtime.config.min_pack_numel
        self.derive = runtime.config.derive_pointwise  # NOTE [ Derived tensors ] (derived.py)
        self._weights = runtime._weights  # weight recognition (runtime/weights.py)
        # one in codec_error_interval measures what it packs (NOTE [ Measured or not ] in codecs.py)
        self.counters = Counters(measure=index % runtime.config.codec_error_interval == 0)
        self.frames: dict[int, weakref.ref] = {}  # layer index -> frame
        # the last layer's frame where it keeps what autograd keeps: no saved tensor holds it,
        # so this does, until the top of its backward (NOTE [ A layer that keeps everything ])
        self.top_frame = None
        self.last_layer = -1
        self.coefficients: torch.Tensor | None = None
        self.exposure: dict[str, torch.Tensor] = {}  # unit name -> (B,) E_{u,i} (packed: per segment)
        self.exposure_read: tuple[list[float], dict[str, list[float]]] | None = None  # on the host
        self.token_weights: torch.Tensor | None = None  # (B, T) |ω| on hidden positions
        self.source: str | None = None
        self.zero_rows: list[int] = []  # sequences (packed: segments) with ω ≡ 0
        self.last_hidden_marked = False  # NOTE [ The last layer's output, marked ] (registry.py)
        self.batch: int | None = None  # sequences of the forward
        self.seq_len: int | None = None  # hidden positions of the forward
        self.summary: dict[str, Any] = {}
        self.late_leaks: list[torch.Tensor] = []  # per-layer elision checks of its backward
        # its backward leaves a late flag on every rank (NOTE [ A late read, due on every
        # rank ] in late.py)
        self.late_due = False
        self.skip_layers_backward = False  # NOTE [ A backward of zeros ] in zero_backward.py
        self.gated = False  # the last layer's output went through ``gate`` at the forward
        self.gc_backward_begun = False  # run as GC, its backward reached the last layer's output
        self.predicted_zero = False  # planned as every rank's predicted zero (scheduler.py)
        self.stopped_short = False  # its forward ended below the last HiLoRe layer (elision.py)
        # several sequences per row (NOTE [ Packed sequences ] in packed.py)
        self.packed: bool | None = None
        self.segments: list[tuple[int, int]] | None = None  # token ranges of the packed row
        self.mask_independence: dict = {}  # attention mask -> (segments kept apart, causal)
        self.profile = None  # a profiler measuring this microbatch's units (ds_hilore.plan)
        self.plan_key = None  # what the policy planned this microbatch with
        # told the bytes a downgrade frees and what its backward unpacks, where its plan's peak
        # is checked (``FreedBytes``, NOTE [ A bound for a check in part ] in plan/checks.py)
        self.freed = None
        self.timing = None  # the policy's timing of this microbatch (leave-one-out), if any
        self.pass_job = None  # the policy's matched pass of this microbatch, if any
        # token norms of its R units too: a calibration's exposure reads every unit the plan
        # would keep, while the microbatch itself runs exact (NOTE [ The exact gradient from
        # training ] in plan/calibrate.py)
        self.norms_all = False
        self.unit_risks: dict[str, float] = {}  # the policy's risk of its units (the risk fit)
        self.risk_here: list[float] = []  # ... of every unit, in step units, this rank's
        self.as_gc = False  # it ran as gradient checkpointing (NOTE [ Never slower than GC ])
        self.checkpointed: set[int] = set()  # layers run without a frame (NOTE [ A layer that keeps nothing ])
        # layers run without a frame, keeping what autograd keeps (and the last layer's frame
        # that keeps nothing): layer -> bytes per unit, as learnt at their shape when they ran
        # -- taken then, the layer's cache may forget that shape before a late summary (NOTE
        # [ A layer that keeps everything ] in calling.py)
        self.whole: dict[int, list] = {}
        self.split = None  # its rows kept and run without autograd (NOTE [ Kept rows only ] in rows.py)
        self.rows_refused = False  # planned for its kept rows, run whole and all R instead
        self.rows_due = False  # some rank split its rows: their merges leave late flags (agreed)

    def frame(self, layer_index: int) -> LayerFrame | None:
        ref = self.frames.get(layer_index)
        return ref() if ref is not None else None

    def live_frames(self):
        return [f for f in (r() for r in self.frames.values()) if f is not None]

    def weight_ref(self, t: torch.Tensor, module):
        """The weight ``t`` is a cast or view of, if any; timed while profiling: every action
        does it in the forward, R's re-run does not (NOTE [ Timed the same way ] in
        plan/profile.py)."""
        if self.profile is None:
            return self._weights(t, module, self.epoch)
        begin = self.profile.host_now()
        ref = self._weights(t, module, self.epoch)
        frame = self.frame(self.last_layer)
        if frame is not None:
            self.profile.weight_recognition(frame.layer.units[frame.current],
                                            self.profile.host_now() - begin)
        return ref

    # NOTE [ Collective fallback ]
    # A deferred check (NOTE [ One read per microbatch ] in storage.py) fails on this rank's
    # data: a packed run of its sequences was not finite, a tensor that looked like a weight
    # cast is not one. Under ZeRO-3 a recompute gathers the layer's parameters, so a unit sent
    # to R on one rank only would issue gathers the other ranks never match (NOTE [ Collective
    # elision ] in agreement.py). So the failures become one flag per unit of the model (unit
    # order), OR-ed over ranks by an all-reduce of max, and every rank recomputes the union;
    # recomputing a unit whose checks held here is exact, only slower. The checks are read
    # with the coefficients (NOTE [ Two reads per microbatch ] in reads.py), their flags riding
    # on the elision's all-reduce; what is deferred after that, or all of them when no
    # coefficients came, is read by ``settle``. Every rank reaches ``settle`` at the same point
    # of its backward -- the top check, else the first unpack of a HiLoRe layer -- so with a
    # collective it runs once per microbatch whether or not this rank deferred a check. A
    # disproved weight reference is this rank's own: its slot is emptied, and the recompute
    # refills it (Slot.disown_weight).
    #
    # NOTE [ One sync at the top of the backward ]
    # The elision's leak check (NOTE [ Checked elision ] in elision.py) reads the gradient at
    # the last layer's output and, under several ranks, all-reduces the answer -- just before
    # the first unpack, where the checks left would be read and all-reduced again. Each read
    # and each all-reduce stalls the host until the device's queue drains, so the leak check
    # hands its flag to ``settle`` instead: one read of the device and one all-reduce (the unit
    # flags with the leak flag appended, the same length on every rank) for both. Every rank
    # makes that call at the same point (whether the top check runs is the same on every rank:
    # only where the coefficients' all-reduce found a sequence elided on some rank, ``_elide``
    # in elision.py; with none anywhere there is nothing to check, and no call). In a steady
    # step, whose plan may be this rank's own, the read is made and nothing agreed
    # (``local_checks``: NOTE [ A steady step agrees nothing before its forwards ] in
    # plan/steady.py).
    def settle(self, leak: torch.Tensor | None = None, at_top: bool = False) -> bool:
        """Read the microbatch's checks left at once; a unit whose check failed on any rank is
        recomputed instead (NOTE [ Collective fallback ]). ``leak``: a () bool device flag read
        and agreed on with them (NOTE [ One sync at the top of the backward ]); returns it,
        OR-ed over ranks. Only the first call of a microbatch reads. ``at_top``: called by the
        elision's check at the top of the backward (else at the first unpack)."""
        checks, held = self.take_checks()
        if self.settled:
            if checks:
                raise bug("a check was deferred after the microbatch's backward began")
            return False
        collective = None if self.local_checks else self.runtime.collective
        if not checks and collective is None and leak is None:
            return False
        if not at_top and self.source is not None:
            # the coefficients came on every rank and their read took every check (nothing is
            # deferred after it): nothing is left to read or agree on, on any rank
            if checks:
                raise bug("a check was deferred after the microbatch's coefficients were read")
            self.settled = True
            return False
        self.settled = True
        held, leaked = read_once([held, leak])  # the one read
        flags = self.check_failures(checks, held) + [int(any(v != 0 for v in leaked))]
        if collective is not None:  # one decision for all ranks
            flags = collective.all_reduce_max(flags)
        self.fall_back(checks, flags)
        return flags[-1] > 0

    def take_checks(self) -> tuple[list, torch.Tensor | None]:
        """The checks deferred so far, handed over (NOTE [ One read per microbatch ] in
        storage.py), and a device flag per check (True: it held), to be read with others."""
        checks, self.counters.checks = self.counters.checks, []
        if not checks:
            return checks, None
        return checks, torch.stack([torch.isfinite(x[1]) if what == "nonfinite" else x
                                    for x, _, _, what, _ in checks])

    def check_failures(self, checks, held: list[float]) -> list[int]:
        """One flag per unit of the model: a check of this rank failed there (``held``: the
        read flags of ``take_checks``). Counts the non-finite runs, disowns disproved casts."""
        flags = [0] * len(self.runtime.units)
        for ok, (_, frame_ref, pos, what, slot_ref) in zip(held, checks):
            frame = frame_ref()
            if ok or frame is None:
                continue
            unit = frame.layer.units[pos]
            if what == "nonfinite":
                self.counters.nonfinite_slices += 1
            else:
                slot = slot_ref()
                if slot is not None:
                    slot.disown_weight()
                logger.warning("ds_hilore: a saved tensor of %s looked like a weight cast but is "
                               "not one; the unit is recomputed instead (exact).", unit.name)
            flags[unit.index] = 1
        return flags

    def fall_back(self, checks, flags: list[int]) -> None:
        """The units flagged (on any rank) recomputed instead; the codec errors of runs they
        packed are no part of the stats: the backward never reads them (and a non-finite run
        has no error to report)."""
        for frame in self.live_frames():
            if frame.kept_whole:  # autograd's own tensors, exact (NOTE [ A layer that keeps
                continue  # everything ] in calling.py): nothing to recompute
            for pos, unit in enumerate(frame.layer.units):
                if flags[unit.index] and frame.plan.actions[pos] != "R":
                    self._to_r(frame, pos)
        unused = set()
        for x, frame_ref, pos, what, _ in checks:
            frame = frame_ref()
            if what == "nonfinite" and (frame is None or flags[frame.layer.units[pos].index]):
                unused.add(id(x))
        if unused:
            self.counters.packed_stats = [x for x in self.counters.packed_stats if id(x) not in unused]

    def exposure_lists(self) -> tuple[list[float], dict[str, list[float]]]:
        """(M_i per sequence, E_{u,i} per unit and sequence) on the host, as read with the
        coefficients (NOTE [ Two reads per microbatch ] in reads.py); empty before them."""
        return self.exposure_read if self.exposure_read is not None else ([], {})

    def _to_r(self, frame: LayerFrame, pos: int) -> None:
        """Unit ``pos`` of ``frame`` recomputed instead; the microbatch's summary (written at
        the end of its forward) then reports R and the bytes it no longer holds."""
        action, held = frame.unit_summary(pos)
        frame.downgrade(pos, "R")
        if "actions" not in self.summary:
            return
        self.summary["actions"][action] -= 1
        self.summary["actions"]["R"] += 1
        for k, v in held.items():
            self.summary["bytes"][k] -= v
        if self.runtime._mb is self:  # the units report the latest microbatch
            unit = frame.layer.units[pos]
            unit.action, unit.nbytes = "R", 0
