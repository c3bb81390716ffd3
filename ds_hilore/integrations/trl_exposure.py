"""Predicted exposure from TRL's ``GRPOTrainer``, before its actor forward, with the script unchanged.

NOTE [ TRL exposure ]
TRL's loss step ``GRPOTrainer._compute_loss(model, inputs)`` (TRL 1.16) receives the batch's
``advantages`` (B,) and ``completion_mask`` (B, T') -- and ``tool_mask`` when tools ran --
before it calls the model, in one forward over the whole batch. ``install`` wraps that method
so that HiLoRe gets sum_t |A_i| m_{i,t} per sequence first (``HiLoReRuntime.expect``): the plan
then splits the batch by exposure, never stores the A = 0 sequences, and spends what they leave.

Only a prediction that is never wrong where it says zero is handed over, so nothing is handed
when a zero advantage need not mean a zero coefficient: a KL term (``beta != 0``), an entropy
bonus, an MoE auxiliary loss, per-token advantages (B, T), or a loss type outside the ones whose
every term is a multiple of A_i. ``_compute_loss`` is private: where the installed TRL's differs
(another signature, or none), nothing is wrapped, and the log says so once. Where nothing is
predicted, HiLoRe decides from the coefficients after the forward, as before.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys

from ds_hilore.grpo import exposure

logger = logging.getLogger("ds_hilore")

__all__ = ["install", "predicted_exposure"]

# every term of the per-token loss is A_i times a factor (ratio, clip gate, weight): A = 0 -> 0
LINEAR_IN_ADVANTAGE = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
_MODULE = "trl.trainer.grpo_trainer"
_WRAPPED = "_ds_hilore_exposure"
_SAID: set[str] = set()  # what the log said once already


def predicted_exposure(trainer, inputs) -> list[float] | None:
    """sum_t |A_i| m_{i,t} per sequence of ``inputs``, or None when a zero there might not be
    a zero coefficient (NOTE [ TRL exposure ])."""
    if getattr(trainer, "beta", None) != 0.0 or getattr(trainer, "_entropy_bonus_enabled", True) \
            or getattr(trainer, "aux_loss_enabled", True) \
            or getattr(trainer, "loss_type", None) not in LINEAR_IN_ADVANTAGE:
        return None
    advantages, mask = inputs.get("advantages"), inputs.get("completion_mask")
    if advantages is None or mask is None or advantages.dim() != 1 or mask.dim() != 2 \
            or advantages.shape[0] != mask.shape[0]:
        return None
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    return exposure.predicted(advantages, mask)


def install() -> bool:
    """Wrap the imported TRL's ``GRPOTrainer._compute_loss``; True when it is (or was) wrapped.
    Nothing happens when TRL's trainer is not imported; an unknown shape of it is said once."""
    module = sys.modules.get(_MODULE)
    trainer = getattr(module, "GRPOTrainer", None)
    if trainer is None:
        return False
    original = trainer.__dict__.get("_compute_loss")
    if getattr(original, _WRAPPED, False):
        return True
    if original is None or list(inspect.signature(original).parameters) != ["self", "model", "inputs"]:
        logger.info("ds_hilore: this TRL's GRPOTrainer has no _compute_loss(self, model, inputs); "
                    "its advantages are not handed to HiLoRe before the forward (the coefficients "
                    "after it still decide).")
        return False

    @functools.wraps(original)
    def _compute_loss(self, model, inputs):
        _hand(self, model, inputs)
        return original(self, model, inputs)

    setattr(_compute_loss, _WRAPPED, True)
    trainer._compute_loss = _compute_loss
    return True


def _hand(trainer, model, inputs) -> None:
    """Give the runtime of ``model`` (a DeepSpeed engine, or a module) the prediction."""
    runtime = getattr(model, "hilore", None)
    if runtime is None:
        from ds_hilore.runtime.core import find_runtime
        runtime = find_runtime(getattr(model, "module", model))
    if runtime is None or not getattr(model, "training", True):
        return
    predicted = predicted_exposure(trainer, inputs)
    if predicted is not None:
        runtime.expect(predicted)
    elif "none" not in _SAID:
        _SAID.add("none")
        logger.info("ds_hilore: this GRPOTrainer's loss may give a sequence with zero advantage a "
                    "non-zero coefficient (beta != 0, an entropy bonus, an auxiliary loss, per-token "
                    "advantages or loss_type %r); nothing is predicted before the forward.",
                    getattr(trainer, "loss_type", None))
