"""Matched passes under ZeRO-3: a pass gathers parameters through DeepSpeed's own hooks and
leaves DeepSpeed's state as it found it (NOTE [ Matched passes under ZeRO-3 ]).

``MatchedPasses._pass`` (calibrate.py) runs every pass inside ``isolated``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections import UserDict

_PASS_OWNER = -1  # NOTE [ Matched passes under ZeRO-3 ]: no module's ds_id (those count from 0)


# NOTE [ Matched passes under ZeRO-3 ]
# Under ZeRO-3 a parameter is a partition outside its module's forward and backward; DeepSpeed's
# module hooks gather it before and release it after, also inside a pass's forward, its backward
# and HiLoRe's recomputes there. So a pass uses the engine's own gathers: ``autograd.grad``
# returns the full gradient of each parameter (the backward runs while the hooks hold it
# gathered), on every rank, for that rank's microbatch -- what ZeRO-2 passes get. What the pass
# must not change is the state the training step leaves:
# * the coordinator's trace (NOTE [ ZeRO-3's trace and persistent parameters ] in
#   integrations/engine.py): a pass's fetch order is not training's, and the coordinator
#   compares every forward with its trace. While a pass runs, the offload's coordinator is a
#   fresh one (a copy with empty containers and an invalid trace, so it records and never
#   prefetches); training's coordinator, its trace and fetch queue are not touched at all.
# * parameter status: parameters gathered before the pass (persistent ones, or any the script
#   gathered) are marked owned by a module id no module has, so no hook releases them; the others
#   are released by the hooks after their forward and backward, and any left gathered (a module
#   whose post-backward hook never fired: the backward stops at the decoder's parameters) are
#   partitioned after; each parameter's ``ds_active_sub_modules`` and each module's backward
#   counters are then set back to what they were.
# * gradients: ``autograd.grad`` runs no post-accumulate-grad hook, so DeepSpeed's reduction
#   and its gradient partitions, and ``.grad``, are untouched.
# Every rank runs the same passes with the same plans, so its gathers pair up. A model attached
# to ZeRO-3 parameters without the engine integration (no offload given) gets no passes.
@contextlib.contextmanager
def isolated(offload, model):
    """Around a pass on ``model``: DeepSpeed's ZeRO-3 state after it is what it was before
    (NOTE [ Matched passes under ZeRO-3 ]). ``offload``: DeepSpeed's parameter offload; None
    (the parameters are not ZeRO-3's): nothing to do."""
    if offload is None:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(model.parameters())
    modules = list(model.modules())
    kept = [p.ds_status == ZeroParamStatus.AVAILABLE for p in params]
    owners = [set(p.ds_active_sub_modules) for p in params]
    counters = [_module_counters(m) for m in modules]
    for p, resident in zip(params, kept):
        if resident:  # never released by the pass's module hooks
            p.ds_active_sub_modules.add(_PASS_OWNER)
    coordinator = offload.param_coordinator
    offload.param_coordinator = _fresh_coordinator(coordinator)
    try:
        yield
    finally:
        offload.param_coordinator = coordinator
        for p, resident, owner in zip(params, kept, owners):
            p.ds_active_sub_modules.clear()
            if not resident and p.ds_status == ZeroParamStatus.AVAILABLE:
                p.partition()  # gathered for a backward whose release hook never ran
            p.ds_active_sub_modules.update(owner)
        for m, state in zip(modules, counters):
            _restore_counters(m, state)


def _fresh_coordinator(coordinator):
    """A copy of DeepSpeed's ZeRO-3 parameter coordinator with empty containers (its own
    in-flight registry, fetch queue, trace) and an invalid trace (it records, never prefetches)."""
    fresh = copy.copy(coordinator)
    for name, value in vars(coordinator).items():
        if isinstance(value, (list, dict, set, collections.deque, UserDict)):
            value = copy.copy(value)
            value.clear()
            setattr(fresh, name, value)
        elif isinstance(value, tuple):  # a completed trace
            setattr(fresh, name, [])
    if not fresh.is_invalid_trace():
        fresh._invalidate_trace()
    return fresh


_MODULE_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining", "ds_recompute_parameters")


def _module_counters(module) -> dict:
    return {k: copy.copy(module.__dict__[k]) for k in _MODULE_COUNTERS if k in module.__dict__}


def _restore_counters(module, state: dict) -> None:
    for k in _MODULE_COUNTERS:
        if k in state:
            module.__dict__[k] = state[k]
        else:
            module.__dict__.pop(k, None)
