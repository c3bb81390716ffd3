"""GRPO losses with exact per-token coefficients ω = ∂L/∂logp, chunked token log-probs, and the
exposure of recovery units to the current update (``exposure``).

Math only: nothing here imports the runtime; ω reaches it through ``handoff``.
"""

from ds_hilore.grpo import exposure  # ``ds_hilore.grpo.exposure.predicted`` after ``import ds_hilore``
from ds_hilore.grpo.policy import (
                                   PolicyLoss,
                                   RowSelection,
                                   drop_zero_rows,
                                   global_num_items,
                                   group_advantages,
                                   policy_loss,
                                   token_logprobs,
)

__all__ = ["exposure", "PolicyLoss", "RowSelection", "drop_zero_rows", "global_num_items", "group_advantages",
           "policy_loss", "token_logprobs"]
