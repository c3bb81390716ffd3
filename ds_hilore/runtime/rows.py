"""Kept rows only: a microbatch's layers run with autograd over the sequences its prediction
keeps, and without autograd over those it predicts zero (NOTE [ Kept rows only ]).

NOTE [ Kept rows only ]
A sequence whose loss coefficients ω are exactly zero gets exactly zero gradient everywhere
(causal attention never mixes the rows of a batch), yet run with the others its layers'
recompute and backward compute those zeros. When the prediction handed to ``expect`` says
which sequences are zero (|A_i| x tokens with beta = 0), every decoder layer is called twice:

* the rows predicted zero under ``torch.no_grad()``: their outputs, exact, for the loss and
  the next layer; nothing is saved for them and no graph is built;
* the kept rows through the layer's frame, under the plan (H / L / R), as a microbatch of
  those rows alone: the layer's recompute and backward cost the kept rows only, and the
  plan is re-solved for them, spending what the zero rows leave (NOTE [ Freed memory is
  spent ] in plan/scheduler.py).

The two outputs are put back in the batch's order (``merge``); the next layer splits again.
Every argument of the call with a batch dimension (dim 0 of a tensor of two or more
dimensions equal to B: hidden states, masks, position ids and embeddings) is split with the
rows; a (T, ...) table is never split, and a microbatch with B == T, where the two cannot be
told apart, is not split at all. Packed rows (several sequences per row) are rows: a row is
kept if any of its sequences is, so its prediction is the sum of its sequences'.

Exact. The rows of a GEMM, a norm or an attention over a batch do not depend on the other
rows (bitwise on CPU fp32), so the outputs are those of the layer over the whole batch, and
so are the loss, the logits and every gradient outside the decoder layers (the layers' input
gradients are exact row by row). The layers' weight gradients sum over the kept rows only:
bitwise those of the same model run on the kept rows alone, in their order (what a trainer
that drops the zero sequences computes), and within fp32 rounding of the whole batch's, whose
blocked reductions add the zero rows' exact zeros between the others' and round the partial
sums elsewhere. Measured on a 2-core AMD EPYC (fp32, SDPA, hidden 256, MLP 1024, 8 sequences
of 256 tokens, 4 of them zero, H and R alike): 14 of the 24 decoder-layer gradient tensors
differ from the whole batch's, by at most 4.8e-7 of the tensor's largest value; at the tests'
width (hidden 64) none does. Where the layers draw random numbers (dropout in
training mode) the masks would differ from the whole batch's, and where a layer returns more
than its hidden states with a gradient (router logits, attentions), the zero rows could get
gradient no check sees: the layers are known safe from their first call (``row_safe``), and
until all are, nothing is split (said once when a layer draws).

A wrong prediction never becomes a silent gradient. The mass of ω on the rows predicted
zero is read with the coefficients' one read and agreed over ranks in the elision's
all-reduce (elision.py): non-zero on any rank raises on every rank, before the backward.
Gradient that reaches them from a term ω does not see (an entropy bonus), or from a loss on
an intermediate hidden state, is flagged on the device at every layer's merge and read with
the late flags (late.py): an error on every rank before any optimizer step.

Under several ranks whose module calls must match (ZeRO-3 gathers each module's parameters
in its forward hooks, FSDP too: ``HiLoReRuntime.matched_calls``), every rank splits when any
does (agreed before the forward): a rank with no row predicted zero runs one of its rows
through the no-grad call as well (a probe, its output unused), and a rank whose every row is
zero keeps one of them with autograd (its gradient exactly zero): both calls, with and
without autograd, on every rank. Elsewhere a rank with no zero row does not split, and one
whose every row is zero keeps one row, so that its layers' parameters still receive their
(zero) gradients through the hooks that reduce them, in the order of every other backward.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["RowSplit", "merge", "plan_split", "select"]


class RowSplit:
    """How a microbatch's rows are called: ``kept`` with autograd, ``zero`` without (both in
    batch order), ``probe`` a kept row run without autograd as well where no row is zero
    and the ranks' module calls must match (NOTE [ Kept rows only ])."""

    __slots__ = ("batch", "kept", "zero", "probe", "predicted_zero", "_index")

    def __init__(self, batch: int, kept: list[int], zero: list[int], probe: list[int],
                 predicted_zero: list[int]):
        self.batch, self.kept, self.zero, self.probe = batch, list(kept), list(zero), list(probe)
        self.predicted_zero = list(predicted_zero)  # kept too where one row keeps the graph
        self._index: dict = {}

    def index(self, which: str, device) -> torch.Tensor:
        """``kept``, ``zero`` or ``probe`` as an index tensor on ``device`` (made once)."""
        key = (which, str(device))
        if key not in self._index:
            self._index[key] = torch.tensor(getattr(self, which), dtype=torch.long, device=device)
        return self._index[key]

    @property
    def uncalled(self) -> list[int]:
        """The rows called without autograd: the zero ones, else the probe."""
        return self.zero or self.probe


def plan_split(expected: list[float], batch: int, matched: bool) -> RowSplit | None:
    """This rank's split, once the ranks agreed that some rank splits (NOTE [ Kept rows
    only ]); None where this rank runs its rows whole."""
    zero = [i for i, x in enumerate(expected) if x == 0]
    kept = [i for i, x in enumerate(expected) if x != 0]
    if not zero and not matched:
        return None
    predicted_zero = list(zero)
    if not kept:  # one row keeps the graph: its gradient is exactly zero
        kept, zero = zero[:1], zero[1:]
    return RowSplit(batch, kept, zero, [] if zero else kept[:1], predicted_zero)


def splittable(batch: int, seq_len: int) -> bool:
    """Whether a call of ``batch`` rows of ``seq_len`` positions can be split by rows: a
    batch dimension that a (T, ...) argument cannot be mistaken for."""
    return batch >= 2 and batch != seq_len


def select(function, args: tuple, index: torch.Tensor, batch: int):
    """(function, args) of a layer call restricted to the rows ``index``: every tensor of two
    or more dimensions whose dim 0 is ``batch`` is indexed, keyword arguments included."""
    def take(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch:
            return x.index_select(0, index.to(x.device))
        return x

    args = tree_map(take, args)
    if isinstance(function, functools.partial):
        function = functools.partial(function.func, *tree_map(take, function.args),
                                     **tree_map(take, function.keywords))
    return function, args


class _Merge(torch.autograd.Function):
    """The kept rows' and the zero rows' outputs in the batch's order; in the backward the
    kept rows' gradient, and a device flag of any gradient at the zero rows."""

    @staticmethod
    def forward(ctx, kept, zero, kept_index, zero_index, leaks):
        ctx.set_materialize_grads(False)  # a skipped backward below stays skipped
        ctx.kept_index, ctx.zero_index, ctx.leaks = kept_index, zero_index, leaks
        out = kept.new_empty((kept.shape[0] + zero.shape[0], *kept.shape[1:]))
        out.index_copy_(0, kept_index, kept)
        out.index_copy_(0, zero_index, zero.to(kept.dtype))
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        mb = ctx.leaks() if ctx.leaks is not None else None
        if mb is not None:  # read with the late flags (late.py): an error before any step
            mb.late_leaks.append(grad.index_select(0, ctx.zero_index).ne(0).any())
        return grad.index_select(0, ctx.kept_index), None, None, None, None


class NotMergeable(Exception):
    """A layer's outputs over the two row sets cannot be put back together by rows."""


def merge(kept_out, zero_out, split: RowSplit, mb):
    """The layer's output over the whole batch from its kept rows' (a frame's) and its zero
    rows' (no grad) outputs (NOTE [ Kept rows only ])."""
    kept_leaves, spec = tree_flatten(kept_out)
    zero_leaves, zero_spec = tree_flatten(zero_out)
    if spec != zero_spec:
        raise NotMergeable("the two calls returned different structures")
    out = []
    for k, z in zip(kept_leaves, zero_leaves):
        if not isinstance(k, torch.Tensor):
            out.append(k)
            continue
        if not isinstance(z, torch.Tensor) or k.dim() == 0 or k.shape[0] != len(split.kept) \
                or z.shape[0] != len(split.zero) or k.shape[1:] != z.shape[1:]:
            raise NotMergeable(f"an output of shape {tuple(k.shape)} is not batch-major")
        device = k.device
        leaks = weakref.ref(mb) if k.requires_grad else None
        out.append(_Merge.apply(k, z, split.index("kept", device), split.index("zero", device),
                                leaks))
    return tree_unflatten(out, spec)


def mergeable(out, batch: int) -> bool:
    """Whether a layer's output (over ``batch`` rows) could be put back together by rows:
    tensors batch-major, one of them at most taking gradient."""
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    return bool(leaves) and sum(x.requires_grad for x in leaves) <= 1 and all(
        x.dim() >= 1 and x.shape[0] == batch for x in leaves)


def internal_outputs_recorded() -> bool:
    """Whether transformers records the layers' internal outputs in the forward running now
    (router logits for an MoE auxiliary loss, attentions): gradient could then reach rows
    no merge sees."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collected = _active_collector.get() or {}
    return any(key != "hidden_states" and not key.startswith("_") for key in collected)


def kept_view(coefficients: torch.Tensor, split: RowSplit):
    """(the kept rows' coefficients, |ω| summed over each row run without autograd): the
    microbatch's elision and exposure then see the kept rows as a microbatch of their own,
    and a row predicted zero with coefficients is read with them (NOTE [ Kept rows only ])."""
    device = coefficients.device
    zero = coefficients.index_select(0, split.index("zero", device)) if split.zero else None
    mass = zero.detach().abs().float().sum(dim=1) if zero is not None else None
    return coefficients.index_select(0, split.index("kept", device)), mass


def disproved_error():
    from ds_hilore._errors import HiLoReError

    return HiLoReError(
        "a sequence predicted to have zero loss coefficients has non-zero ones (on this rank or "
        "another): the exposure handed to expect() before its forward said 0 where the loss "
        "is not. Its layers ran without autograd, so no step may use this microbatch's "
        "gradients. Hand expect() zeros only where a coefficient is exactly zero (on-policy, "
        "beta = 0, no entropy bonus: ds_hilore.grpo.exposure.predicted), or do not call it.")
