"""Late elision flags: what a backward's per-layer elision checks found (NOTE [ Checked
elision ] in elision.py), kept on the device and read later -- with the next coefficients, by
``check_late`` / ``end_step``, or before any torch optimizer steps -- on every rank alike.

NOTE [ A late read, due on every rank ]
The late flags of a backward are this rank's: only a rank that elided sequences has any. Read
where a rank has some and raised there alone, the others would step on the reduced, wrong
gradients and then wait at their next collective -- and a process-wide optimizer pre-hook
reads them at any optimizer's step, another runtime's included (an actor's flags at the
critic's step). So whether a read is due is agreed on: a microbatch whose sequences were found
zero on any rank (a flag riding on the elision's all-reduce at the coefficients, ``_agree`` in
elision.py), or elided by hand on every rank alike (``downgrade(..., "E")``), leaves a late
flag after its backward on every rank -- this rank's own, or a host False where it elided
nothing -- and every read of the flags (with the next coefficients, ``check_late``,
``end_step``, an optimizer's pre-hook) is then one all-reduce, on every rank at the same point,
and raises on every rank. A step with no sequence found zero on any rank leaves no flag: no
read, and no all-reduce. A microbatch whose decisions are its rank's own agrees nothing at its
coefficients, so every rank holds a flag from its start instead (NOTE [ A microbatch of its
own ] in agreement.py): the step's read is then made on every rank, whatever each found -- and
so is the pre-hook's at any torch optimizer's step after such a step: an optimizer that steps on
some ranks only would wait there for the others. The pre-hook reads the runtimes in the order
they were attached (the same on every rank).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ds_hilore._errors import HiLoReError
from ds_hilore.runtime.rows import disproved_error

__all__ = ["LateFlags", "late_error"]


class LateFlags:
    """The late flags of one runtime not read yet."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.order = next(_ATTACHED_ORDER)  # the same on every rank: runtimes attach together
        self.flag: torch.Tensor | None = None  # () bool: a late leak since the last read
        # a row predicted zero had coefficients in a microbatch of this rank's own (NOTE
        # [ A microbatch of its own ] in agreement.py): raised at the next read, on every rank
        self.disproved = False
        # such a microbatch began since the last read, on every rank alike: the next read is
        # one all-reduce on every rank, whatever took the flag meanwhile
        self.seeded = False
        self.reads = 0  # reads so far (``flush``), the same count on every rank

    def defer(self, mb) -> None:
        """The end of a backward: its per-layer flags folded into one, on the device, read with
        the next read or before the next optimizer step (NOTE [ Two reads per microbatch ] in
        reads.py); a host False where this rank's backward checked none (NOTE [ A late read,
        due on every rank ])."""
        leaks, mb.late_leaks = mb.late_leaks, []
        flag = torch.stack(leaks).any() if leaks else torch.zeros((), dtype=torch.bool)
        self.flag = flag if self.flag is None else self.flag | flag
        _PENDING.add(self)
        _watch_optimizers()

    def seed(self) -> None:
        """A microbatch whose decisions are this rank's own (NOTE [ A microbatch of its own ]
        in agreement.py), begun on every rank alike: a read is due on every rank, so every
        rank holds a flag -- a host False where nothing else leaves one."""
        if self.flag is None:
            self.flag = torch.zeros((), dtype=torch.bool)
        self.seeded = True  # (a microbatch records ``reads`` here: ``reseed``)
        _PENDING.add(self)
        _watch_optimizers()

    def reseed(self, mb) -> None:
        """The top of a backward of ``mb``, on every rank alike: where a read came between its
        forward and its backward (another optimizer's step), a microbatch of this rank's own
        holds a flag again, so that what its backward leaves is read on every rank."""
        if mb.local_checks and mb.late_reads != self.reads:
            mb.late_reads = self.reads
            self.seed()

    def take(self) -> torch.Tensor | None:
        """The flags, handed over to be read with others (``Elision.apply``); a read stays due
        where a microbatch of this rank's own began since the last (``seed``)."""
        flag, self.flag = self.flag, None
        if not self.seeded:
            _PENDING.discard(self)
        return flag

    def take_disproved(self) -> bool:
        """Whether a microbatch of this rank's own found a row predicted zero with
        coefficients since the last read, handed over to be agreed on with others."""
        disproved, self.disproved = self.disproved, False
        return disproved

    def flush(self) -> None:
        """Read the flags now, where a read is due (on every rank alike, NOTE [ A late read,
        due on every rank ]); raises on every rank if one is set on any: a leak is this rank's,
        while the gradients about to be stepped on are every rank's once data parallelism
        reduced them. Every rank calls it at the same point."""
        self.reads += 1
        flag, seeded, disproved = self.take(), self.seeded, self.take_disproved()
        self.seeded = False
        _PENDING.discard(self)
        if flag is None and not seeded:
            return
        leaked = flag is not None and bool(flag)
        if self.runtime.collective is not None:
            leaked, disproved = (v > 0 for v in self.runtime.collective.all_reduce_max(
                [int(leaked), int(disproved)]))
        if disproved:
            raise disproved_error()
        if leaked:
            raise late_error()


_ATTACHED_ORDER = itertools.count()  # LateFlags.order
_PENDING: "weakref.WeakSet[LateFlags]" = weakref.WeakSet()  # those holding flags not read yet
_OPTIMIZER_HOOK: list = []  # the handle of the step pre-hook, once registered


def _watch_optimizers() -> None:
    """Every torch optimizer reads the late flags before it steps (one hook per process)."""
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_before_optimizer_step))


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    for flags in sorted(_PENDING, key=lambda f: f.order):  # NOTE [ A late read, due on every rank ]
        flags.flush()


def late_error() -> HiLoReError:
    return HiLoReError(
        "gradient reached sequences whose loss coefficients are zero through an intermediate "
        "layer's hidden state (a loss on it that transformers did not record); their "
        "activations had been elided, so the gradients accumulated since the last optimizer "
        "step are wrong and no step may use them. Compute that loss from "
        "output_hidden_states=True, or hand ds_hilore the coefficients of the whole loss. "
        "Without such a loss, a kernel's backward turned the stand-in values of elided "
        "sequences into gradient (NaN or not): set \"elide_zero_rows\": false in the \"hilore\" "
        "block.")
