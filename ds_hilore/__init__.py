"""ds_hilore: HiLoRe activation recovery (store / compress / recompute) for DeepSpeed GRPO training.

Public API:
    initialize   -- ``deepspeed.initialize`` plus the ``"hilore"`` block of the same config
    attach       -- make HiLoRe a model's activation checkpointing (no DeepSpeed needed)
    HiLoReConfig -- the ``"hilore"`` config block
    grpo         -- GRPO losses with exact per-token coefficients
"""

from ds_hilore._errors import HiLoReConfigError, HiLoReError
from ds_hilore.config import HiLoReConfig
from ds_hilore.plan import attach
from ds_hilore.runtime import HiLoReRuntime, find_runtime

__all__ = ["HiLoReConfig", "HiLoReConfigError", "HiLoReError", "HiLoReRuntime", "attach",
           "find_runtime", "grpo", "initialize"]


def __getattr__(name):
    # DeepSpeed and the GRPO module load on first use: attaching to a model needs neither.
    if name == "initialize":
        from ds_hilore.integrations.engine import initialize
        return initialize
    if name == "grpo":
        import importlib
        return importlib.import_module(".grpo", __name__)
    raise AttributeError(f"module 'ds_hilore' has no attribute {name!r}")
