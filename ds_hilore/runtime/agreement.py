"""What every rank agrees on when a microbatch's coefficients are known: the elision's one
all-reduce (NOTE [ Collective elision ]), and the units whose capture-time elision the
coefficients disproved. Used by elision.py."""

from __future__ import annotations

from typing import NamedTuple

def unverified_rows_to_r(runtime, frames, zero_of, mb=None) -> None:
    """Sequences a plan elided at capture (predicted to have zero coefficients) that do not:
    their units are recomputed instead (exact: the layer's inputs are kept). ``zero_of(frame)``
    is the set of the frame's sequences shown to be zero. A collective under several ranks
    (NOTE [ Collective elision ]): every rank calls it at the same point, but for a microbatch
    whose decisions are this rank's own (NOTE [ A microbatch of its own ]). ``mb``: a
    microbatch whose coefficients never came; whether some rank split its rows rides along (its
    merges' flags are then read, NOTE [ Kept rows only ] in rows.py)."""
    flags = _unverified(runtime, frames, zero_of) + [int(mb is not None and mb.split is not None)]
    if runtime.collective is not None and not (mb is not None and mb.local_checks):
        flags = runtime.collective.all_reduce_max(flags)
    if mb is not None and flags[-1]:
        mb.rows_due = mb.late_due = True
    names = _flagged(runtime, flags[:-1])
    for frame in frames:
        recompute_named(frame, names)


# NOTE [ Collective elision ]
# What a plan elides at capture comes from this rank's prediction and what ω turns out to be
# from this rank's data, so the units whose elision is disproved differ between ranks. Under
# ZeRO-3 a recompute gathers the layer's parameters, and a unit recomputed on one rank only
# issues gathers the others never match (gloo: "collective mismatch"; NCCL: a hang, or shards
# of same-shaped weights paired wrongly). So the sets are OR-ed over ranks -- a fixed-length
# flag vector, one entry per unit of the model, all-reduced by max -- before any unit is sent
# to R, and every rank recomputes the union. Recomputing a unit whose elision held on this
# rank is exact (its inputs are always kept), only slower. The same all-reduce carries
# whether every sequence of every rank is zero; both candidate flag sets ride along (the
# frames called without the microbatch's segments elide depending on that answer), and so
# do the unit flags of the forward's failed checks (NOTE [ Collective fallback ] in
# microbatch.py), the late flag of earlier backwards (an error on every rank at once) and
# whether this microbatch leaves one (NOTE [ A late read, due on every rank ] in late.py),
# all read in the same read (NOTE [ Two reads per microbatch ] in reads.py): one all-reduce at
# the coefficients decides everything there. The flags of the accumulation's last backward are
# read before the optimizer step, by the engine on every rank (``check_late``), one more
# all-reduce in a step that left some; the optimizer's pre-hook and ``end_step`` then find
# nothing left. A rank that raised alone would leave the others stepping on the reduced,
# wrong gradients and then waiting at their next collective. Where no decision needs to be
# every rank's (ZeRO 0-2, and plans of each rank's own or set by hand) it is not made at all
# (NOTE [ A microbatch of its own ], below).
# NOTE [ A microbatch of its own ]
# Where a recompute issues no collective (ZeRO 0-2 through ``ds_hilore.initialize``: not
# ``matched_calls``) and the ranks' plans need not be one -- a steady step
# (NOTE [ A steady step agrees nothing before its forwards ] in plan/steady.py), or a plan set by
# hand (``set_plan`` / ``force_plan``, no allocator) -- nothing a microbatch decides has to be every
# rank's: which units a disproved elision or a failed check sends to R, which sequences are elided,
# whether its layers' backward is skipped (each rank's backward is its own there), the risk fit
# (this rank's plan). Such a microbatch (``Microbatch.local_checks``) makes no collective from its
# forward to the end of its backward: the elision's all-reduce at the coefficients is not made, nor
# the checks' at the top of the backward or at a layer. Only an error must still be every rank's: a
# rank raising alone would leave the others waiting at their next gradient reduction. So each rank
# keeps what it found -- a late leak, on the device, and a row predicted zero with coefficients, on
# the host (its rows ran without autograd: the backward reads nothing of them, their gradient is
# missing) -- and every rank holds a late flag from the start of such a microbatch
# (``LateFlags.seed``: a host False where nothing leaves one), so the next read before any optimizer
# step (``check_late``, the optimizer's pre-hook, ``end_step``) is one all-reduce on every rank and
# raises on every rank -- even where an agreed microbatch's coefficients took the flag meanwhile
# (two forwards alive), and, where a read came between such a microbatch's forward and its backward,
# the top of that backward holds one again (``reseed``): what a backward leaves is this rank's
# alone. A step of such microbatches thus makes one collective of HiLoRe's at its end, where the
# ranks meet anyway, instead of one or two in each microbatch between its forward and its backward
# -- a point where the faster rank waits for the slower. On 2 layers of width 64 (0.2 s steps, 2
# ranks, every unit stored), that meeting put HiLoRe 8 % behind no checkpointing; without it,
# 3.5-5 % (``hilore bench --model tiny``). An error then comes at the step's end rather than at
# the next microbatch's coefficients, still before any optimizer step.
class Flags(NamedTuple):
    """What each rank brings to the elision's all-reduce besides the unit flags, OR-ed over
    ranks there: an earlier backward leaked (late.py), a sequence found zero (a late read
    due), a row predicted zero has coefficients, the microbatch's rows were split (NOTE
    [ Kept rows only ] in rows.py)."""

    late: bool
    due: bool
    disproved: bool
    split: bool


def agree(runtime, frames, all_zero: bool, verified, failed: list[int], flags: Flags,
           risks: list[float] | None, local: bool = False):
    """((every rank's sequences all zero, some rank's, this rank's), names of the units to
    recompute on every rank, unit flags of a failed check on any rank, ``flags`` OR-ed over
    ranks, the policy's ``risks``, the max over ranks, or None). One all-reduce (float64: the
    flags are exact in it); none where ``local``, the microbatch's decisions this rank's own
    (NOTE [ A microbatch of its own ]): then every value is this rank's."""
    here = all_zero
    if_all = _unverified(runtime, frames, lambda f: verified(f, True))
    if_not = _unverified(runtime, frames, lambda f: verified(f, False))
    some = all_zero
    if runtime.collective is not None and not local:
        n, extra = len(if_all), list(risks or [])
        agreed = runtime.collective.all_reduce_max_float(
            [0 if all_zero else 1, int(all_zero), *if_all, *if_not, *failed, *map(int, flags),
             *extra])
        ints = [int(x) for x in agreed[:len(agreed) - len(extra)]]
        all_zero, some = ints[0] == 0, ints[1] > 0
        if_all, if_not = ints[2:2 + n], ints[2 + n:2 + 2 * n]
        failed, flags = ints[2 + 2 * n:-len(flags)], Flags(*(x > 0 for x in ints[-len(flags):]))
        risks = agreed[len(agreed) - len(extra):] if risks is not None else None
    return ((all_zero, some, here), _flagged(runtime, if_all if all_zero else if_not), failed,
            flags, risks)


def elidable_rows(frame, every_zero: bool, zero: list[int], segments, source: str) -> set[int]:
    """The sequences ``frame`` may elide: the zero ones of the microbatch; for a call without
    the microbatch's segments, its one row when every sequence (of every rank) is zero."""
    if frame.segments == segments:
        return set(zero) if frame.elision_ok else set()
    checked = frame.elision_ok and every_zero and frame.sequences == 1 and (
        source == "analytic" or any(a != "R" for a in frame.plan.actions))
    return {0} if checked else set()


def _unverified(runtime, frames, zero_of) -> list[int]:
    """One flag per unit of the model (unit order): a frame elided a sequence ``zero_of(frame)``
    does not contain, at capture or at an earlier hand-off of coefficients (NOTE
    [ Coefficients handed twice ])."""
    index = {unit.name: k for k, unit in enumerate(runtime.units)}
    flags = [0] * len(index)
    for frame in frames:
        zero = zero_of(frame)
        dropped = bool(frame.rows_dropped - zero)
        for pos, rows in enumerate(frame.plan.rows):
            if frame.plan.actions[pos] == "R":
                continue
            if dropped or (rows is not None and any(a == "E" and i not in zero
                                                    for i, a in enumerate(rows))):
                flags[index[frame.layer.units[pos].name]] = 1
    return flags


def _flagged(runtime, flags: list[int]) -> set[str]:
    return {unit.name for unit, flag in zip(runtime.units, flags) if flag}


def recompute_named(frame, names: set[str]) -> None:
    """Recompute the frame's units named in ``names``."""
    for pos, unit in enumerate(frame.layer.units):
        if unit.name in names and frame.plan.actions[pos] != "R":
            frame.downgrade(pos, "R")
