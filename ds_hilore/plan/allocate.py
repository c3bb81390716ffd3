"""The capture plan of a shape bucket: a two-constraint multiple-choice knapsack over layers.

One group per decoder layer; its options are the joint actions of the layer's units, each unit
``H`` (stored whole), ``L`` (packed), ``S`` (per-sequence split: the more exposed half of the
sequences H, the rest L) or ``R`` (recomputed). An option is priced exactly from the profile:
memory = the bytes each unit keeps, plus the fast-forward tensor of every kept unit followed by
a recomputed one in the same layer; utility = the measured seconds it saves against R; risk =
the risk model's estimate of the gradient error it adds (``risk.py``). The all-R option costs
nothing, so a plan always exists (GC). Pure: plain data in, plain data out.

NOTE [ A plan priced phase by phase ]
Where the profile read GC's peak phase by phase (NOTE [ The backward's memory, layer by layer ]
in profile.py), a plan's peak is priced as its highest phase, not as GC's peak plus every byte
it keeps: before the layers' backward everything kept is alive (all of it within the headroom
plus that phase's room); at layer k's backward the layers before k still hold their bytes and
layer k adds only what GC does not re-create there itself -- a packed tensor's packed copy
(``L``, a split's packed rows), nothing for what H stores (GC's recompute makes the same
tensors) or a fast-forward (GC's recompute makes its outputs too). The knapsack's caps carry
it: cap_k = headroom + room_k bounds the layers before k plus layer k's own bytes, the total
is bounded by headroom + the room before the backward. A unit kept in the last layers then
costs what GC's own recompute there already needed. Every room 0 (CUDA, an untracked profile):
no caps, GC's peak plus every byte (the price before). The plan's check (NOTE [ The plan's
peak, checked ] in checks.py) measures what the price predicts, and cuts it where it was
wrong.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

from ds_hilore.plan import knapsack
from ds_hilore.plan.profile import BucketProfile, UnitCost
from ds_hilore.plan.risk import RiskModel, group_of


@dataclasses.dataclass(frozen=True)
class Plan:
    """Actions per unit name (``H`` / ``L`` / ``S`` / ``R``) and what the knapsack predicted."""

    actions: dict[str, str]
    memory_bytes: int  # bytes kept, fast-forward tensors included
    utility_s: float  # seconds saved per microbatch against all-R
    risk: float  # estimated relative gradient error
    headroom_bytes: int  # what the budget left above GC's peak
    bound_s: float  # utility lost to discretisation at most
    # its predicted peak above GC's (NOTE [ A plan priced phase by phase ]); None: memory_bytes
    peak_over_gc: int | None = None

    @property
    def peak_over_gc_bytes(self) -> int:
        return self.memory_bytes if self.peak_over_gc is None else self.peak_over_gc

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def all_r(cls, names, headroom: int = 0) -> "Plan":
        return cls({n: "R" for n in names}, 0, 0.0, 0.0, headroom, 0.0)


def unit_options(cost: UnitCost, codec: bool, split_share: float) -> dict[str, tuple[float, int, float]]:
    """(utility s, bytes, eps share) of each action of one unit; share = part of the unit's
    exposure that a split packs (its less exposed half)."""
    options = {"R": (0.0, 0, 0.0), "H": (cost.utility_h, cost.h_bytes, 0.0)}
    if codec and cost.l_bytes < cost.h_bytes:
        options["L"] = (cost.utility_l, cost.l_bytes, 1.0)
        if cost.sliceable and cost.rows >= 2:
            half = cost.rows // 2  # rows packed
            packed = half / cost.rows
            options["S"] = (cost.utility_h - packed * (cost.pack_s + cost.unpack_s),
                            cost.h_bytes - int(packed * (cost.h_bytes - cost.l_bytes)), split_share)
    return options


def layer_groups(profile: BucketProfile, risk: RiskModel, codec: bool, split_share: float,
                 scale: float = 1.0, excluded: frozenset[int] = frozenset(),
                 byte_scale: Mapping[str, float] | None = None,
                 recomputed: frozenset[str] = frozenset()) -> list[list[knapsack.Option]]:
    """The knapsack groups of a profile: one per layer, every joint action an option.
    ``scale`` (>= 1) stretches bytes and times to a bucket longer than the profiled shape;
    ``byte_scale`` (unit kind -> factor >= 1) stretches only the bytes of that kind's units
    (NOTE [ Priced for the bucket's longest ] in buckets.py); ``excluded`` layers
    (leave-one-out found their options do not pay) get R only, and so do the units named in
    ``recomputed`` (NOTE [ One recompute set under ZeRO-3 ] in prediction.py)."""
    layers: dict[int, list[UnitCost]] = {}
    for cost in profile.units:
        layers.setdefault(cost.layer, []).append(cost)
    n_layers = len(layers)
    groups = []
    for layer in sorted(layers):
        units = sorted(layers[layer], key=lambda c: c.pos)
        per_unit = [unit_options(c, codec, split_share)
                    if layer not in excluded and c.name not in recomputed
                    else {"R": (0.0, 0, 0.0)} for c in units]
        options = []
        for combo in itertools.product(*(sorted(o) for o in per_unit)):
            utility = memory = own = 0
            danger = 0.0
            for k, (cost, action) in enumerate(zip(units, combo)):
                u, b, share = per_unit[k][action]
                stretch = scale * (byte_scale or {}).get(cost.kind, 1.0)
                utility += u * scale
                memory += math.ceil(b * stretch)
                own += math.ceil(_packed_bytes(cost, action) * stretch)
                if action != "R" and "R" in combo[k + 1:]:
                    memory += math.ceil(cost.ff_bytes * stretch)
                danger += risk.risk(group_of(cost.kind, layer, n_layers), cost.rel_error, share)
            options.append(knapsack.Option({c.name: a for c, a in zip(units, combo)},
                                           utility, memory, danger, min(own, memory)))
        groups.append(options)
    return groups


def _packed_bytes(cost: UnitCost, action: str) -> float:
    """What ``action`` adds at its own layer's backward beyond GC's recompute there: the packed
    copies (NOTE [ A plan priced phase by phase ])."""
    if action == "L":
        return cost.l_bytes
    if action == "S":
        return cost.l_bytes * (cost.rows // 2) / cost.rows
    return 0


def allocate(profile: BucketProfile, risk: RiskModel, headroom_bytes: int, risk_budget: float,
             codec: bool, split_share: float = 0.5, scale: float = 1.0,
             excluded: frozenset[int] = frozenset(),
             byte_scale: Mapping[str, float] | None = None,
             rooms: tuple[int, list[int]] | None = None,
             recomputed: frozenset[str] = frozenset()) -> Plan:
    """The capture plan with the most utility whose memory fits ``headroom_bytes`` (the budget
    above GC's peak) and whose risk fits ``risk_budget``; ``scale`` and ``byte_scale`` as in
    ``layer_groups``; ``rooms``: (room before the layers' backward, room per layer position)
    to price it phase by phase (NOTE [ A plan priced phase by phase ]), None: GC's peak plus
    every byte kept; ``recomputed``: units left R (NOTE [ One recompute set under ZeRO-3 ] in
    prediction.py)."""
    names = [c.name for c in profile.units]
    if headroom_bytes <= 0:
        return Plan.all_r(names, headroom_bytes)
    groups = layer_groups(profile, risk, codec, split_share, scale, frozenset(excluded), byte_scale,
                          frozenset(recomputed))
    caps, budget = None, headroom_bytes
    if rooms is not None:
        top, per_layer = rooms
        budget, caps = headroom_bytes + top, [headroom_bytes + room for room in per_layer]
    solution = knapsack.solve(groups, budget, risk_budget, caps=caps)
    actions, picked = {}, []
    for group, index in zip(groups, solution.choice):
        actions.update(group[index].label)
        picked.append(group[index])
    return Plan(actions, solution.memory, solution.utility, solution.risk, headroom_bytes,
                solution.bound, None if rooms is None else peak_over_gc(picked, rooms))


def peak_over_gc(picked: list[knapsack.Option], rooms: tuple[int, list[int]]) -> int:
    """The predicted peak of one option per layer above GC's, its highest phase (NOTE [ A plan
    priced phase by phase ]): everything kept less the room before the backward, or at layer
    k's backward the layers before it plus its own bytes less that layer's room."""
    top, per_layer = rooms
    phases, before = [sum(o.memory for o in picked) - top], 0
    for option, room in zip(picked, per_layer):
        phases.append(before + option.own_bytes - room)
        before += option.memory
    return max(phases)
