"""`hilore grpo-demo`: how concentrated is one GRPO update?

Builds a synthetic GRPO batch (binary rewards per group of completions, variable lengths, one
update off-policy so some ratios leave the clip range) and prints, for every loss type, ratio
level and with / without a KL term, the share of active tokens whose coefficient ω is exactly
zero and the share of Σ|ω| carried by the top 10 % of tokens.
"""

from __future__ import annotations

import torch

from ds_hilore.grpo import group_advantages, policy_loss
from ds_hilore.grpo.losses import LOSS_TYPES, RATIO_LEVELS

__all__ = ["demo"]


def _demo_batch(prompts: int, group: int, length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = prompts * group
    solve_rate = torch.rand(prompts, 1, generator=g) ** 2  # some prompts never/always solved
    solve_rate[0], solve_rate[1] = 0.0, 1.0
    rewards = (torch.rand(prompts, group, generator=g) < solve_rate).float().reshape(-1)  # (B,) 0/1
    lengths = torch.randint(length // 8, length + 1, (b,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]  # (B, T)
    logp = -torch.rand(b, length, generator=g).pow(2) * 4  # (B, T) log-probs in (-4, 0]
    old = logp + 0.15 * torch.randn(b, length, generator=g)  # one step off-policy: ratios ≠ 1
    ref = logp + 0.05 * torch.randn(b, length, generator=g)
    return {"rewards": rewards, "mask": mask, "logp": logp, "old": old, "ref": ref}


def demo(prompts: int = 16, group: int = 8, length: int = 512, seed: int = 0) -> None:
    """Prints coefficient statistics of a synthetic GRPO batch for each loss type."""
    data = _demo_batch(prompts, group, length, seed)
    adv = group_advantages(data["rewards"], group)
    zero_rows = int(((adv == 0) | ~data["mask"].any(-1)).sum())
    print(f"synthetic batch: {prompts} prompts x {group} completions, T={length}, "
          f"{int(data['mask'].sum())} active tokens, one update off-policy (log-ratio sd 0.15)")
    print(f"sequences with A = 0 (uniform group reward): {zero_rows}/{adv.numel()} -> ω ≡ 0, "
          f"droppable before the forward when beta = 0")
    header = f"{'loss_type':>9} {'level':>8} {'beta':>5} | {'ω=0':>6} {'top10%':>7} {'clip lo':>7} {'clip hi':>7}"
    print(header + "\n" + "-" * len(header))
    for loss_type in LOSS_TYPES:
        for level in RATIO_LEVELS:
            for beta in (0.0, 0.04):
                out = policy_loss(
                    data["logp"].clone().requires_grad_(), data["old"], adv, data["mask"],
                    loss_type=loss_type, ref_logp=data["ref"], beta=beta,
                    epsilon_high=5.0 if loss_type == "cispo" else 0.28,  # cispo: the ratio cap ε_max
                    importance_sampling_level=level, max_completion_length=length,
                    num_items_in_batch=data["mask"].sum(),
                )
                mt = out.metrics
                top = mt["top10_share"]  # NaN where every ω is 0 (no group with a reward spread)
                top = f"{top:>7.1%}" if top == top else f"{'-':>7}"
                print(f"{loss_type:>9} {level:>8} {beta:>5.2f} | {mt['zero_fraction']:>6.1%} "
                      f"{top} {mt['clip_fraction_low']:>7.1%} {mt['clip_fraction_high']:>7.1%}")
    print("ω=0: active tokens with exactly zero coefficient (A = 0 rows, clipped tokens); "
          "top10%: share of Σ|ω| on the 10 % largest-|ω| tokens (-: Σ|ω| is 0).")


