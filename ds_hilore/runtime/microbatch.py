"""The state of one microbatch: its layer frames, coefficients, measurements, deferred checks."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ds_hilore.runtime.bundle import LayerFrame
from ds_hilore.runtime.storage import Counters

logger = logging.getLogger("ds_hilore")


class Microbatch:
    """Per-microbatch state: the layer frames, the coefficients, the measurements."""

    def __init__(self, index: int, runtime):
        self.index = index
        self.codec = runtime._codec
        self.min_pack_numel = runtime.config.min_pack_numel
        self.derive = runtime.config.derive_pointwise  # NOTE [ Derived tensors ] (derived.py)
        self.weight_ref = runtime._weights
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

    def settle(self) -> None:
        """Read the microbatch's deferred checks at once; a unit whose check failed is
        recomputed instead (NOTE [ One read per microbatch ] in storage.py)."""
        checks = self.counters.checks
        if not checks:
            return
        self.counters.checks = []
        flags = [torch.isfinite(x[1]) if what == "nonfinite" else x for x, _, _, what in checks]
        passed = torch.stack(flags).tolist()  # the one read of the device
        for ok, (_, frame_ref, pos, what) in zip(passed, checks):
            frame = frame_ref()
            if ok or frame is None:
                continue
            if what == "nonfinite":
                self.counters.nonfinite_slices += 1
            else:
                logger.warning("ds_hilore: a saved tensor of %s looked like a weight cast but is "
                               "not one; the unit is recomputed instead (exact).",
                               frame.layer.units[pos].name)
            if frame.plan.actions[pos] != "R":
                frame.downgrade(pos, "R")
