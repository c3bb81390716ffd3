"""How a runtime joins a model: its hooks installed (and removed), switched on and off, and
the recovery units found.

NOTE [ Switching ]
transformers' decoder layers call ``self._gradient_checkpointing_func(forward, *args)`` when
their ``gradient_checkpointing`` flag is set, in training mode, with gradients on. Attaching puts
a ``_LayerCall`` there and sets the flag; ``gradient_checkpointing_enable()`` /
``gradient_checkpointing_disable()`` reach ``_set_gradient_checkpointing`` on the model, which is
wrapped (``_Toggle``) so that "on" means HiLoRe and "off" means plain autograd. Under
``torch.no_grad()`` the layers never call the function: nothing is captured.
"""

from __future__ import annotations

import functools
import logging

import torch

from ds_hilore._errors import HiLoReError
from ds_hilore.runtime import discovery
from ds_hilore.runtime.calls import hidden_input
from ds_hilore.runtime.memory import release_blas_buffers
from ds_hilore.runtime.registry import register, unregister
from ds_hilore.runtime.units import LayerUnits, eager_call, is_checkpointing_layer

logger = logging.getLogger("ds_hilore")


class _LayerCall:
    """Installed as a decoder layer's ``_gradient_checkpointing_func``."""

    def __init__(self, runtime: "Installation", layer: LayerUnits):
        self.runtime, self.layer = runtime, layer

    def __call__(self, function, *args, **kwargs):
        function = eager_call(self.runtime, function)  # NOTE [ Compiled layers ] (units.py)
        if kwargs:
            function = functools.partial(function, **kwargs)
        return self.runtime._run_layer(self.layer, function, args)


class _ForwardWrapper:
    """Instance ``forward`` of a layer named by ``layer_pattern`` that has no checkpoint hook."""

    def __init__(self, runtime: "Installation", layer: LayerUnits, forward):
        self.runtime, self.layer, self.forward = runtime, layer, forward

    def __call__(self, *args, **kwargs):
        if self.runtime.enabled and self.layer.module.training and torch.is_grad_enabled():
            return self.runtime._run_layer(self.layer, functools.partial(self.forward, **kwargs), args)
        return self.forward(*args, **kwargs)


class _Toggle:
    """Wraps a transformers model's ``_set_gradient_checkpointing`` (NOTE [ Switching ])."""

    def __init__(self, runtime: "Installation", original):
        self.runtime, self.original = runtime, original

    def __call__(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
        kwargs = {} if gradient_checkpointing_func is None else {
            "gradient_checkpointing_func": gradient_checkpointing_func}
        self.original(enable=enable, every_n_layers=every_n_layers, **kwargs)
        self.runtime._switch(enable, every_n_layers)
        self.runtime._last_toggle = (self.original, enable, every_n_layers, kwargs)


class Installation:
    """The part of ``HiLoReRuntime`` (core.py) that changes the model: hooks, switching,
    discovery of the units. Its state lives on the runtime."""

    def detach(self) -> None:
        """Restore the model as it was before ``attach``."""
        if not self.attached:
            return
        for obj, name, had, old in reversed(self._saved):
            if had:
                setattr(obj, name, old)
            else:
                obj.__dict__.pop(name, None)
        self._saved.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._weights.wants_leaf = None
        if self._last_toggle is not None:  # the user's last switch holds for HF checkpointing
            original, enable, every_n_layers, kwargs = self._last_toggle
            original(enable=enable, every_n_layers=every_n_layers, **kwargs)
        policy_detach = getattr(self.policy, "detach", None)
        if policy_detach is not None:  # e.g. a memory window still open (NOTE [ Tracked windows ])
            policy_detach()
        self.attached = False
        self._mb = None
        unregister(self)

    def _install(self) -> None:
        for layer in self._layers:
            module = layer.module
            if is_checkpointing_layer(module):
                self._remember(module, "_gradient_checkpointing_func")
                self._remember(module, "gradient_checkpointing")
                module._gradient_checkpointing_func = _LayerCall(self, layer)
                module.gradient_checkpointing = True
            else:
                self._remember(module, "forward")
                module.forward = _ForwardWrapper(self, layer, module.forward)
        try:
            from transformers import PreTrainedModel
        except ImportError:
            PreTrainedModel = ()
        for module in self.model.modules():
            if PreTrainedModel and isinstance(module, PreTrainedModel):
                self._remember(module, "_set_gradient_checkpointing")
                module._set_gradient_checkpointing = _Toggle(self, module._set_gradient_checkpointing)
        self._hooks.append(self.model.register_forward_pre_hook(self._begin_forward, with_kwargs=True))
        # always_call: a forward that raises ends too (its output None), so nothing of it lingers
        self._hooks.append(self.model.register_forward_hook(self._end_forward, always_call=True))
        self._weights.wants_leaf = self._hook_leaves  # NOTE [ Leaf hooks, when a cast needs them ]
        self.attached = True
        register(self)

    # NOTE [ Leaf hooks, when a cast needs them ]
    # A saved tensor that may be a cast of a frozen weight (autocast's low-precision copy of a
    # LoRA base weight, a norm's ``weight.float()`` in a bf16 model) is matched to the weight
    # through the leaf module running at that moment (``WeightRecognizer._frozen_cast``), which
    # hooks on every leaf module of the layers tell. Those hooks take each leaf's call off
    # torch's fast path -- two Python calls per leaf per forward and recompute, a few dozen a
    # layer -- and an fp32 model run without autocast saves no such cast. So they are
    # registered before the first layer call that may save one: autocast on for the layer's
    # device, or a layer holding a floating weight other than fp32 (``_leaf_hooks_due`` in
    # calling.py). A cast seen without them (an fp32 model casting a frozen weight in its own
    # code) registers them too (``wants_leaf``): that one tensor is matched by the full
    # comparison the recogniser makes without a leaf, every later one by its leaf.
    def _hook_leaves(self) -> None:
        if self._weights.wants_leaf is None:  # registered already
            return
        self._weights.wants_leaf = None
        for layer in self._layers:
            for leaf in layer.module.modules():
                if next(leaf.children(), None) is None and next(leaf.parameters(False), None) is not None:
                    self._hooks.append(leaf.register_forward_pre_hook(self._enter_leaf))
                    self._hooks.append(leaf.register_forward_hook(self._leave_leaf))

    def _enter_leaf(self, module, args) -> None:
        self._weights.leaf = module

    def _leave_leaf(self, module, args, output) -> None:
        self._weights.leaf = None

    def _remember(self, obj, name: str) -> None:
        self._saved.append((obj, name, name in obj.__dict__, obj.__dict__.get(name)))

    def _switch(self, enable: bool, every_n_layers: int = 1) -> None:
        """HiLoRe on / off; with ``every_n_layers`` N > 1 only every N-th layer is HiLoRe's, the
        others keep their activations (plain autograd), as transformers defines it."""
        self._switched_on = enable
        self._every_n_layers = every_n_layers
        self._last_active = self._layers[(len(self._layers) - 1) // every_n_layers * every_n_layers].index
        for position, layer in enumerate(self._layers):
            if is_checkpointing_layer(layer.module):
                layer.module.gradient_checkpointing = enable and position % every_n_layers == 0
                layer.module._gradient_checkpointing_func = _LayerCall(self, layer)

    # ------------------------------------------------------------------ discovery
    def _probe(self) -> None:
        """Find every layer's units now, with one small forward (``discovery.probe``); other
        models, or a probe that fails, find their units at the first training forward."""
        if all(layer.split is not None for layer in self._layers):
            return
        self._probing, warned = True, self._warned_cache
        self._warned_cache = True  # the probe's own cache is dropped quietly
        try:
            failure = discovery.probe(self.model)
        finally:
            self._probing, self._warned_cache = False, warned
            self._mb, self._step, self._n_microbatches = None, [], 0
            release_blas_buffers()  # NOTE [ MKL's buffers ] in memory.py
        if failure:  # said once, at attach; the first training forward finds the units instead
            logger.info("ds_hilore: %s; recovery units will be found at the first training "
                        "forward.", failure)

    def when_units_known(self, action) -> None:
        """``action()`` once every layer's recovery units are known: now, or at the start of the
        first training forward after the one that finds them (models without transformers'
        decoder layers, or whose layers refused the probe; e.g. a checkpoint's state, compared
        with the units it was learned for). Under several ranks, it runs on every rank at that
        point."""
        if self.units_known():
            action()
        else:
            self._when_units.append(action)

    def _run_when_units_known(self) -> None:
        """A training forward begins: the actions waiting for the units run, once they are known."""
        if self._when_units and self.units_known() and self.enabled and torch.is_grad_enabled() \
                and not self._probing:
            actions, self._when_units = self._when_units, []
            for action in actions:
                action()

    def units_known(self) -> bool:
        """Whether every layer's recovery units are known (found by the probe at attach, or by
        the first training forward)."""
        return all(layer.split is not None for layer in self._layers)

    def _discover(self, layer: LayerUnits, function, args: tuple):
        device = hidden_input(args, getattr(function, "keywords", {})).device
        out, split = discovery.discover(layer, function, args, device,
                                        lambda t: self._weights(t, layer.module) is not None,
                                        self.collective)
        for other in self._layers:  # at the probe, every layer proves itself
            if other is layer or (not self._probing and other.split is None
                                  and other.signature == layer.signature):
                other.set_split(split)
        self._renumber()
        return out


def checkpointing_on(layers: list[LayerUnits]) -> bool:
    """Whether the script turned gradient checkpointing on for these layers (NOTE [ The
    script's checkpointing ] in core.py): a transformers layer's flag is set, or no layer has
    the flag."""
    flagged = [layer.module for layer in layers if is_checkpointing_layer(layer.module)]
    return not flagged or any(getattr(m, "gradient_checkpointing", False) for m in flagged)


# NOTE [ Data parallel wrappers ]
# A runtime attaches to the model a process trains; with several processes every rank attaches
# to its own replica or shard at the same point, and agrees with the others on every decision
# (NOTE [ One decision for every rank ] in collective.py). What wraps the model then decides
# whether HiLoRe's recompute sees what the first forward saw:
# * DistributedDataParallel: each rank runs the whole model; gradients are reduced by hooks on
#   the parameters, which a recompute leaves alone.
# * FSDP2 (``fully_shard`` on the decoder layers and the model): a recompute calls the layer
#   through its module, whose pre-forward hook gathers the parameters again, as for torch's
#   own checkpointing; parameters and their gradients are DTensors (read through their local
#   shards).
# * FSDP1 (``FullyShardedDataParallel`` wrapping the decoder layers; tested with
#   ``use_orig_params=True``): a recompute runs inside the wrapped layer's backward, after
#   FSDP gathered its parameters for it.
# * DeepSpeed: through ``ds_hilore.initialize``, which attaches to the engine's module.
# Refused at attach, with the way in: torch.nn.DataParallel (replicas run in threads of one
# process, each would need its own runtime), a DeepSpeed engine handed to ``attach`` (its step
# must close HiLoRe's: ``ds_hilore.initialize``), and DTensor parameters outside FSDP2
# (tensor or sequence parallelism: a layer's forward holds collectives no test has replayed).
def refuse_unsupported_wrappers(model: torch.nn.Module) -> None:
    """Raise ``HiLoReError`` for a wrapper HiLoRe does not support (NOTE [ Data parallel
    wrappers ]), naming the supported way in."""
    supported = ("Supported: DistributedDataParallel, FSDP2 (fully_shard on the decoder layers "
                 "and the model), FullyShardedDataParallel (FSDP1) wrapping the decoder layers, "
                 "and DeepSpeed through ds_hilore.initialize.")
    for module in model.modules():
        if isinstance(module, torch.nn.DataParallel):
            raise HiLoReError(
                "ds_hilore.attach: the model is wrapped in torch.nn.DataParallel, which runs its "
                "replicas in threads of one process; HiLoRe needs one process per replica. Fix: "
                f"use DistributedDataParallel (one process per device, e.g. torchrun). {supported}")
        if type(module).__module__.startswith("deepspeed.") and hasattr(module, "module") \
                and type(module).__name__.endswith("Engine"):
            raise HiLoReError(
                "ds_hilore.attach was given a DeepSpeed engine; its optimizer step must close "
                "HiLoRe's steps. Fix: call ds_hilore.initialize(...) in place of "
                f"deepspeed.initialize(...) (same arguments). {supported}")
    if _tensor_parallel(model):
        raise HiLoReError(
            "ds_hilore.attach: the model has DTensor parameters outside FSDP2's fully_shard "
            "(tensor or sequence parallelism), which HiLoRe does not support. Fix: train with "
            f"data parallelism only. {supported}")


def reduces_in_hooks(model: torch.nn.Module) -> bool:
    """Whether a wrapper in ``model`` reduces each gradient in a hook as it is made (DDP, FSDP1,
    FSDP2): the layers' backward of a microbatch of zeros then runs (NOTE [ A backward of
    zeros ] in zero_backward.py)."""
    kinds: tuple = (torch.nn.parallel.DistributedDataParallel,)
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds += (FSDPModule, FullyShardedDataParallel)
    except ImportError:
        pass
    return any(isinstance(module, kinds) for module in model.modules())


def _tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether a parameter is a DTensor that no FSDP2 module above it manages."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False

    def walk(module: torch.nn.Module, sharded: bool) -> bool:
        sharded = sharded or isinstance(module, FSDPModule)
        if not sharded and any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            return True
        return any(walk(child, sharded) for child in module.children())

    return walk(model, False)
