"""What a decoder-layer call is given: its hidden states, its (B, T), its KV cache (dropped)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ds_hilore._errors import HiLoReError


def hidden_input(args: tuple, keywords: dict) -> torch.Tensor:
    """The hidden states of a layer call: first positional tensor, else ``hidden_states=``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(keywords.get("hidden_states"), torch.Tensor):
        return keywords["hidden_states"]
    tensors = [x for x in tree_flatten((args, keywords))[0] if isinstance(x, torch.Tensor)]
    if not tensors:
        raise HiLoReError("a decoder layer was called without any tensor argument")
    return tensors[0]


def drop_cache(module: nn.Module, function: Callable, args: tuple):
    """(function, args, dropped): every transformers ``Cache`` argument replaced by None.

    A layer under HiLoRe must not write a KV cache: its re-run would read the entries the
    forward wrote (state across calls). transformers drops the cache by argument name under its
    own checkpointing; here every ``Cache`` goes, positional ones included, unless the layer
    declares that it only reads the cache (``_can_checkpoint_with_cache``).
    """
    if getattr(module, "_can_checkpoint_with_cache", False):
        return function, args, False
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return function, args, False
    keywords = getattr(function, "keywords", None) or {}
    if not any(isinstance(x, Cache) for x in (*args, *keywords.values())):
        return function, args, False
    args = tuple(None if isinstance(x, Cache) else x for x in args)
    if keywords:
        function = functools.partial(function.func, *function.args, **{
            k: None if isinstance(v, Cache) else v for k, v in keywords.items()})
    return function, args, True


def batch_and_length(hidden: torch.Tensor, mask) -> tuple[int, int]:
    """(B, T) of a layer call: from (B, T, H) hidden states, else from a (B, 1, T, S) mask."""
    if hidden.dim() != 3 and isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return mask.shape[0], mask.shape[-2]
    return hidden.shape[0], hidden.shape[1] if hidden.dim() >= 2 else 1

