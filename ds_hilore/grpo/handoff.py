"""Where the GRPO losses hand their coefficients ω to whoever listens (the HiLoRe runtime).

The losses are math and import no runtime: a runtime subscribes here when it is imported, and a
loss with no listener (no model attached, unit tests) simply publishes to nobody.
"""

from __future__ import annotations

from typing import Callable

import torch

_listeners: list[Callable[[torch.Tensor, torch.Tensor, "torch.nn.Module | None"], None]] = []


def subscribe(listener: Callable[[torch.Tensor, torch.Tensor, "torch.nn.Module | None"], None]) -> None:
    """``listener(coefficients, logp, model)`` is called by every loss that computed ω."""
    if listener not in _listeners:
        _listeners.append(listener)


def publish(coefficients: torch.Tensor, logp: torch.Tensor, model: "torch.nn.Module | None" = None) -> None:
    """Hands ω (B, T') computed from ``logp`` to every listener, before the backward."""
    for listener in list(_listeners):
        listener(coefficients, logp, model)
