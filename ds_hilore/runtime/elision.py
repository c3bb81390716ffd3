"""Exposure and elision for one runtime: where the loss coefficients of a microbatch act.

``apply`` runs when the coefficients ω of a microbatch are known -- from the loss
(``set_coefficients``) or, for any loss, from the gradient arriving at the last hidden state --
and elides the sequences whose ω is exactly zero (NOTE [ Exact zeros ] in storage.py).
``on_layer_grad`` then checks, in the backward, that nothing else reaches them.

NOTE [ Checked elision ]
Sequences are elided because ω says their gradient is zero; a loss term ω does not see (an
entropy bonus, a KL on the logits) breaks that. The check reads the gradient that actually
arrives at the last HiLoRe layer's output, before any layer's backward runs: if an elided
sequence gets any, every layer that elided falls back to R (its inputs are kept), which is
exact. One read of the device per microbatch, and under several ranks one all-reduce: the
decision is collective, because a rank that re-runs a layer under ZeRO-3 gathers
parameters the others must gather too. Gradient entering lower down -- a loss on an
intermediate hidden state -- is checked at every layer when transformers records hidden
states (a read per layer and, under several ranks, an all-reduce per layer, in that case
only); gradient entering through internal outputs
(router logits, attentions) turns elision off for those layers at the forward. Anything else
(a user hook keeping an intermediate hidden state for its own loss) is caught by flags
collected on the device at every layer, folded into one when the backward ends and read with
the runtime's next read, or before any optimizer steps (NOTE [ Two reads per microbatch ] in
reads.py): an error, before the optimizer can step on a wrong gradient.

NOTE [ Stand-ins on accelerators ]
On CPU the stand-ins of elided sequences (NOTE [ Exact zeros ] in storage.py) meet only
backward formulas that turn a zero gradient into zeros, which the tests show bitwise. On one
H200 (torch 2.11, bf16, a padded GRPO batch) the layers' backward over elided sequences gave
them gradient anyway -- e after one layer, growing by ~1e8 a layer, or NaN -- with H or L units
under the default attention kernels. The checks above caught it (NaN once they counted NaN),
but a run that raises is no product. A microbatch whose layers' backward is skipped (NOTE [ A
backward of zeros ]) runs no kernel at all, so ``elide_zero_rows`` has three settings: true
elides every zero sequence, "whole" elides only a microbatch whose every sequence is
zero and only when its layers' backward will be skipped (``_may_skip``: the loss's own ω, a
backward not measured, not ZeRO-3), and false nothing. "auto" is true where stand-ins are
shown exact (CPU) and "whole" on accelerators: the A = 0 microbatches of GRPO, planned all R
from the prediction, still cost no backward there. Should the skip not happen after all,
``_no_stand_ins`` sends every frame holding elided sequences to R before any layer's backward
reads one. Sequences a prediction says are zero are not elided at capture in either setting:
they run their layers without autograd, and no backward ever meets them (NOTE [ Kept rows
only ] in rows.py); where their rows cannot be run apart (a layer that draws random
numbers), the scheduler elides at capture only what the setting allows -- under "whole" a
microbatch predicted zero in every sequence, planned all R, and only where the skip can
happen (under ZeRO-3 it runs the bucket's plan: its backward runs anyway, and R would
recompute it all; a microbatch that leave-one-out times runs the variant it times).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from ds_hilore.grpo import exposure
from ds_hilore.runtime import rows
from ds_hilore.runtime.agreement import (Flags, agree, elidable_rows, recompute_named,
                                         unverified_rows_to_r)
from ds_hilore.runtime.late import LateFlags, late_error
from ds_hilore.runtime.reads import read_once

logger = logging.getLogger("ds_hilore")


class Elision:
    """The exposure / elision plumbing of a ``HiLoReRuntime`` (NOTE [ Checked elision ])."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._warned = False
        self._warned_twice = False  # NOTE [ Coefficients handed twice ]
        self.stopped_short = 0  # backwards of forwards that ended below the last layer
        self.late = LateFlags(runtime)  # late leaks since the last read (late.py)

    # ------------------------------------------------------------------ coefficients known
    def apply(self, mb, coefficients: torch.Tensor, offset, source: str) -> None:
        """Exposure per unit and sequence, and elision of the sequences whose ω is zero; the
        forward's deferred checks and earlier backwards' late flags decided with them: one read
        and one all-reduce for all (NOTE [ Two reads per microbatch ] in reads.py)."""
        frames = mb.live_frames()
        if not frames:
            return
        split = mb.split if source == "analytic" else None  # NOTE [ Kept rows only ] in rows.py
        disproof = None  # |ω| on the rows predicted zero (run without autograd)
        if split is not None:
            coefficients, disproof = rows.kept_view(coefficients, split)
        abs_omega = exposure.align(coefficients, frames[0].seq_len, offset)  # (B, T)
        again = source == "analytic" and mb.source == "analytic"
        if again:  # NOTE [ Coefficients handed twice ]
            abs_omega = abs_omega + mb.token_weights
            self._say_twice()
        # NOTE [ Packed sequences ] (packed.py)
        segments = mb.segments if abs_omega.shape[0] == 1 else None
        every = len(segments) if segments is not None else abs_omega.shape[0]
        mass = exposure.row_mass(abs_omega, segments)  # (B,) or (K,): 0 exactly where ω ≡ 0
        policy = self.runtime.policy
        # read only where the policy weighs it: a risk fit due (refresh_interval), a pass
        unit_exposure = _unit_exposure(frames, abs_omega, coefficients.shape[1], offset, segments) \
            if policy is None or policy.wants_exposure(mb) else {}
        checks, held = mb.take_checks()
        # a microbatch of this rank's own leaves earlier backwards' flags to the next read made
        # on every rank (NOTE [ A microbatch of its own ] in agreement.py)
        local = mb.local_checks
        read = read_once([mass, held, None if local else self.late.take(), disproof,
                          *unit_exposure.values()])  # the one read
        mass_read, held, late, disproved = read[:4]
        zero = [i for i, m in enumerate(mass_read) if m == 0]  # a sum of |ω|: 0 iff every |ω| is
        if not again:  # NOTE [ Zero sequences found late ] in unpredicted.py
            self.runtime._zero_seen.found(every, len(zero), packed=segments is not None)
        mode = self.runtime.elision_mode(frames[0].device)  # NOTE [ Stand-ins on accelerators ]
        if mode is False or (mode == "whole" and not (
                len(zero) == every and self._may_skip(mb, source))):
            zero = []  # nothing elided here: exposure alone is used
        if segments is not None and len(zero) < every and \
                not all(f.segments_independent for f in frames):
            # segments see earlier ones: only a zero tail, and none where a mask lets a query
            # read a later key (NOTE [ Packed sequences ] in packed.py)
            zero = trailing(zero, every) if all(f.segments_causal for f in frames) else []
        all_zero = len(zero) == every and all(f.elision_ok for f in frames)
        # NOTE [ Exact zeros ]: copies only where memory is short
        keep = 0 < len(zero) < every and policy is not None and policy.keeps_whole(mb)
        mb.source, mb.zero_rows, mb.token_weights = source, zero, abs_omega
        kept = {u.name for f in frames for u, a in zip(f.layer.units, f.plan.actions)
                if a != "R" or mb.norms_all}
        exposed = {name: values for name, values in zip(unit_exposure, read[4:]) if name in kept}
        mb.exposure_read = (mass_read, {name: values for name, values in exposed.items()
                                        if len(values) == len(mass_read)})
        risks = policy.risk_vector(mb) if policy is not None and not again else None
        # NOTE [ Collective elision ]: one all-reduce decides, for every rank, whether all
        # sequences are zero, which units saw a capture-time elision disproved or a check
        # failed, whether an earlier backward leaked, and the risk of every unit (the policy's)
        disproved = any(v != 0 for v in disproved)
        earlier = not local and self.late.take_disproved()  # a microbatch of its own's, before
        agreed = agree(self.runtime, frames, all_zero, lambda frame, every_zero: elidable_rows(
            frame, every_zero, zero if every_zero or mode != "whole" else [], segments, source),
            mb.check_failures(checks, held), Flags(
                any(v != 0 for v in late), bool(zero),
                disproved or earlier, mb.split is not None),
            risks, local)
        all_zero, to_r, failed, flags, risks = agreed
        # NOTE [ A late read, due on every rank ] (late.py); a split's merges leave flags too
        mb.late_due = mb.late_due or flags.due or flags.split
        mb.rows_due = mb.rows_due or flags.split
        if flags.late:
            raise late_error()
        if flags.disproved and local:  # raised at the next read, on every rank; the rows ran
            self.late.disproved = True  # without autograd: no backward reads anything of them
        elif flags.disproved:
            raise rows.disproved_error()
        skip, skip_any = self._skip_here(all_zero, source)  # NOTE [ A backward of zeros ]
        if mode == "whole" and not skip:
            zero = []  # this rank keeps sequences, or another's forbid a skip: nothing elided
        mb.fall_back(checks, failed)
        for frame in frames:
            self._elide(frame, to_r, skip, skip_any, flags.due, source, zero, segments, keep)
        mb.exposure.update({name: unit_exposure[name] for name in exposed})
        if policy is not None and not again:  # the allocator spends the risk budget
            policy.after_coefficients(mb, risks)
        self.runtime._summarise(mb)

    def _skip_here(self, all_zero: tuple[bool, bool, bool], source: str) -> tuple[bool, bool]:
        """(whether this rank's frames stand in for their recompute and may skip their
        backward, whether some rank's do: the same on every rank). Every sequence zero here
        where each rank's backward is its own (ZeRO 0-2), on every rank where module calls
        must match (NOTE [ A backward of zeros ] in zero_backward.py)."""
        every, some, here = all_zero
        if source != "analytic":
            return False, False
        return (every, every) if self.runtime.matched_calls else (here, some)

    # NOTE [ Coefficients handed twice ]
    # Two losses computed from one forward's log-probs (a second ``policy_loss`` for a metric, or
    # two loss terms) each hand their ω. What the first elided is gone from the kept bytes, so
    # the second cannot simply replace it: the two are summed as |ω| (a sequence stays elided
    # only where both are zero, and never again where either is not), the sequences the first
    # dropped that the sum does not show zero are recomputed (``frame.rows_dropped``, read with
    # the capture-time elisions by ``_unverified`` in agreement.py: one collective decision), and the skip of an
    # all-zero microbatch holds only if both are zero. The allocator's risk fit keeps the
    # first's decision (it counted that microbatch once in the step). Said once.
    def _say_twice(self) -> None:
        if not self._warned_twice:
            self._warned_twice = True
            logger.warning("ds_hilore: loss coefficients were handed twice for one forward (two "
                           "losses on its log-probs): sequences stay elided only where both are "
                           "zero, and the allocator's risk fit keeps the first hand-off's. A loss "
                           "computed only for a metric hands none under torch.no_grad().")

    @staticmethod
    def _elide(frame, to_r: set[str], skip: bool, skip_any: bool, due: bool, source: str,
               zero: list[int], segments, keep: bool) -> None:
        """One frame after the ranks agreed: its disproved units to R, its zero sequences E.
        ``skip``: every sequence zero here (``_skip_here``); ``skip_any``: so on some rank;
        ``due``: some rank elides a sequence (``Flags.due``)."""
        frame.skip_zero_recompute = skip
        # the same on every rank (plans are synced, the flags agreed): whether the backward
        # checks, and so whether it takes part in the collective decision there -- not where
        # no rank elides anything (no zero sequence anywhere, or elision off): no check at the
        # top of the backward then, nor its read and all-reduce. In a steady step the plan is
        # this rank's own, and so is the decision (``mb.local_checks``)
        frame.elision_checked = frame.elision_ok and (
            skip_any or due and any(a != "R" for a in frame.plan.actions))
        recompute_named(frame, to_r)
        if frame.segments != segments:  # a call without the microbatch's segments
            frame.elision_checked = frame.elision_checked and skip_any and frame.sequences == 1
            frame.elided_rows = {0} if frame.elision_checked and skip else set()
            rows_zero = sorted(frame.elided_rows)
        else:
            # checked as elided even when kept in place: rows elided at capture (``expect``)
            # are among them, and the check must cover every row that may be
            frame.elided_rows = set(zero) if frame.elision_checked else set()
            rows_zero = [] if keep else zero
        if rows_zero and frame.elision_checked:
            frame.rows_dropped |= set(rows_zero)
            for pos, action in enumerate(frame.plan.actions):
                if action != "R":
                    frame.downgrade(pos, "E", rows_zero)

    def _on_hidden_grad(self, mb, grad: torch.Tensor) -> None:
        """Automatic exposure source: fires after the LM-head backward, before any layer's."""
        source = self.runtime.config.exposure_source
        if source == "analytic" or (source == "auto" and mb.coefficients is not None):
            return
        if grad.dim() == 3 and grad.shape[:2] == (mb.batch, mb.seq_len):
            self.apply(mb, exposure.hidden_grad_norms(grad), 0, source="hidden_grad")

    # ------------------------------------------------------------------ backward
    def on_layer_grad(self, mb, frame_ref, last: bool, grad: torch.Tensor | None) -> None:
        """Gradient at a HiLoRe layer's output, before any of the layer's backward runs (None
        below a microbatch whose layers' backward is skipped: NOTE [ A backward of zeros ] in
        zero_backward.py)."""
        if last:
            self.late.reseed(mb)  # NOTE [ A microbatch of its own ] in agreement.py
            self._on_hidden_grad(mb, grad)
            if mb.source is None:  # no coefficients came: nothing proves the capture's elisions
                unverified_rows_to_r(self.runtime, mb.live_frames(), lambda frame: set(), mb)
            self._check_at_top(mb, grad)
            mb.skip_layers_backward = self._skips_layers(mb)
            if not mb.skip_layers_backward:
                self._no_stand_ins(mb)
            if self.runtime.policy is not None:
                self.runtime.policy.top_grad(mb, grad)
            if mb.top_frame is not None:  # NOTE [ A layer that keeps everything ] (calling.py)
                mb.top_frame = None
                mb.settle()  # where its first unpack would: the same point on every rank
            return
        if mb.last_layer != self.runtime._last_active and not mb.stopped_short:
            mb.stopped_short = True  # the first layer-output gradient of its backward
            self._stopped_short(mb)
        frame = frame_ref()
        if frame is None or grad is None or grad.dim() < 2:
            return
        rows = sorted(frame.elided_rows)
        if frame.check_every_layer and frame.elision_checked:
            # transformers records hidden states: read it here, one decision for all ranks
            # (elision_checked is the same on every rank, the rows elided are this rank's), or
            # this rank's where its plan is its own (``local_checks``)
            leak = bool(rows) and bool(_reaches(_at(grad.detach(), frame, rows)))
            if self._decide(leak, collective=not mb.local_checks):
                self._fall_back([frame])
        elif rows:  # a leak here is an error before the next step, on any rank (late.py)
            mb.late_leaks.append(_reaches(_at(grad.detach(), frame, rows)))

    def _check_at_top(self, mb, grad: torch.Tensor) -> None:
        frames = [f for f in mb.live_frames() if f.elision_checked]
        # checks of this rank's own (NOTE [ A steady step agrees nothing before its forwards ]
        # in plan/steady.py): which frames are checked follows this rank's plan, so the late
        # read that the coefficients' all-reduce made due is left on every rank whatever the
        # check here found
        local = mb.local_checks
        if not frames or grad.dim() < 2:
            if mb.rows_due or (local and mb.late_due):  # a split's merges leave flags (NOTE
                # [ Kept rows only ] in rows.py)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self.late.defer(mb))
            return
        rows = sorted(set().union(*(f.elided_rows for f in frames)))
        packed = next((f for f in frames if f.segments is not None), frames[0])
        leak = _reaches(_at(grad.detach(), packed, rows)) if rows else None  # () bool
        if mb.settled:
            leaks = self._decide(leak is not None and bool(leak), collective=not local)
        else:  # read and agreed on with the checks left: NOTE [ One sync at the top of the
            leaks = self._decide(mb.settle(leak, at_top=True), collective=False)  # backward ] in microbatch.py
        if leaks:
            self._fall_back(frames)
        if mb.late_due and (local or not leaks):  # the same on every rank (NOTE [ A late
            # read, due on every rank ])
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.late.defer(mb))

    def _stopped_short(self, mb) -> None:
        """A forward that stopped before the last HiLoRe layer (an early exit, a model cut for
        one call) has no check at the top (``_check_at_top``), so nothing it elided -- rows
        elided at capture (``expect``) or from ω -- is verified, and no late flag is read:
        every frame holding an elided sequence recomputes it instead, before any layer's
        backward reads a stand-in. The same on every rank: under several ranks one all-reduce
        decides, and then every frame that keeps anything recomputes (plans are the same on
        every rank; the sequences elided are each rank's own)."""
        self.stopped_short += 1
        frames = mb.live_frames()
        elided = [f for f in frames if f.elided_rows or f.skip_zero_recompute or any(
            rows is not None and "E" in rows for rows in f.plan.rows)]
        collective = self.runtime.collective
        if collective is not None and not mb.local_checks:
            if collective.all_reduce_max([int(bool(elided))])[0] == 0:
                return
            elided = [f for f in frames if any(a != "R" for a in f.plan.actions)]
        self._fall_back(elided)

    def _skips_layers(self, mb) -> bool:
        """Whether the gradient at the last layer's output is known to be exactly zero on every
        rank (NOTE [ A backward of zeros ] in zero_backward.py): every sequence elided by the
        loss's own ω, on every rank, and the read at the top found none of it reached them (else
        the frames fell back and no longer skip). Never for a measured microbatch (profile,
        leave-one-out timing), nor for one whose forward did not gate the last layer's output.
        Only values the ranks agreed on: a sequence count (rows, or the segments of a packed
        row) is this rank's."""
        if not (self.runtime.zero_backward_skip and mb.gated) or mb.profile is not None or \
                mb.timing is not None:
            return False
        frames = mb.live_frames()
        return bool(frames) and all(f.skip_zero_recompute and f.elision_checked for f in frames)

    def _may_skip(self, mb, source: str) -> bool:
        """Whether a microbatch whose every sequence is zero will skip its layers' backward
        (``_skips_layers``), as far as is known before the backward; the same on every rank."""
        return self.runtime.zero_backward_skip and mb.gated and source == "analytic" and \
            mb.profile is None and mb.timing is None

    def _no_stand_ins(self, mb) -> None:
        """Where only whole microbatches are elided (NOTE [ Stand-ins on accelerators ]), a
        backward that runs reads no stand-in: a frame still holding elided sequences (a case
        ``_may_skip`` did not foresee) recomputes them. The same on every rank: elision there
        was agreed on by all."""
        frames = [f for f in mb.live_frames() if f.elided_rows or f.skip_zero_recompute]
        if frames and self.runtime.elision_mode(frames[0].device) == "whole":
            self._fall_back(frames)

    def _decide(self, leaks: bool, collective: bool) -> bool:
        if collective and self.runtime.collective is not None:  # one decision for all ranks
            leaks = self.runtime.collective.all_reduce_max([int(leaks)])[0] > 0
        if leaks and not self._warned:
            logger.warning("ds_hilore: sequences with zero loss coefficients get gradient from other "
                           "loss terms; their layers are recomputed instead (exact, slower). Hand "
                           "the full loss's coefficients, or set exposure_source to 'hidden_grad'.")
            self._warned = True
        return leaks

    @staticmethod
    def _fall_back(frames) -> None:
        for frame in frames:
            frame.elided_rows = set()
            frame.skip_zero_recompute = False
            for pos, action in enumerate(frame.plan.actions):
                if action != "R":
                    frame.downgrade(pos, "R")

    # ------------------------------------------------------------------ late flags
    def flush_late(self) -> None:
        """Read the late flags now, where a read is due; raises on every rank if one is set on
        any (NOTE [ A late read, due on every rank ] in late.py)."""
        self.late.flush()


def _unit_exposure(frames, abs_omega: torch.Tensor, cols: int, offset, segments) -> dict:
    """E_{u,i} on the device of every unit with token norms (those kept H/L, and every unit of
    a microbatch that keeps them all: ``Microbatch.norms_all``): unit name -> (B,), or (K,) per
    segment of a packed row for the calls that have the microbatch's segments."""
    covered = exposure.window(abs_omega, cols, offset)
    out = {}
    for frame in frames:
        for pos, unit in enumerate(frame.layer.units):
            norms = frame.units[pos].token_norms
            if norms is None or norms.shape != abs_omega.shape:
                continue
            weights = exposure.token_weights(norms, covered)
            out[unit.name] = (exposure.segment_exposure(abs_omega, weights, segments)
                              if segments is not None and frame.segments == segments
                              else exposure.slice_exposure(abs_omega, weights))
    return out


def trailing(zero: list[int], count: int) -> list[int]:
    """The zero segments after the last non-zero one (nothing later reads them)."""
    zero_set, start = set(zero), count
    while start > 0 and start - 1 in zero_set:
        start -= 1
    return list(range(start, count))


def _reaches(grad: torch.Tensor) -> torch.Tensor:
    """() bool on the device: any gradient at all, NaN and inf included (``abs().amax() > 0``
    is False for NaN, and let it pass into the parameters' gradients)."""
    return grad.ne(0).any()


def _at(grad: torch.Tensor, frame, rows: list[int]) -> torch.Tensor:
    """The gradient at sequences ``rows`` of the frame's call: rows of the batch, or the token
    ranges of a packed row's segments (the whole gradient when its layout does not show them:
    any gradient then counts as reaching them)."""
    if frame.segments is None:
        return grad[rows]
    if grad.dim() < 2 or grad.shape[0] != 1 or grad.shape[1] != frame.seq_len:
        return grad
    tokens = [t for i in rows for t in range(*frame.segments[i])]
    return grad[:, tokens]


def gradient_entry(out) -> tuple[bool, bool]:
    """(elision allowed, check at every layer) for a layer call (NOTE [ Checked elision ]).

    Elision is off when the layer returns more than one tensor that requires grad (a loss on
    attention weights) or when transformers records internal outputs (router logits for an MoE
    auxiliary loss, attentions): gradient would enter where no check sees it. When it records
    hidden states, a loss may use any layer's output: every layer checks.
    """
    if sum(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_flatten(out)[0]) > 1:
        return False, False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return True, False
    collected = _active_collector.get() or {}
    internal = any(key != "hidden_states" and not key.startswith("_") for key in collected)
    return not internal, "hidden_states" in collected
