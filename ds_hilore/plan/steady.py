"""Steady steps: where every bucket runs as gradient checkpointing, a microbatch makes no
collective, before its forward or after (NOTE [ A steady step agrees nothing before its
forwards ]); whether the next step is steady is agreed at the end of this one.

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
# whatever a bucket sets off that ends in a collective -- its profile, its plan's check,
# leave-one-out, a calibration, a prediction's rows -- starts on every rank at once, and so
# that every rank runs one plan: the runtime's checks decide from the plan whether a rank takes
# part in a collective (a frame that keeps a unit checks its elided sequences at the top of the
# backward, or at every layer where transformers records hidden states: NOTE [ Collective
# elision ] in runtime/agreement.py), and under ZeRO-3 or FSDP the module calls must match.
# Where every bucket met runs as gradient checkpointing (NOTE [ Never slower than GC ] in
# validate.py: small layers, short microbatches, where the agreement's cost counts most), no
# microbatch keeps anything, checks anything or makes a collective, whatever its shape: so once
# nothing is due either (no pass chosen, no memory to charge, no shape waiting for its bucket),
# the ranks agree at the end of a step (``close`` of the step's exposure, an all-reduce made
# anyway) that the next one is *steady*: each rank runs its microbatches as GC, with no
# collective and no device read before the first layer's forward -- none at all in the
# microbatch. A shape without a bucket of its own, or a prediction handed to ``expect`` (its
# rows are agreed before the forward: NOTE [ Freed memory is spent ]), makes the next step agree
# again, where the shape gets its bucket (it may be one HiLoRe wins on), the prediction its
# rows; a length that no bucket held keeps the steps agreeing until the length comes again and
# is given one. ``hold_out``, called on every rank at the same point, ends the steady step
# there. Where a bucket runs HiLoRe's plan, every step agrees: a rank's own shape could pick
# another bucket's plan than the others'. Never under ZeRO-3 or FSDP (``matched_calls``), nor
# in one process (nothing to agree); a resumed run agrees its first step. The agreement saved
# is small on a CPU (an all-reduce of a few values between 2 gloo processes: 0.5-2 ms, plus the
# wait for the slower rank), but it is a point where every rank waits for the others before
# its forward, and on an accelerator the forward's first kernels wait behind it.
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
    unheld = [k for k, v in enumerate(summed[1:]) if v > 0]
    if unheld:
        s.pending = max(s.pending, 1 << max(unheld))
    if s.pending and any(b.key[1] >= s.pending for b in s.buckets.values()):
        s.pending = 0
    s.steady = not summed[0] and not s.pending and settled_everywhere(s)
    s.unsettled, s.unheld = False, 0
    if s.steady and not s.said_steady:
        s.said_steady = True
        logger.info("ds_hilore: every shape met so far runs as gradient checkpointing: from step "
                    "%d the ranks agree nothing before a microbatch's forward (a new shape or a "
                    "prediction makes the next step agree again).", s.steps)


def settled_everywhere(s) -> bool:
    """Whether the next step may be steady as far as what every rank knows alike says: every
    bucket runs as GC, none awaits its profile or leave-one-out, nothing is due. Read after
    the step's end on every rank."""
    if s.runtime.collective is None or s.runtime.matched_calls or not s.buckets:
        return False
    if s.metering.awaiting or s.metering.check is not None or s.passes.due():
        return False
    return all(b.loo is None and s._runs_as_gc(b, unpredicted=True) for b in s.buckets.values())


def begin_forward(s, args, kwargs) -> None:
    """A microbatch of a steady step: run as GC, nothing agreed (NOTE [ A steady step agrees
    nothing before its forwards ])."""
    s.rows_here, length = input_shape(args, kwargs)
    s.runtime._split_next = None
    s.expected = None  # ``expect`` marked the step unsettled: used from the next one
    s.shortest = s.longest = s.length_here = int(length)
    s.rows_agreed = list(prediction.row_values(s, length))  # no prediction: nothing to agree
    key = (int(s.rows_here), rounded_length(length))
    bucket = holding(s.buckets, key)
    if bucket is None or bucket.key[1] != key[1]:  # a shape of its own: learnt next step
        s.unsettled = True
    if bucket is None:
        s.unheld = max(s.unheld, key[1])
        s.warm_up("unplanned")
    s.bucket = bucket or next(iter(s.buckets.values()))
    s.timing, s.passes.fresh, s.applied, s.predicted_zero = None, False, None, False
    s.runtime.gc_forward = True


def holding(buckets: dict, key: tuple[int, int]) -> Bucket | None:
    """The bucket of ``key``, else the smallest that holds it (no fewer sequences, no shorter
    length), else None."""
    if key in buckets:
        return buckets[key]
    larger = [b for b in buckets.values() if b.key[0] >= key[0] and b.key[1] >= key[1]]
    return min(larger, key=lambda b: (b.key[1], b.key[0]), default=None)
