"""A microbatch whose loss coefficients are all zero skips its layers' backward: the gate at the
last layer's output (NOTE [ A backward of zeros ]). The decision to skip is the elision's
(``Elision._skips_layers`` in elision.py); the gate carries it out."""

from __future__ import annotations

import weakref

import torch

__all__ = ["TopGate", "gate"]


# NOTE [ A backward of zeros ]
# A microbatch whose loss coefficients are exactly zero for every sequence of a rank (all its
# groups without reward spread, no KL term) sends exactly zero gradient into the last layer's
# output, and from there zero into every parameter below: the layers' backward would multiply
# zeros. Its last layer's output passes through ``TopGate`` (an identity); once the read at
# the top of the backward has shown the gradient there zero (NOTE [ Checked elision ]), the
# gate hands the layers no gradient at all, which autograd's formulas skip without
# computing: the backward of the layers costs nothing, and their recompute is skipped
# already (NOTE [ Exact zeros ] in storage.py).
# A parameter that would have received that zero gets it still, through autograd itself:
# the gate takes every trainable parameter of the model as an input, so each parameter's
# gradient accumulator has an edge from it, and a skipping gate hands zeros there to those
# the layers below would have reached (None to the others, and to all of them when it does
# not skip: nothing changes then). An accumulator runs once all its edges have delivered,
# and the gate, made after the layers, runs before any layer's backward: so each parameter's
# gradient is accumulated -- and the hooks on it fire -- when the layer that uses it has run
# its (now empty) backward, at the point of the backward where it would have been, in the
# order of every other backward of the same graph. That order is what ZeRO 1-2 need: their
# hooks copy each gradient into a bucket as it arrives and reduce full buckets and the rest
# at the backward's end, pairing bucket positions across ranks, so a rank that skips makes
# the same reductions of the same parameters, with zeros, while the others run their
# backward: the decision is each rank's own there (ZeRO 0-2: ``matched_calls`` false). An
# optimizer steps a parameter with a zero gradient (momentum, weight decay) and skips one
# without: with the zeros, the step is the one without the skip, bitwise.
# ZeRO-3 gathers each module's parameters in hooks on its backward and reduce-scatters its
# gradients from them: a rank that skips would leave the others waiting in those gathers,
# and every rank skipping would leave its partitioned gradients unmade. The skip is off there
# (said once, engine.py), as under DDP and FSDP and ``attach`` under several ranks (where the
# model inside a wrapper may be the one attached to); a prediction handed before the forward
# still runs a zero microbatch's layers over one row (NOTE [ Kept rows only ] in rows.py).
# Gradient entering lower down (a loss on an intermediate hidden state) is not gated and still
# flows. A backward that does not accumulate into every such parameter
# (``torch.autograd.grad``, ``backward(inputs=...)``) is not skipped: the gate then recomputes
# the frames and the layers' backward runs, so what it returns (zeros, an input's gradient) is
# autograd's own. Never on profiled or timed microbatches, whose backward is being measured.
class TopGate(torch.autograd.Function):
    """Identity at the last layer's output; no gradient below it when the microbatch skips,
    zeros to the parameters below instead."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, mb, *params) -> torch.Tensor:
        ctx.mb = weakref.ref(mb)
        ctx.params = params
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mb, params = ctx.mb(), ctx.params
        none = (None,) * len(params)
        if mb is None or not getattr(mb, "skip_layers_backward", False):
            return (grad, None, *none)
        node = ctx.saved_node
        ctx.saved_node = None
        below = _accumulators(node)
        if not _accumulates(below):  # the zeros would not reach .grad: the backward runs
            from ds_hilore.runtime.elision import Elision

            mb.skip_layers_backward = False
            Elision._fall_back(mb.live_frames())  # no stand-in read, no recompute skipped
            return (grad, None, *none)
        mb.summary["backward_skipped"] = True
        if not mb.predicted_zero:  # NOTE [ A layer that keeps nothing ] in calling.py
            mb.runtime._skipped_at = mb.index
        reached = {id(fn.variable) for fn in below}
        zeros = tuple(torch.zeros_like(p) if id(p) in reached else None for p in params)
        return (None, None, *zeros)


def gate(hidden: torch.Tensor, mb, params) -> torch.Tensor:
    """``hidden`` through ``TopGate`` (NOTE [ A backward of zeros ]); ``params``: the model's
    trainable parameters."""
    node = hidden.grad_fn
    out = TopGate.apply(hidden, mb, *params)
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
