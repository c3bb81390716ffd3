"""A microbatch whose loss coefficients are all zero skips its layers' backward: the gate at the
last layer's output (NOTE [ A backward of zeros ]). The decision to skip is the elision's
(``Elision._skips_layers`` in elision.py); the gate carries it out."""

from __future__ import annotations

import weakref

import torch

__all__ = ["TopGate", "gate"]


# NOTE [ A backward of zeros ]
# A microbatch whose loss coefficients are exactly zero for every sequence on every rank (all
# its groups without reward spread, no KL term) sends exactly zero gradient into the last
# layer's output, and from there zero into every parameter below: the layers' backward would
# multiply zeros. Its last layer's output passes through ``TopGate`` (an identity); once the
# read at the top of the backward has shown the gradient there zero (NOTE [ Checked elision ]),
# the gate hands the layers no gradient at all, which autograd's formulas skip without
# computing: the backward of the layers costs nothing, and their recompute is skipped already
# (NOTE [ Exact zeros ] in storage.py). It is the same decision on every rank (ω zero on every
# rank, the read agreed over ranks), so collectives stay matched. A parameter that would have
# received that zero gets it still: where its ``.grad`` is None the gate sets zeros (an
# optimizer skips a parameter without a gradient, but steps one with a zero gradient:
# momentum, weight decay), so the step is the one without the skip, bitwise. Gradient
# entering lower down (a loss on an intermediate hidden state) is not gated and still flows.
# A backward that does not accumulate into every such parameter (``torch.autograd.grad``,
# ``backward(inputs=...)``) is not skipped: the gate then recomputes the frames and the
# layers' backward runs, so what it returns (zeros, an input's gradient) is autograd's own.
# Off under ZeRO stages 1-3, whose gradient hooks partition and reduce every gradient as it
# is made (``zero_backward_skip``, set by the engine integration), and so under DDP and FSDP
# (their hooks, too, would never see those gradients): off for ``attach`` under several ranks
# (where the model inside a wrapper may be the one attached to) or with such a wrapper in the
# model; never on profiled or timed microbatches, whose backward is being measured.
class TopGate(torch.autograd.Function):
    """Identity at the last layer's output; no gradient below it when the microbatch skips."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, mb) -> torch.Tensor:
        ctx.mb = weakref.ref(mb)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mb = ctx.mb()
        if mb is None or not getattr(mb, "skip_layers_backward", False):
            return grad, None
        node = ctx.saved_node
        ctx.saved_node = None
        below = _accumulators(node)
        if not _accumulates(below):  # the zeros would not reach .grad: the backward runs
            from ds_hilore.runtime.elision import Elision

            mb.skip_layers_backward = False
            Elision._fall_back(mb.live_frames())  # no stand-in read, no recompute skipped
            return grad, None
        mb.summary["backward_skipped"] = True
        for fn in below:
            p = fn.variable
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return None, None


def gate(hidden: torch.Tensor, mb) -> torch.Tensor:
    """``hidden`` through ``TopGate`` (NOTE [ A backward of zeros ])."""
    node = hidden.grad_fn
    out = TopGate.apply(hidden, mb)
    out.grad_fn.saved_node = node  # where the walk for the parameters below begins
    return out


def _accumulators(node) -> list:
    """The nodes that accumulate into leaves (parameters) in the graph below ``node``."""
    found, seen, stack = [], set(), [node]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if getattr(fn, "variable", None) is not None:
            found.append(fn)
            continue
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def _accumulates(accumulators: list) -> bool:
    """Whether the backward running now accumulates into every one of these leaves, as
    ``.backward()`` does: not ``torch.autograd.grad`` (which returns gradients and touches no
    ``.grad``; the engine refuses the question then), nor ``backward(inputs=...)`` leaving some
    out. Only then may a skip stand for the zeros it would have written (NOTE [ A backward of
    zeros ])."""
    try:
        return all(torch._C._will_engine_execute_node(fn) for fn in accumulators)
    except RuntimeError:  # "... currently running autograd.grad()"
        return False
