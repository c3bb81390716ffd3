"""Which runtime a model, or a log-prob, belongs to; where the GRPO losses' ω goes.

The runtimes attached now are kept weakly. A ``ds_hilore.grpo`` loss publishes its loss
coefficients (``grpo.handoff``) without naming a runtime: they go to the one of the model it
was given, else the only one attached, else the one whose live forward the log-probs came from
(an actor and a critic both attached).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ds_hilore.grpo import handoff

ATTACHED: "weakref.WeakSet" = weakref.WeakSet()  # HiLoReRuntime, while attached
_MAX_GRAPH_WALK = 10_000  # autograd nodes visited to find which forward log-probs came from
# model -> (weak reference to its runtime or None, shared), cleared whenever a runtime attaches
# or detaches: the runtime held weakly, as it holds the model (a strong one would keep both
# alive for good)
_OF_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register(runtime) -> None:
    """``runtime`` attached: found from now on."""
    ATTACHED.add(runtime)
    _OF_MODEL.clear()  # every answer kept is stale now


def unregister(runtime) -> None:
    """``runtime`` detached."""
    ATTACHED.discard(runtime)
    _OF_MODEL.clear()


def sharing(model: nn.Module) -> list:
    """The runtimes attached now whose model is ``model``, contains it, or is inside it."""
    return [rt for rt in list(ATTACHED) if rt.attached and (
        rt.model is model or any(m is model for m in rt.model.modules())
        or any(m is rt.model for m in model.modules()))]


def find_runtime(model: nn.Module | None = None):
    """The runtime attached to ``model``, to a module containing it, or to the one module inside
    it that has one (a DeepSpeed engine, a wrapper: its ``module``); without ``model``, the only
    one attached."""
    live = [rt for rt in list(ATTACHED) if rt.attached]
    if model is not None:  # the runtime of ``model`` itself first: no walk over other models
        found = (next((rt for rt in live if rt.model is model), None)
                 or next((rt for rt in live if any(m is model for m in rt.model.modules())), None))
        if found is None:
            inside = [rt for rt in live if any(m is rt.model for m in model.modules())]
            found = inside[0] if len(inside) == 1 else None
        return found
    return live[0] if len(live) == 1 else None


# NOTE [ The last layer's output, marked ]
# A loss's coefficients go to the forward its log-probabilities come from: the walk back from
# them reaches that forward's last layer output. That output's grad_fn names the forward, but
# not by its ``id``: the Python object of an autograd node is made when asked for and freed when
# no longer held, and a forward whose loss was dropped without a backward (a retry after
# running out of memory, a metric) stays among the live microbatches until the collector frees
# it -- an ``id`` taken at its forward could name a node of the next graph, and the next loss's
# coefficients went to the dead forward, on some ranks and not others (one rank raised, the
# other waited in its backward). So the node itself is marked, in its ``metadata`` (kept with
# the node, whatever Python object stands for it, and gone with it), with the microbatch's
# process-wide ``epoch``, and the walk reads the marks of the nodes it passes.
LAST_HIDDEN = "ds_hilore.microbatch"


def mark_last_hidden(mb, hidden: torch.Tensor) -> None:
    """``hidden``, the last layer's output of ``mb``'s forward, names that forward to
    ``first_reached`` (NOTE [ The last layer's output, marked ])."""
    if hidden.grad_fn is not None:  # a leaf (a layer passing its input through) names nothing
        hidden.grad_fn.metadata[LAST_HIDDEN] = mb.epoch
        mb.last_hidden_marked = True


def reached_by(mbs, value=lambda mb: mb) -> dict:
    """``first_reached``'s ``wanted`` for the microbatches ``mbs`` whose last layer output is
    marked: ``value(mb)`` for each, by its mark."""
    return {mb.epoch: value(mb) for mb in mbs if mb.last_hidden_marked}


def first_reached(logp: torch.Tensor, wanted: dict):
    """The value of ``wanted`` (``reached_by``: a mark -> value) whose marked node the autograd
    graph of ``logp`` reaches first, walking back at most ``_MAX_GRAPH_WALK`` nodes (the LM head
    is a few nodes above the last layer's output) and not below a forward's marked output that
    is not wanted (the layers of that forward); None when none is reached."""
    seen, todo = set(), [logp.grad_fn] if logp.grad_fn is not None else []
    while todo and len(seen) < _MAX_GRAPH_WALK:
        node = todo.pop()
        mark = node.metadata.get(LAST_HIDDEN)
        if mark in wanted:
            return wanted[mark]
        if mark is None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions if n is not None)
    return None


def _runtime_of(logp: torch.Tensor):
    """The attached runtime with a live microbatch whose last layer output ``logp`` comes from."""
    wanted = {}
    for rt in list(ATTACHED):
        if rt.attached:
            wanted.update(reached_by([mb for mb in list(rt._live_mbs) if mb.live_frames()],
                                     lambda _, rt=rt: rt))
    return first_reached(logp, wanted)


# NOTE [ Whose loss, once per model ]
# Every microbatch's loss names its model; which runtime that is (its own, one around it or one
# inside it), and whether any runtime shares modules with it, takes walks over the modules of
# the model and of every runtime attached: thousands of modules, a few ms on a small LoRA model
# where several runtimes are attached (the bench's engines side by side), paid by a model
# trained without HiLoRe as much as by one with it. The answer is kept per model until a
# runtime attaches or detaches; a model whose modules are rearranged between two such events
# (not something a training loop does) would be answered as it was arranged before.
def _of_model(model: nn.Module) -> tuple:
    """(``find_runtime(model)``, whether any runtime shares modules with ``model``), kept
    (NOTE [ Whose loss, once per model ])."""
    kept = _OF_MODEL.get(model)
    if kept is not None:
        ref, shared = kept
        runtime = None if ref is None else ref()
        if ref is None or runtime is not None:
            return runtime, shared
    runtime = find_runtime(model)
    shared = runtime is not None or bool(sharing(model))
    _OF_MODEL[model] = (None if runtime is None else weakref.ref(runtime), shared)
    return runtime, shared


def _receive_coefficients(coefficients: torch.Tensor, logp: torch.Tensor, model: nn.Module | None) -> None:
    """ω published by a ``ds_hilore.grpo`` loss goes to the runtime of the model it came from:
    ``model``'s (none where ``model`` has no runtime: a model trained without HiLoRe beside
    one with it), else the only one attached, else the one whose live forward ``logp`` was
    computed from (an actor and a critic both attached, no ``model=`` given)."""
    if model is None:
        runtime, shared = find_runtime(None), True
    else:
        runtime, shared = _of_model(model)
    if runtime is None and shared:  # where logp came from
        runtime = _runtime_of(logp)
    if runtime is not None and runtime.enabled:
        runtime.set_coefficients(coefficients, logp=logp)


handoff.subscribe(_receive_coefficients)
