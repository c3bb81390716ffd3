"""Weights among the saved tensors: recognised and referenced, never captured.

NOTE [ Weights are never captured ]
The pack hook does not receive ``nn.Parameter`` objects: it gets a transposed view of a
trainable weight, a detached alias of a frozen (LoRA base) weight or -- under autocast -- a
fresh low-precision cast of a weight. Storing them would keep a copy of the model per
microbatch, and under ZeRO-3 a partitioned parameter's storage is freed after use, so each
becomes a ``WeightRef`` that rebuilds the tensor from the parameter on unpack.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_MAX_CASTS = 4096  # verified casts remembered; expired ones are dropped beyond this


class WeightRef:
    """A parameter (or a view or autocast cast of one) referenced, never copied.

    The storage offset is kept relative to the tensor the view was taken of (the parameter,
    or the cast), so a parameter re-gathered elsewhere in a flat buffer (ZeRO-3) still works.
    """

    __slots__ = ("param", "dtype", "size", "stride", "offset", "proof")

    def __init__(self, param: nn.Parameter, dtype: torch.dtype | None, t: torch.Tensor,
                 origin: torch.Tensor, proof: torch.Tensor | None = None):
        self.param, self.dtype = param, dtype
        self.proof = proof  # () bool on the device, read later: the cast is what it seems
        self.size, self.stride = t.size(), t.stride()
        self.offset = t.storage_offset() - origin.storage_offset()

    def get(self) -> torch.Tensor:
        w = self.param.detach()
        if self.dtype is not None and w.dtype != self.dtype:
            w = w.to(self.dtype)  # same cast autocast made in forward: bitwise equal
        return w.as_strided(self.size, self.stride, w.storage_offset() + self.offset)


class WeightRecognizer:
    """``recognizer(t, layer_module)``: a ``WeightRef`` when ``t`` is one of the layer's
    parameters, a view of one, or an autocast cast of one; else None (an activation)."""

    def __init__(self, modules):
        self.params = {id(m): list(m.parameters()) for m in modules}
        # FSDP2: the module's parameters are sharded DTensors, swapped for plain gathered ones
        # while it runs (NOTE [ Data parallel wrappers ] in install.py): read when called
        self.swapped = {key for key, params in self.params.items()
                        if any(is_traceable_wrapper_subclass(p) for p in params)}
        self._casts: dict[int, tuple[StorageWeakRef, nn.Parameter]] = {}  # storage ptr -> param
        self.leaf: nn.Module | None = None  # the leaf module running now (the runtime's hooks)
        # called once, at the first tensor that may be a frozen weight's cast: the runtime's leaf
        # hooks go on (NOTE [ Leaf hooks, when a cast needs them ] in install.py)
        self.wants_leaf = None
        self._ptrs: dict[int, tuple[int, dict[int, nn.Parameter]]] = {}  # NOTE [ Aliases, by address ]
        self._frozen: dict[int, set] = {}  # id(params) -> (shape, dtype) of its frozen parameters

    def partitioned(self, layer_module: nn.Module) -> bool:
        """Whether the layer's parameters are partitioned between its calls (ZeRO-3's, or
        FSDP's sharded DTensors): their storage is freed or swapped after use."""
        params = self.params[id(layer_module)]
        return id(layer_module) in self.swapped or bool(params) and hasattr(params[0], "ds_id")

    def __call__(self, t: torch.Tensor, layer_module: nn.Module,
                 epoch: int | None = None) -> WeightRef | None:
        """``epoch``: the microbatch the call belongs to (NOTE [ Aliases, by address ])."""
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter):  # the common case: W.t() saved by a matmul
            return WeightRef(base, None, t, base)
        params = self.params[id(layer_module)] if id(layer_module) not in self.swapped \
            else list(layer_module.parameters())
        if base.grad_fn is not None:  # autocast cast of a trainable weight: ToCopy <- AccumulateGrad
            if not type(base.grad_fn).__name__.startswith("ToCopyBackward") or not base.is_contiguous():
                return None  # an activation
            source = base.grad_fn.next_functions[0][0] if base.grad_fn.next_functions else None
            p = getattr(source, "variable", None)
            if p is not None and any(p is q for q in params) and p.shape == base.shape:
                return WeightRef(p, base.dtype, t, base)
            return None
        p = self._alias(t.untyped_storage().data_ptr(), layer_module, params, epoch)
        if p is not None:  # a detached alias of a parameter
            return WeightRef(p, None, t, p)
        if base.requires_grad or not base.is_contiguous():
            return None
        return self._frozen_cast(t, base, params)

    def _alias(self, ptr: int, module: nn.Module, params, epoch: int | None) -> nn.Parameter | None:
        """NOTE [ Aliases, by address ]
        A saved tensor without autograd history may be a detached alias of one of the layer's
        parameters (a frozen LoRA base weight): the first parameter whose storage is its
        storage. Comparing it with every parameter's storage cost a few dozen storage reads per
        such tensor -- the rotary tables, the first layer's activations under LoRA, attention
        masks -- a large part of HiLoRe's host cost per microbatch on small layers. Within one
        microbatch a parameter's storage does not move (outside ZeRO-3, which gathers a
        layer's parameters into new storage as its children run), so the layer's addresses are
        read once per microbatch into a map (the first parameter at an address, as the loop
        found) and each tensor is one lookup. Under ZeRO-3, or without a microbatch, every
        parameter is compared as it is now."""
        if epoch is not None and not getattr(params[0] if params else None, "ds_id", None):
            cached = self._ptrs.get(id(module))
            if cached is None or cached[0] != epoch:
                found: dict[int, nn.Parameter] = {}
                for p in params:
                    if p.numel():
                        found.setdefault(p.untyped_storage().data_ptr(), p)
                cached = self._ptrs[id(module)] = (epoch, found)
            return cached[1].get(ptr)
        for p in params:
            if p.numel() and p.untyped_storage().data_ptr() == ptr:
                return p
        return None

    def _frozen_cast(self, t: torch.Tensor, base: torch.Tensor, params) -> WeightRef | None:
        """A reference when ``base`` is an autocast cast of a frozen parameter (LoRA base).

        The leaf module running now names the one candidate: its reference carries a proof
        computed on the device (a full comparison), read with the microbatch's other checks
        (NOTE [ One read per microbatch ] in storage.py); a failed proof sends the unit to R
        and empties the slot, which the recompute refills (``Slot.disown_weight``).
        Without a single candidate, every same-shape one is compared in full at once. A proven
        cast is then recognised by its storage while it lives; nothing is remembered of a
        failed comparison. A tensor of no frozen parameter's shape, or of the dtype of every
        frozen parameter of that shape, is no cast of one: said without touching any storage
        (an fp32 model's activations without autograd history, the common case).
        """
        kinds = self._frozen.get(id(params))
        if kinds is None:  # (shape, dtype) of the frozen parameters: fixed for the run
            kinds = self._frozen[id(params)] = {  # ZeRO-3: the whole parameter's shape
                (tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for p in params
                if not p.requires_grad}
        if not any(shape == tuple(base.shape) and dtype != base.dtype for shape, dtype in kinds):
            return None
        if self.wants_leaf is not None:  # the next leaf calls name their weights
            self.wants_leaf()
        ptr = base.untyped_storage().data_ptr()
        hit = self._casts.get(ptr)
        if hit is not None:
            if not hit[0].expired() and hit[1].shape == base.shape:
                return WeightRef(hit[1], base.dtype, t, base)
            del self._casts[ptr]

        def candidate(p):
            return not p.requires_grad and p.shape == base.shape and p.dtype != base.dtype

        local = [p for p in self.leaf.parameters(recurse=False) if candidate(p)] \
            if self.leaf is not None else []
        if len(local) == 1 and any(local[0] is q for q in params):
            p = local[0]
            return WeightRef(p, base.dtype, t, base, proof=(base == p.detach().to(base.dtype)).all())
        for p in params:
            if candidate(p) and torch.equal(base, p.detach().to(base.dtype)):
                if len(self._casts) >= _MAX_CASTS:
                    self._casts = {k: v for k, v in self._casts.items() if not v[0].expired()}
                self._casts[ptr] = (StorageWeakRef(base.untyped_storage()), p)
                return WeightRef(p, base.dtype, t, base)
        return None
