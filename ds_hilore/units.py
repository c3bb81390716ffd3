"""Find the recovery units of a model: one attention and one MLP sub-block per decoder layer.

NOTE [ Recovery units ]
A unit couples a forward subgraph with every tensor its backward needs (DESIGN.md §4). The
checkpoint boundary stays the decoder layer: only the layer's inputs are kept for recompute,
exactly as gradient checkpointing keeps them. Inside a layer, saved tensors are attributed to
the sub-block whose child module is executing; every child module of a layer must therefore
belong to exactly one unit (``attn_children`` / ``mlp_children`` in the config), including
layer-level dropouts such as Phi-3's ``resid_attn_dropout`` or GPT-NeoX's
``post_attention_dropout``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch.nn as nn

from ._errors import HiLoReError

UNIT_KINDS = ("attn", "mlp")  # execution order inside a decoder layer

# peft wraps the model as PeftModel -> LoraModel -> the transformers model; unit names are
# given relative to the transformers model so force_plan patterns work with and without LoRA.
_WRAPPER_PREFIXES = ("base_model.model.", "module.")


class Unit:
    """A recovery unit: one sub-block (``"attn"`` or ``"mlp"``) of one decoder layer.

    Attributes:
        name: e.g. ``"model.layers.3.mlp"``.
        kind: ``"attn"`` or ``"mlp"``.
        layer_index: index of the decoder layer in execution order.
        index: index of the unit in execution order (``2 * layer_index + kind position``).
        children: names of the layer's child modules that belong to this unit.
        action: what happened to the unit's saved tensors in the last microbatch: ``"H"``,
            ``"L"`` (any slice packed), ``"R"`` or ``"E"`` (every slice elided).
    """

    __slots__ = ("name", "kind", "layer_index", "index", "children", "action")

    def __init__(self, name: str, kind: str, layer_index: int, index: int, children: tuple[str, ...]):
        self.name = name
        self.kind = kind
        self.layer_index = layer_index
        self.index = index
        self.children = children
        self.action = "R"

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, action={self.action!r})"


@dataclass
class LayerUnits:
    """A decoder layer and its units, in execution order."""

    name: str
    index: int
    module: nn.Module
    units: list[Unit]
    child_unit: dict[str, int] = field(default_factory=dict)  # child name -> position in units


def public_name(name: str) -> str:
    """Module name without peft / engine wrapper prefixes."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


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
        if module is model:
            continue
        public = public_name(name)
        if layer_pattern is not None:
            if fnmatch.fnmatchcase(public, layer_pattern):
                found.append((public, module))
        elif is_checkpointing_layer(module):
            found.append((public, module))
    # a matched layer nested in another matched layer (e.g. a too-broad glob) is not a layer
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o in names if o != n)]


def find_units(model: nn.Module, config) -> list[LayerUnits]:
    """Decoder layers of ``model`` split into attention / MLP units.

    Raises:
        HiLoReError: no decoder layer was found, or a layer has a child module that belongs to
            no unit; the message says which config keys name them.
    """
    candidates = _layer_candidates(model, config.layer_pattern)
    if not candidates:
        how = (f"no module name matches layer_pattern {config.layer_pattern!r}"
               if config.layer_pattern else
               "no module subclasses transformers' GradientCheckpointingLayer")
        raise HiLoReError(
            f"ds_hilore found no decoder layers in {type(model).__name__}: {how}. Set "
            "'layer_pattern' in the \"hilore\" config block to a glob matching the decoder layers' "
            "module names (e.g. \"model.layers.*\"), and 'attn_children' / 'mlp_children' to the "
            "names of each layer's child modules that form its attention and MLP sub-blocks.")
    kinds = {"attn": list(config.attn_children), "mlp": list(config.mlp_children)}
    layers = []
    for layer_index, (name, module) in enumerate(candidates):
        child_unit: dict[str, int] = {}
        unmapped = []
        for child_name, _ in module.named_children():
            pos = next((i for i, kind in enumerate(UNIT_KINDS) if child_name in kinds[kind]), None)
            if pos is None:
                unmapped.append(child_name)
            else:
                child_unit[child_name] = pos
        if unmapped:
            raise HiLoReError(
                f"decoder layer {name!r} ({type(module).__name__}) has child modules that belong to "
                f"no recovery unit: {unmapped}. Add each to 'attn_children' or 'mlp_children' in the "
                f"\"hilore\" config block (now attn_children={kinds['attn']}, "
                f"mlp_children={kinds['mlp']}).")
        units = []
        for pos, kind in enumerate(UNIT_KINDS):
            children = tuple(c for c, p in child_unit.items() if p == pos)
            if not children:
                raise HiLoReError(
                    f"decoder layer {name!r} ({type(module).__name__}) has no {kind} sub-block: none "
                    f"of its children {list(child_unit)} is listed in '{kind}_children' of the "
                    "\"hilore\" config block.")
            units.append(Unit(f"{name}.{kind}", kind, layer_index, 2 * layer_index + pos, children))
        layers.append(LayerUnits(name, layer_index, module, units, child_unit))
    return layers
