"""The state of one microbatch: its layer frames, coefficients, measurements, deferred checks."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ds_hilore._errors import bug
from ds_hilore.runtime.bundle import LayerFrame
from ds_hilore.runtime.storage import Counters

logger = logging.getLogger("ds_hilore")


class Microbatch:
    """Per-microbatch state: the layer frames, the coefficients, the measurements."""

    def __init__(self, index: int, runtime):
        self.index = index
        self.runtime = runtime  # its units, and its collective when several ranks run
        self.settled = False  # the deferred checks were read (settle)
        self.codec = runtime._codec
        self.min_pack_numel = runtime.config.min_pack_numel
        self.derive = runtime.config.derive_pointwise  # NOTE [ Derived tensors ] (derived.py)
        self._weights = runtime._weights  # weight recognition (runtime/weights.py)
        self.counters = Counters()
        self.frames: dict[int, weakref.ref] = {}  # layer index -> frame
        self.last_layer = -1
        self.coefficients: torch.Tensor | None = None
        self.exposure: dict[str, torch.Tensor] = {}  # unit name -> (B,) E_{u,i} (packed: per segment)
        self.token_weights: torch.Tensor | None = None  # (B, T) |ω| on hidden positions
        self.source: str | None = None
        self.zero_rows: list[int] = []  # sequences (packed: segments) with ω ≡ 0
        self.last_hidden_fn: int | None = None  # id of the last layer output's grad_fn
        self.batch: int | None = None  # sequences of the forward
        self.seq_len: int | None = None  # hidden positions of the forward
        self.summary: dict[str, Any] = {}
        self.late_leaks: list[torch.Tensor] = []  # per-layer elision checks, read at the end
        self.packed: bool | None = None  # several sequences per row (NOTE [ Packed sequences ])
        self.segments: list[tuple[int, int]] | None = None  # token ranges of the packed row
        self.mask_independence: dict = {}  # attention mask -> it keeps the segments apart
        self.profile = None  # a profiler measuring this microbatch's units (ds_hilore.plan)
        self.plan_key = None  # what the policy planned this microbatch with
        self.timing = None  # the policy's timing of this microbatch (leave-one-out), if any

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
            return self._weights(t, module)
        begin = self.profile.clock()
        ref = self._weights(t, module)
        frame = self.frame(self.last_layer)
        if frame is not None:
            self.profile.weight_recognition(frame.layer.units[frame.current], self.profile.clock() - begin)
        return ref

    # NOTE [ Collective fallback ]
    # A check read in the backward (NOTE [ One read per microbatch ] in storage.py) fails on
    # this rank's data: a packed run of its sequences was not finite, a tensor that looked like
    # a weight cast is not one. Under ZeRO-3 a recompute gathers the layer's parameters, so a
    # unit sent to R on one rank only would issue gathers the other ranks never match (NOTE
    # [ Collective elision ] in elision.py). So the failures become one flag per unit of the
    # model (unit order), OR-ed over ranks by an all-reduce of max, and every rank recomputes
    # the union; recomputing a unit whose checks held here is exact, only slower. Every rank
    # reaches this at the same point of its backward -- the first unpack of a HiLoRe layer --
    # so with a collective it runs once per microbatch whether or not this rank deferred a
    # check. A disproved weight reference is this rank's own: its slot is emptied, and the
    # recompute refills it (Slot.disown_weight).
    #
    # NOTE [ One sync at the top of the backward ]
    # The elision's leak check (NOTE [ Checked elision ] in elision.py) reads the gradient at
    # the last layer's output and, under several ranks, all-reduces the answer -- just before
    # the first unpack, where these checks would be read and all-reduced again. Each read and
    # each all-reduce stalls the host until the device's queue drains, so the leak check hands
    # its flag to ``settle`` instead: one read of the device and one all-reduce (the unit flags
    # with the leak flag appended, the same length on every rank) for both. Every rank makes
    # that call at the same point (whether the top check runs is the same on every rank).
    def settle(self, leak: torch.Tensor | None = None) -> bool:
        """Read the microbatch's deferred checks at once; a unit whose check failed on any
        rank is recomputed instead (NOTE [ Collective fallback ]). ``leak``: a () bool device
        flag read and agreed on with them (NOTE [ One sync at the top of the backward ]);
        returns it, OR-ed over ranks. Only the first call of a microbatch reads."""
        checks, self.counters.checks = self.counters.checks, []
        if self.settled:
            if checks:
                raise bug("a check was deferred after the microbatch's backward began")
            return False
        collective = self.runtime.collective
        if not checks and collective is None and leak is None:
            return False
        self.settled = True
        flags = self._failures(checks, leak)
        if collective is not None:  # one decision for all ranks
            flags = collective.all_reduce_max(flags)
        for frame in self.live_frames():
            for pos, unit in enumerate(frame.layer.units):
                if flags[unit.index] and frame.plan.actions[pos] != "R":
                    self._to_r(frame, pos)
        self._drop_unused_errors(checks, flags)
        return flags[-1] > 0

    def _drop_unused_errors(self, checks, flags: list[int]) -> None:
        """The codec errors of runs packed by a unit now recomputed are no part of the stats:
        the backward never reads them (and a non-finite run has no error to report)."""
        unused = set()
        for x, frame_ref, pos, what, _ in checks:
            frame = frame_ref()
            if what == "nonfinite" and (frame is None or flags[frame.layer.units[pos].index]):
                unused.add(id(x))
        if unused:
            self.counters.packed_stats = [x for x in self.counters.packed_stats if id(x) not in unused]

    def _failures(self, checks, leak: torch.Tensor | None) -> list[int]:
        """One flag per unit of the model (a check of this rank failed there), then ``leak``."""
        flags = [0] * (len(self.runtime.units) + 1)
        failed = [torch.isfinite(x[1]) if what == "nonfinite" else x for x, _, _, what, _ in checks]
        if leak is not None:
            failed.append(~leak)
        if not failed:
            return flags
        passed = torch.stack(failed).tolist()  # the one read of the device
        flags[-1] = int(leak is not None and not passed[-1])
        for ok, (_, frame_ref, pos, what, slot_ref) in zip(passed, checks):
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
