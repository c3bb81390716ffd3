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
collected on the device at every layer and read once when the backward ends: an error, before
the optimizer can step on a wrong gradient.
"""

from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_flatten

from ds_hilore._errors import HiLoReError
from ds_hilore.grpo import exposure

logger = logging.getLogger("ds_hilore")


class Elision:
    """The exposure / elision plumbing of a ``HiLoReRuntime`` (NOTE [ Checked elision ])."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._warned = False

    # ------------------------------------------------------------------ coefficients known
    def apply(self, mb, coefficients: torch.Tensor, offset, source: str) -> None:
        """Exposure per unit and sequence, and elision of the sequences whose ω is zero."""
        frames = mb.live_frames()
        if not frames:
            return
        collective = self.runtime.collective
        abs_omega = exposure.align(coefficients, frames[0].seq_len, offset)  # (B, T)
        segments = mb.segments if abs_omega.shape[0] == 1 else None  # NOTE [ Packed sequences ]
        if segments is not None:
            zero = exposure.zero_segments(abs_omega, segments)
            every = len(segments)
            if len(zero) < every and not all(f.segments_independent for f in frames):
                zero = _trailing(zero, every)  # segments see earlier ones: only a zero tail
        else:
            zero = exposure.zero_rows(abs_omega)
            every = abs_omega.shape[0]
        all_zero = len(zero) == every and all(f.elision_ok for f in frames)
        policy = self.runtime.policy  # NOTE [ Exact zeros ]: copies only where memory is short
        keep = 0 < len(zero) < every and policy is not None and policy.keeps_whole(mb)
        mb.source, mb.zero_rows, mb.token_weights = source, zero, abs_omega
        # NOTE [ Collective elision ]: one all-reduce decides, for every rank, whether all
        # sequences are zero and which units saw a capture-time elision disproved
        all_zero, to_r = _agree(self.runtime, frames, all_zero, lambda frame, every_zero: _verified(
            frame, every_zero, zero, segments, source))
        for frame in frames:
            frame.skip_zero_recompute = all_zero and source == "analytic"
            # the same on every rank (plans are synced): whether the backward checks, and so
            # whether it takes part in the collective decision there
            frame.elision_checked = frame.elision_ok and (
                frame.skip_zero_recompute or any(a != "R" for a in frame.plan.actions))
            _to_r(frame, to_r)
            if frame.segments != segments:  # a call without the microbatch's segments
                frame.elision_checked = frame.elision_checked and all_zero and frame.sequences == 1
                frame.elided_rows = {0} if frame.elision_checked else set()
                rows_zero = sorted(frame.elided_rows)
            else:
                # checked as elided even when kept in place: rows elided at capture (``expect``)
                # are among them, and the check must cover every row that may be
                frame.elided_rows = set(zero) if frame.elision_checked else set()
                rows_zero = [] if keep else zero
            for pos, unit in enumerate(frame.layer.units):
                if frame.plan.actions[pos] == "R":
                    continue
                if rows_zero and frame.elision_checked:
                    frame.downgrade(pos, "E", rows_zero)
                norms = frame.units[pos].token_norms
                if norms is not None and norms.shape == abs_omega.shape:
                    covered = exposure.window(abs_omega, coefficients.shape[1], offset)
                    weights = exposure.token_weights(norms, covered)
                    mb.exposure[unit.name] = (
                        exposure.segment_exposure(abs_omega, weights, segments)
                        if segments is not None and frame.segments == segments
                        else exposure.slice_exposure(abs_omega, weights))
        if self.runtime.policy is not None:  # the allocator spends the risk budget now
            self.runtime.policy.after_coefficients(mb)
        self.runtime._summarise(mb)

    def _on_hidden_grad(self, mb, grad: torch.Tensor) -> None:
        """Automatic exposure source: fires after the LM-head backward, before any layer's."""
        source = self.runtime.config.exposure_source
        if source == "analytic" or (source == "auto" and mb.coefficients is not None):
            return
        if grad.dim() == 3 and grad.shape[:2] == (mb.batch, mb.seq_len):
            self.apply(mb, exposure.hidden_grad_norms(grad), 0, source="hidden_grad")

    # ------------------------------------------------------------------ backward
    def on_layer_grad(self, mb, frame_ref, last: bool, grad: torch.Tensor) -> None:
        """Gradient at a HiLoRe layer's output, before any of the layer's backward runs."""
        if last:
            self._on_hidden_grad(mb, grad)
            self._check_at_top(mb, grad)
            if self.runtime.policy is not None:
                self.runtime.policy.top_grad(mb, grad)
            return
        frame = frame_ref()
        if frame is None or grad.dim() < 2:
            return
        rows = sorted(frame.elided_rows)
        if frame.check_every_layer and frame.elision_checked:
            # transformers records hidden states: read it here, one decision for all ranks
            # (elision_checked is the same on every rank, the rows elided are this rank's)
            leak = bool(rows) and bool(_at(grad.detach(), frame, rows).abs().amax() > 0)
            if self._decide(leak, collective=True):
                self._fall_back([frame])
        elif rows:  # a leak here is an error at the end of the backward, on any rank
            mb.late_leaks.append(_at(grad.detach(), frame, rows).abs().amax() > 0)

    def _check_at_top(self, mb, grad: torch.Tensor) -> None:
        frames = [f for f in mb.live_frames() if f.elision_checked]
        if not frames or grad.dim() < 2:
            return
        rows = sorted(set().union(*(f.elided_rows for f in frames)))
        packed = next((f for f in frames if f.segments is not None), frames[0])
        leak = _at(grad.detach(), packed, rows).abs().amax() > 0 if rows else None  # () bool
        if mb.settled:
            leaks = self._decide(leak is not None and bool(leak), collective=True)
        else:  # read and agreed on with the deferred checks: NOTE [ One sync at the top of the
            leaks = self._decide(mb.settle(leak), collective=False)  # backward ] in microbatch.py
        if leaks:
            self._fall_back(frames)
        elif any(f.elided_rows for f in frames):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._late_check(mb))

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

    @staticmethod
    def _late_check(mb) -> None:
        leaks, mb.late_leaks = mb.late_leaks, []
        if leaks and bool(torch.stack(leaks).any()):
            raise HiLoReError(
                "gradient reached sequences whose loss coefficients are zero through an "
                "intermediate layer's hidden state (a loss on it that transformers did not "
                "record); their activations had been elided, so this backward's gradients are "
                "wrong and the step must not be taken. Compute that loss from "
                "output_hidden_states=True, or hand ds_hilore the coefficients of the whole loss.")


def _trailing(zero: list[int], count: int) -> list[int]:
    """The zero segments after the last non-zero one (nothing later reads them)."""
    zero_set, start = set(zero), count
    while start > 0 and start - 1 in zero_set:
        start -= 1
    return list(range(start, count))


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


def unverified_rows_to_r(runtime, frames, zero_of) -> None:
    """Sequences a plan elided at capture (predicted to have zero coefficients) that do not:
    their units are recomputed instead (exact: the layer's inputs are kept). ``zero_of(frame)``
    is the set of the frame's sequences shown to be zero. A collective under several ranks
    (NOTE [ Collective elision ]): every rank calls it at the same point."""
    flags = _unverified(runtime, frames, zero_of)
    if runtime.collective is not None:
        flags = runtime.collective.all_reduce_max(flags)
    names = _flagged(runtime, flags)
    for frame in frames:
        _to_r(frame, names)


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
# frames called without the microbatch's segments elide depending on that answer), so one
# all-reduce per microbatch decides everything.
def _agree(runtime, frames, all_zero: bool, verified) -> tuple[bool, set[str]]:
    """(every rank's sequences all zero, names of the units to recompute on every rank)."""
    if_all = _unverified(runtime, frames, lambda f: verified(f, True))
    if_not = _unverified(runtime, frames, lambda f: verified(f, False))
    if runtime.collective is not None:
        agreed = runtime.collective.all_reduce_max([0 if all_zero else 1, *if_all, *if_not])
        all_zero, n = agreed[0] == 0, len(if_all)
        if_all, if_not = agreed[1:1 + n], agreed[1 + n:]
    return all_zero, _flagged(runtime, if_all if all_zero else if_not)


def _verified(frame, every_zero: bool, zero: list[int], segments, source: str) -> set[int]:
    """The sequences ``frame`` may elide: the zero ones of the microbatch; for a call without
    the microbatch's segments, its one row when every sequence (of every rank) is zero."""
    if frame.segments == segments:
        return set(zero) if frame.elision_ok else set()
    checked = frame.elision_ok and every_zero and frame.sequences == 1 and (
        source == "analytic" or any(a != "R" for a in frame.plan.actions))
    return {0} if checked else set()


def _unverified(runtime, frames, zero_of) -> list[int]:
    """One flag per unit of the model (unit order): a frame elided at capture a sequence
    ``zero_of(frame)`` does not contain."""
    index = {unit.name: k for k, unit in enumerate(runtime.units)}
    flags = [0] * len(index)
    for frame in frames:
        zero = zero_of(frame)
        for pos, rows in enumerate(frame.plan.rows):
            if rows is None or frame.plan.actions[pos] == "R":
                continue
            if any(a == "E" and i not in zero for i, a in enumerate(rows)):
                flags[index[frame.layer.units[pos].name]] = 1
    return flags


def _flagged(runtime, flags: list[int]) -> set[str]:
    return {unit.name for unit, flag in zip(runtime.units, flags) if flag}


def _to_r(frame, names: set[str]) -> None:
    """Recompute the frame's units named in ``names``."""
    for pos, unit in enumerate(frame.layer.units):
        if unit.name in names and frame.plan.actions[pos] != "R":
            frame.downgrade(pos, "R")


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
