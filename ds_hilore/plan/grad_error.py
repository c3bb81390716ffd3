"""The matched passes' arithmetic on gradients, one tensor at a time: what a pass holds per
parameter, squared norms in fp64, relative errors (NOTE [ Non-finite passes ]) and the step's
error over ranks (NOTE [ The step's error over ranks ]).

Called by ``MatchedPasses`` (calibrate.py), which compares each gradient with the exact one as
it arrives (NOTE [ What a pass holds ] in pass_runner.py).
"""

from __future__ import annotations

import math

import torch


def numel(p: torch.Tensor) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3: the whole parameter's


def accumulator(p: torch.Tensor) -> torch.Tensor:
    """A zero sum for ``p``'s gradients: its full shape, at least fp32."""
    shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape  # ZeRO-3: the whole parameter's
    return torch.zeros(shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)


def held_bytes(p: torch.Tensor, accumulators: bool) -> int:
    """What a pass holds for ``p``: its exact gradient, and D and G for validation."""
    acc = torch.promote_types(p.dtype, torch.float32).itemsize if accumulators else 0
    return numel(p) * (p.element_size() + 2 * acc)


def minus(g: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
    """g - e in fp64, a new tensor (``g`` may share storage with other gradients)."""
    d = g.to(torch.float64, copy=True)
    return d if e is None else d.sub_(e)


def squared(t: torch.Tensor) -> float:
    """||t||^2 in fp64 (one fp64 copy of ``t`` at most)."""
    t = t if t.dtype == torch.float64 else t.double()
    flat = t.reshape(-1)
    return float(torch.dot(flat, flat))


def rel_error(approx: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """||g - g_exact|| / ||g_exact|| over every trainable parameter of the decoder layers
    (NOTE [ Non-finite passes ]: NaN when the exact gradient is not finite)."""
    num = sum(squared(minus(a, e)) for a, e in zip(approx, exact))
    den = sum(squared(e) for e in exact)
    return ratio(num, den)


def step_error(diff: list[torch.Tensor], exact: list[torch.Tensor], collective) -> float:
    """||sum_r D_r|| / ||sum_r G_r||: the relative error of the step's gradient over ranks.

    NOTE [ The step's error over ranks ]
    What the optimizer sees is the gradient summed over ranks (data parallel, then averaged:
    a scale the ratio does not see), so the error ``grad_error_tolerance`` bounds is
    ||sum_r D_r|| / ||sum_r G_r||, with D_r = sum_m (g_m - g_m exact) and G_r = sum_m g_m exact
    of rank r's micro-steps. Neither the max of the ranks' own errors nor a sum of their
    squared norms is that: ||sum_r D_r||^2 = sum_r ||D_r||^2 + sum_{r != s} <D_r, D_s>, and
    the cross terms (errors that cancel or add up over ranks) need the vectors. So D and G
    themselves are summed over ranks, tensor by tensor (every rank holds the whole gradient of
    the parameters a pass measures, under ZeRO-3 too: a pass's gradients are full tensors, never
    partitioned), and the norms taken after, in fp64, one tensor at a time; every rank then
    computes the same value. With the passes in pieces (NOTE [ What a pass holds ] in
    pass_runner.py) each piece's D and G are summed over ranks in turn and the squared norms add
    up over pieces. Validation runs every ``validation_interval`` steps, so this all-reduce of
    one gradient (twice) is rare.

    Args:
        diff, exact: this rank's D and G, one tensor per parameter; summed in place.
        collective: ``runtime.collective`` (None on one process): ``all_reduce_sum_tensor``
            (in place) where it has one, else its list form ``all_reduce_sum``.
    """
    return ratio(*summed_norms(diff, exact, collective))


def summed_norms(diff: list[torch.Tensor], exact: list[torch.Tensor], collective) -> tuple[float, float]:
    """(||sum_r D_r||^2, ||sum_r G_r||^2), D and G summed over ranks in place."""
    if collective is not None:
        _sum_over_ranks([*diff, *exact], collective)
    return sum(squared(d) for d in diff), sum(squared(e) for e in exact)


def _sum_over_ranks(tensors: list[torch.Tensor], collective) -> None:
    """Every tensor summed over ranks, in place, in the same order on every rank."""
    reduce = getattr(collective, "all_reduce_sum_tensor", None)
    if reduce is not None:
        for t in tensors:
            reduce(t)
        return
    flat = torch.cat([t.detach().flatten().double().cpu() for t in tensors])  # (n,) a stand-in's list form
    summed = torch.tensor(collective.all_reduce_sum(flat.tolist()), dtype=torch.float64)
    offset = 0
    for t in tensors:
        t.copy_(summed[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


# NOTE [ Non-finite passes ]
# A matched pass on a microbatch whose backward overflowed (fp16 loss scaling in the first
# steps, exactly when calibration runs) has a non-finite exact gradient: it measures nothing.
# Its error is NaN -- never 0, which would read as "packing is free", and never stored, which
# would make every later risk NaN and the knapsack refuse -- and the pass is dropped, counted
# (``dropped_nonfinite``) and run again on a later microbatch. An exact gradient that is finite
# with an approximation that is not is a real, unbounded error: inf, which tightens the risk
# budget as far as it goes (and is never a calibration sample: s = inf would make 0 x inf).
def ratio(num: float, den: float) -> float:
    """sqrt(num / den) of squared norms: NaN when ``den`` is not finite, inf when ``num`` is
    not (or when ``den`` is 0 and ``num`` is not), 0 when both are 0."""
    if not math.isfinite(den):
        return math.nan
    if not math.isfinite(num):
        return math.inf
    if den > 0:
        return (num / den) ** 0.5
    return 0.0 if num == 0 else math.inf
