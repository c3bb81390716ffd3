"""Recovery units: the decoder layers of a model, each split into one or two units.

NOTE [ Recovery units ]
A unit couples a forward subgraph with every tensor its backward needs. The checkpoint
boundary stays the decoder layer: only the layer's inputs are kept for recompute, exactly as
gradient checkpointing keeps them. Inside a layer, a unit is a contiguous run of the layer's
*child-module calls* (and the layer-body code between them), found from the layer's own
execution (discovery.py): the token-mixing block (``attn``) and the channel-mixing block
(``mlp``), split at the residual boundary; a layer that cannot be split exactly is one unit
(``block``). Units are attributed by call position, not by child name, so a child called in
both halves (a shared dropout) is no obstacle. ``attn_children`` / ``mlp_children`` in the
config override the split by names; the override is verified like a discovered split.

Positions in a layer call are *segments*: 0 before the first child call, ``2c + 1`` inside
call ``c``, ``2c + 2`` in the layer-body code after call ``c``. A split is the last segment
of the first unit (``2k + 1`` for a split after call ``k``): body code after the first unit's
last call belongs to the second unit, because a re-run executes it in any case.

NOTE [ Compiled layers ]
transformers checkpoints a layer's ``forward``, not its ``__call__``, so under torch.compile --
``layer.compile()``, ``torch.compile(layer)`` or a compiled whole model, any backend -- HiLoRe's
layer call is reached while dynamo traces. Capture rests on Python hooks around every saved
tensor and child call; traced, the saved tensors are those of the compiled graph, attributed to
the wrong units, and a recompute no longer matches its forward. So the runtime's entry points
are kept out of the graph (``outside_compile``): dynamo breaks the graph there and the layer's
forward runs eagerly under HiLoRe, every action exact as without compilation, the rest of the
model compiled; the runtime says so once. transformers releases that checkpoint ``__call__``
(5.17) reach the runtime outside the graph under ``layer.compile()``, with a call that would
run the compiled graph: ``eager_call`` hands the layer's eager ``_call_impl`` instead. Chosen
over running compiled layers as plain gradient checkpointing inside the graph: that would keep
the layers compiled, but HiLoRe would then do nothing for them while its plan, memory budget
and stats went on describing units it cannot see. A user who prefers compiled layers to HiLoRe detaches it and uses torch's checkpointing.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ds_hilore._errors import HiLoReNameError

logger = logging.getLogger("ds_hilore")

TWO_UNITS = ("attn", "mlp")  # execution order inside a split decoder layer
ONE_UNIT = ("block",)

# peft wraps the model as PeftModel -> LoraModel -> the transformers model; unit names are
# given relative to the transformers model so force_plan patterns work with and without LoRA.
# torch.compile's OptimizedModule holds the compiled module as ``_orig_mod``.
_WRAPPER_PREFIXES = ("base_model.model.", "module.", "_orig_mod.")
_COMPILED_INFIX = "._orig_mod"
_MAX_WHOLE_SHAPES = 64  # input shapes a layer keeps the whole bytes of (LayerUnits.whole_bytes)
_TOLD_COMPILED: "weakref.WeakSet" = weakref.WeakSet()  # runtimes that said it (NOTE [ Compiled layers ])


class Unit:
    """A recovery unit: one part (``"attn"``, ``"mlp"`` or the whole ``"block"``) of a layer.

    Attributes:
        name: e.g. ``"model.layers.3.mlp"``.
        kind: ``"attn"``, ``"mlp"`` or ``"block"`` (a layer that is one unit).
        layer_index: index of the decoder layer in execution order.
        index: index of the unit among all units, in execution order.
        pos: position of the unit inside its layer (0 or 1).
        children: names of the layer's child modules called inside this unit, in call order.
        action: what happened to the unit's saved tensors in the last microbatch: ``"H"``,
            ``"L"`` (any slice packed), ``"R"`` or ``"E"`` (every slice elided).
        nbytes: bytes the unit held after the forward of the last microbatch.
    """

    __slots__ = ("name", "kind", "layer_index", "index", "pos", "children", "action", "nbytes")

    def __init__(self, name: str, kind: str, layer_index: int, pos: int, children: tuple[str, ...]):
        self.name, self.kind, self.layer_index, self.pos = name, kind, layer_index, pos
        self.index = -1  # set when the runtime numbers all units
        self.children = children
        self.action = "R"
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, action={self.action!r})"


@dataclass(frozen=True)
class Split:
    """How the calls of one decoder-layer class divide into units (found by discovery.py).

    Attributes:
        calls: child-module name of every call, in execution order.
        boundary: last segment of the first unit; None when the layer is one unit.
        cut: (call, output leaf) pairs of the first unit that the second unit reads, directly or
            through layer-body code: what a fast-forward of the first unit must hand on.
        verified: ``"bitwise"``, or ``"tolerance"`` where the device's own kernels are not
            bitwise reproducible (recompute is then as exact as gradient checkpointing).
    """

    calls: tuple[str, ...]
    boundary: int | None
    cut: frozenset
    verified: str = "bitwise"

    @property
    def n_units(self) -> int:
        return 1 if self.boundary is None else 2

    def unit_of_segment(self, segment: int) -> int:
        return 0 if self.boundary is None or segment <= self.boundary else 1

    def unit_of_call(self, call: int) -> int:
        return self.unit_of_segment(2 * call + 1)


@dataclass
class LayerUnits:
    """A decoder layer and its units, in execution order (empty until discovered)."""

    name: str
    index: int
    module: nn.Module
    units: list[Unit] = field(default_factory=list)
    split: Split | None = None
    names: dict[str, int] | None = None  # child name -> unit position, from the override
    # called by rows alike (no random draws, outputs put back by rows): known from its first
    # call through a frame (NOTE [ Kept rows only ] in rows.py)
    row_safe: bool | None = None
    # bytes per unit its frame kept, by input shape, where it keeps what autograd keeps (NOTE
    # [ A layer that keeps everything ] in calling.py); the shapes used least recently are
    # forgotten past _MAX_WHOLE_SHAPES (lengths that vary from step to step never come back)
    whole_bytes: dict = field(default_factory=dict)

    def whole_known(self, key) -> bool:
        """Whether the bytes of a call at ``key`` are known; marks ``key`` used now."""
        if key not in self.whole_bytes:
            return False
        self.whole_bytes[key] = self.whole_bytes.pop(key)  # the most recent, last
        return True

    def learn_whole(self, key, held: list) -> None:
        """The bytes per unit a frame at ``key`` kept; the least recent shapes forgotten."""
        self.whole_bytes.pop(key, None)
        self.whole_bytes[key] = held
        while len(self.whole_bytes) > _MAX_WHOLE_SHAPES:
            del self.whole_bytes[next(iter(self.whole_bytes))]

    @property
    def signature(self) -> tuple:
        """Layers with the same class and children share one discovery."""
        return (type(self.module),) + tuple((n, type(c)) for n, c in self.module.named_children())

    def set_split(self, split: Split) -> None:
        kinds = ONE_UNIT if split.boundary is None else TWO_UNITS
        children: list[list[str]] = [[] for _ in kinds]
        for call, child in enumerate(split.calls):
            if child not in children[split.unit_of_call(call)]:
                children[split.unit_of_call(call)].append(child)
        if self.units and [u.kind for u in self.units] == list(kinds):
            for unit, names in zip(self.units, children):
                unit.children = tuple(names)
        else:
            self.units = [Unit(f"{self.name}.{kind}", kind, self.index, pos, tuple(names))
                          for pos, (kind, names) in enumerate(zip(kinds, children))]
        self.split = split


def public_name(name: str) -> str:
    """Module name without peft / engine / torch.compile wrapper prefixes."""
    name = name.replace(_COMPILED_INFIX + ".", ".")
    if name.endswith(_COMPILED_INFIX):
        name = name[:-len(_COMPILED_INFIX)]
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _say_eager(runtime) -> None:
    if runtime not in _TOLD_COMPILED:
        _TOLD_COMPILED.add(runtime)
        logger.warning(
            "ds_hilore: the model's decoder layers run under torch.compile; HiLoRe runs each "
            "decoder layer's forward eagerly (out of the compiled graph: its per-unit capture "
            "needs Python hooks) and the rest of the model compiled. To keep the layers "
            "compiled instead, detach HiLoRe (runtime.detach()) and use gradient checkpointing.")


def outside_compile(method):
    """Decorates a runtime method that torch.compile may reach while tracing: traced, it is
    called eagerly, out of the graph, and the runtime says so once (NOTE [ Compiled layers ])."""

    @torch._dynamo.disable(recursive=True)
    def eagerly(runtime, *args):
        _say_eager(runtime)
        return method(runtime, *args)

    @functools.wraps(method)
    def call(runtime, *args):
        if torch.compiler.is_compiling():
            return eagerly(runtime, *args)
        return method(runtime, *args)
    return call


def eager_call(runtime, function):
    """``function`` -- what a layer hands its checkpoint function -- with a ``layer.compile()``'d
    module call replaced by the module's eager one (NOTE [ Compiled layers ]). transformers
    releases that checkpoint ``__call__`` rather than ``forward`` (5.17 does) reach the runtime
    outside the graph, with a function that would run the compiled ``_call_impl`` inside
    HiLoRe's capture."""
    call = function.func if isinstance(function, functools.partial) else function
    module = getattr(call, "__self__", None)
    if getattr(call, "__func__", None) is not nn.Module.__call__ or \
            getattr(module, "_compiled_call_impl", None) is None:
        return function
    _say_eager(runtime)
    if isinstance(function, functools.partial):
        return functools.partial(module._call_impl, *function.args, **function.keywords)
    return module._call_impl


def is_checkpointing_layer(module: nn.Module) -> bool:
    """A transformers decoder layer that calls its checkpoint function (``GradientCheckpointingLayer``)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers without the base class: only layer_pattern works
        return False
    return isinstance(module, GradientCheckpointingLayer)


def _layer_candidates(model: nn.Module, layer_pattern: str | None) -> list[tuple[str, nn.Module]]:
    found = []
    for name, module in model.named_modules():
        if module is model or isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            continue  # torch.compile's wrapper: the module it wraps is the candidate
        public = public_name(name)
        if layer_pattern is not None:
            if fnmatch.fnmatchcase(public, layer_pattern):
                found.append((public, module))
        elif is_checkpointing_layer(module):
            found.append((public, module))
    # a matched layer nested in another matched layer (e.g. a too-broad glob) is not a layer
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o in names if o != n)]


def find_layers(model: nn.Module, config) -> list[LayerUnits]:
    """The decoder layers of ``model``; units come from discovery or the name override.

    Raises:
        HiLoReNameError: no decoder layer was found, or (with the name override) a layer has a
            child module that belongs to no unit; the message says which config keys to set.
    """
    candidates = _layer_candidates(model, config.layer_pattern)
    if not candidates:
        how = (f"no module name matches hilore.layer_pattern {config.layer_pattern!r}"
               if config.layer_pattern else
               "no module subclasses transformers' GradientCheckpointingLayer")
        raise HiLoReNameError(
            f"ds_hilore found no decoder layers in {type(model).__name__}: {how}. Set "
            "'layer_pattern' in the \"hilore\" config block to a glob matching the decoder layers' "
            "module names (e.g. \"model.layers.*\"); units are then found from each layer's "
            "execution ('attn_children' / 'mlp_children' name them explicitly if needed).")
    layers = [LayerUnits(name, index, module) for index, (name, module) in enumerate(candidates)]
    if config.attn_children is not None:
        for layer in layers:
            _units_from_names(layer, config)
    return layers


def _units_from_names(layer: LayerUnits, config) -> None:
    """The override: units named by ``attn_children`` / ``mlp_children``."""
    kinds = {"attn": list(config.attn_children), "mlp": list(config.mlp_children)}
    names: dict[str, int] = {}
    unmapped = []
    for child_name, _ in layer.module.named_children():
        pos = next((i for i, kind in enumerate(TWO_UNITS) if child_name in kinds[kind]), None)
        if pos is None:
            unmapped.append(child_name)
        else:
            names[child_name] = pos
    if unmapped:
        raise HiLoReNameError(
            f"decoder layer {layer.name!r} ({type(layer.module).__name__}) has child modules that "
            f"belong to no recovery unit: {unmapped}. Add each to 'attn_children' or "
            f"'mlp_children' in the \"hilore\" config block (now hilore.attn_children={kinds['attn']}, "
            f"mlp_children={kinds['mlp']}), or remove both keys to find units from execution.")
    for pos, kind in enumerate(TWO_UNITS):
        children = tuple(c for c, p in names.items() if p == pos)
        if not children:
            raise HiLoReNameError(
                f"decoder layer {layer.name!r} ({type(layer.module).__name__}) has no {kind} "
                f"sub-block: none of its children {list(names)} is listed in '{kind}_children' of "
                f"the \"hilore\" config block (now hilore.attn_children={kinds['attn']}, "
                f"mlp_children={kinds['mlp']}). Move a child to hilore.{kind}_children.")
    layer.names = names
    layer.units = [Unit(f"{layer.name}.{kind}", kind, layer.index, pos,
                        tuple(c for c, p in names.items() if p == pos))
                   for pos, kind in enumerate(TWO_UNITS)]
