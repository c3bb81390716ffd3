"""ds_hilore: HiLoRe activation recovery (store / compress / recompute) for DeepSpeed GRPO training.

Public API:
    initialize   -- ``deepspeed.initialize`` plus the ``"hilore"`` block of the same config
    attach       -- make HiLoRe a model's activation checkpointing (no DeepSpeed needed)
    HiLoReConfig -- the ``"hilore"`` config block
    grpo         -- GRPO losses with exact per-token coefficients

``import ds_hilore`` imports neither torch nor DeepSpeed (vLLM must be imported before
DeepSpeed, and ``python -m ds_hilore.run`` runs the user's script before either): each name
loads its module on first use; the config needs only pydantic.
"""

import importlib

from ds_hilore._errors import HiLoReConfigError, HiLoReError
from ds_hilore.config import HiLoReConfig

__all__ = ["HiLoReConfig", "HiLoReConfigError", "HiLoReError", "HiLoReRuntime", "attach",
           "find_runtime", "grpo", "initialize"]

_LAZY = {"attach": "ds_hilore.plan", "HiLoReRuntime": "ds_hilore.runtime",
         "find_runtime": "ds_hilore.runtime", "initialize": "ds_hilore.integrations.engine"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "grpo":
        return importlib.import_module(".grpo", __name__)
    raise AttributeError(f"module 'ds_hilore' has no attribute {name!r}")
