"""Steady steps: once every bucket is planned and nothing is due, a microbatch makes no
collective and no device read before its first layer's forward (NOTE [ A steady step agrees
nothing before its forwards ]); whether the next step is steady is agreed at the end of this one.

Plain functions of the ``Scheduler`` (scheduler.py) they are called from.
"""

from __future__ import annotations

import logging
import math

from ds_hilore.plan import prediction
from ds_hilore.plan.buckets import Bucket, input_shape, rounded_length

logger = logging.getLogger("ds_hilore")


# NOTE [ A steady step agrees nothing before its forwards ]
# A microbatch's bucket is the max over ranks of its shape (NOTE [ Uneven batches ]): one
# all-reduce in the model's forward pre-hook, before the first layer runs. It is there so that
# whatever a bucket sets off that ends in a collective -- its profile, its plan's memory check,
# leave-one-out, a calibration, a prediction's rows -- starts on every rank at once, and so that
# every rank runs one plan: the runtime's checks decide from the plan whether a rank takes part
# in a collective (a frame that keeps a unit checks its elided sequences at the top of the
# backward, or at every layer where transformers records hidden states: NOTE [ Collective
# elision ] in runtime/agreement.py), and under ZeRO-3 or FSDP the module calls must match.
# Once every bucket met is planned and nothing is due -- no profile, memory check, memory
# charge or leave-one-out awaited, no pass chosen, no shape waiting for its bucket -- the ranks
# agree at the end of a step (``close`` of the step's exposure, an all-reduce made anyway) that
# the next one is *steady*: each rank takes the bucket of its own shape (the smallest that
# holds it, as a rank whose microbatch is shorter than another's does in an agreed step) and
# runs its plan with no collective and no device read before the first layer's forward. Two
# ranks may then run different plans, so the checks that follow the plan are this rank's own
# in a steady microbatch (``Microbatch.local_checks``): a leak found at the top of the backward
# or at a layer sends this rank's frames to R, and the checks left are read without an
# all-reduce -- safe only where a recompute issues no collective, ZeRO 0-2, and steady steps
# are never taken under ZeRO-3 or FSDP (``matched_calls``). Nor does the rest of the
# microbatch agree anything (NOTE [ A microbatch of its own ] in runtime/agreement.py): no
# all-reduce at the coefficients, no check's; what a rank found that must be an error on every
# rank is read once, before the optimizer step, on every rank (every rank holds a late flag
# then), and the step's end agrees the next step. Where every bucket runs as gradient
# checkpointing (NOTE [ Never slower than GC ] in validate.py: small layers, short
# microbatches) a steady microbatch runs as GC; where some bucket runs its plan, one whose
# bucket runs as GC runs all R through HiLoRe's frames instead, as a length that no bucket holds
# does (NOTE [ One order of gradient hooks on every rank ], below). Such a length keeps the
# steps agreeing until it comes again and gets its bucket; a shape held by a longer bucket that
# runs as GC makes the next step agree too, to give it its own (it may be one HiLoRe wins on).
# A prediction handed to ``expect`` is this rank's own too: its rows (which run apart, NOTE
# [ Kept rows only ] in runtime/rows.py, which are elided) and the plan re-solved for them come
# from this rank's prediction alone (NOTE [ Freed memory is spent ] in prediction.py), where a
# step that agrees plans every rank for the worst case over ranks; a rank whose microbatch is
# predicted zero runs it all R, its layers' backward skipped where a rank may skip its own
# (NOTE [ A microbatch predicted zero ]), while the others run theirs. Where every bucket runs
# as GC, a prediction is not used in the steady step (the ranks without one run as GC) and
# makes the next step agree, whose ranks split their rows together; so do the steps after it
# while predictions come to a bucket that runs as GC. ``hold_out``, called on every rank at the
# same point, ends the steady step there; a resumed run agrees again (a few steps) before it is
# steady; one process has nothing to agree.
# The agreement saved is small on a CPU (an all-reduce of a few values between 2 gloo
# processes: 0.5-2 ms, plus the wait for the slower rank), but it is a point where every rank
# waits for the others before its forward, and on an accelerator the forward's first kernels
# wait behind it.

# NOTE [ One order of gradient hooks on every rank ]
# ZeRO-1/2 reduce gradients from the hooks autograd fires as each parameter's gradient is
# accumulated: DeepSpeed copies the gradients into a bucket in the order the hooks fire and
# reduces the bucket's slices by position, so every rank must fire them in one order -- two
# parameters swapped on one rank sum one's gradient with the other's, silently, where their
# slices have the same size. A microbatch run as GC (HiLoRe's hooks out of the way) and one run
# through HiLoRe's frames do not fire them in one order: on a 2-layer Qwen2, the final norm's
# weight before the LM head's through frames, after it as GC (the layers' own hooks in the same
# order under H, R and rows run apart) -- the gate at the last layer's output takes every
# trainable parameter as an input (NOTE [ A backward of zeros ] in runtime/zero_backward.py), so
# the accumulators of those above it wait for it too. A step that agrees runs one path on every
# rank, decided from agreed values only (a prediction handed on one rank and not on another does
# not split them); a steady step runs as GC on every rank (every bucket runs as GC) or through
# frames on every rank, a microbatch whose bucket runs as GC then all R, what GC keeps (paying
# HiLoRe's host path over GC's there, the price of a step that agrees nothing). Found by a 2-rank
# ZeRO-2 run whose parameters after a steady step with one rank on each path differed from GC's.
SLOTS = 48  # one per power of two of a length no bucket held


def riders(s) -> list[float]:
    """What this rank adds to the all-reduce (a sum) that closes the step: whether its next
    step must agree, and the longest length no bucket held, one-hot by its power of two."""
    unheld = [0.0] * SLOTS
    if s.unheld:
        unheld[min(SLOTS - 1, int(math.log2(s.unheld)))] = 1.0
    return [float(s.unsettled), *unheld]


def after_step(s, summed: list[float]) -> None:
    """The step's end, alike on every rank (``summed``: ``riders`` summed over ranks):
    whether the next step is steady."""
    if s.steady:  # its risk fits were counted by each rank (a GC microbatch fits none): the
        s.fits = 0  # next agreed one fits on every rank (``_fit_due``)
    unheld = [k for k, v in enumerate(summed[1:]) if v > 0]
    if unheld:
        s.pending = max(s.pending, 1 << max(unheld))
    if s.pending and any(b.key[1] >= s.pending for b in s.buckets.values()):
        s.pending = 0
    settled = settled_everywhere(s)
    s.steady = not summed[0] and not s.pending and settled is not None
    s.steady_as_gc = bool(settled)
    s.unsettled, s.unheld = False, 0
    if s.steady and not s.said_steady:
        s.said_steady = True
        logger.info("ds_hilore: every shape met so far is planned%s: from step %d the ranks "
                    "agree nothing before a microbatch's forward (a new shape makes the next "
                    "step agree again).",
                    " and runs as gradient checkpointing" if s.steady_as_gc else "", s.steps)


def settled_everywhere(s) -> bool | None:
    """Whether the next step may be steady as far as what every rank knows alike says: every
    bucket planned, none awaits its memory check or leave-one-out, nothing is due; True where
    every bucket runs as GC, False where some runs its plan, None where it may not be steady.
    Read after the step's end on every rank."""
    if s.runtime.collective is None or s.runtime.matched_calls or not s.buckets:
        return None
    if s.metering.awaiting or s.metering.check is not None or s.passes.due():
        return None
    buckets = list(s.buckets.values())
    if any(b.plan is None or b.loo is not None for b in buckets):
        return None
    as_gc = [s._runs_as_gc(b, unpredicted=True) for b in buckets]
    if any(not gc and s.metering.awaits_check(b) for b, gc in zip(buckets, as_gc)):
        return None
    return all(as_gc)


def begin_forward(s, args, kwargs) -> None:
    """A microbatch of a steady step: the plan of the bucket holding this rank's own shape (as
    GC where the buckets run as GC), nothing agreed (NOTE [ A steady step agrees nothing before
    its forwards ])."""
    s.rows_here, length = input_shape(args, kwargs)
    s.runtime._split_next = None
    s.shortest = s.longest = s.length_here = int(length)
    s.rows_agreed = list(prediction.row_values(s, length))  # this rank's own: nothing agreed
    key = (int(s.rows_here), rounded_length(length))
    bucket = holding(s.buckets, key)
    predicted = not s.rows_agreed[prediction.MISSING]
    bucket_gc = s.steady_as_gc if bucket is None else s._runs_as_gc(bucket, unpredicted=True)
    if bucket is None or (bucket_gc and bucket.key[1] != key[1]):
        s.unsettled = True  # a shape of its own: learnt next step
    if s.steady_as_gc and predicted:  # every rank runs as GC: this one too, and the next step
        s.unsettled = True  # agrees whether the ranks split their rows
    if bucket is None:
        s.unheld = max(s.unheld, key[1])
        s.warm_up("unplanned")
    s.bucket = bucket or max(s.buckets.values(), key=lambda b: (b.key[1], b.key[0]))
    s.timing, s.passes.fresh, s.applied, s.predicted_zero = None, False, None, False
    s.runtime.gc_forward = s.steady_as_gc  # NOTE [ One order of gradient hooks on every rank ]
    if not s.steady_as_gc:
        if bucket is None or s._runs_as_gc(bucket, unpredicted=not predicted):
            s.runtime.apply_plan("R")  # what GC keeps, through frames
        else:  # a prediction's rows and plan are this rank's (NOTE [ Freed memory is spent ])
            s._apply(bucket, steady=True)
    s.expected = None  # a prediction is for this microbatch only


def holding(buckets: dict, key: tuple[int, int]) -> Bucket | None:
    """The bucket of ``key``, else the smallest that holds it (no fewer sequences, no shorter
    length), else None."""
    if key in buckets:
        return buckets[key]
    larger = [b for b in buckets.values() if b.key[0] >= key[0] and b.key[1] >= key[1]]
    return min(larger, key=lambda b: (b.key[1], b.key[0]), default=None)
