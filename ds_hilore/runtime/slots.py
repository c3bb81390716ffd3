"""The handle autograd keeps for one saved tensor, and what it holds.

A ``Slot`` refers to a weight (weights.py), to one of the layer's inputs, or to an activation,
kept by a ``Stored`` (storage.py) or refilled by a recompute (bundle.py). It names neither: the
frames make slots, the storages fill them.
"""

from __future__ import annotations

import torch

from ds_hilore._errors import bug

WEIGHT, INPUT, ACT = 0, 1, 2  # what a slot holds


class Slot:
    """The handle autograd keeps for one saved tensor."""

    __slots__ = ("frame", "pos", "kind", "ref", "weight", "stored", "view", "consumed", "__weakref__")

    def __init__(self, frame, pos: int, kind: int):
        # ``frame``: the layer frame (bundle.py) that packed it, kept alive by its slots
        self.frame, self.pos, self.kind = frame, pos, kind
        self.ref = self.weight = self.stored = self.view = None
        self.consumed = False

    def empty(self) -> bool:
        return self.kind == ACT and self.ref is None and self.stored is None

    def disown_weight(self) -> None:
        """The weight this slot referenced proved not to be what was saved (a disproved
        autocast cast, weights.py): it becomes an empty activation slot, which the unit's
        recompute refills with the tensor the forward really saved."""
        if self.kind != WEIGHT:
            raise bug("only a weight reference can be disowned")
        self.kind, self.weight = ACT, None

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
