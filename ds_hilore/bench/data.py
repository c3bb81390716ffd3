"""GRPO-shaped data for ``hilore bench``: optimizer steps of accumulated microbatches (pure).

``grpo_steps(shape, vocab, seed)`` draws the steps from nothing but its arguments: per step,
``shape.grad_accum`` microbatches of ``shape.micro_batch`` sequences of ``shape.seq_len`` tokens
-- a prompt of ``seq_len // 4`` tokens, then a response of random length (a quarter of the rest
up to all of it) -- in groups of ``shape.group_size`` completions of one prompt (a group never
spans two microbatches). A share ``zero_adv_share`` of the step's groups has no reward spread
(every completion scored alike: A = 0 exactly); the others mix rewards 0 and 1. On a share
``clip_share`` of the response tokens the behaviour log-probs are off by ``CLIP_OFFSET`` from
the policy's (the ratio exp(logp - old) is outside the clip range [1 - 0.2, 1 + 0.28] at the
initial weights, so those tokens are clipped), on the rest by at most ``NEAR_OFFSET`` (inside).
The offsets are returned (``old_offset``); the behaviour log-probs themselves are the policy's
plus them (``attach_behaviour``, the one step that runs the model).

``drop_zero_advantage`` is the filtered variant (prime-rl's default): the step's A = 0
completions are dropped before the update, and the rest is repacked, in order, into microbatches
of ``micro_batch`` sequences (the last one may be shorter).
"""

from __future__ import annotations

import dataclasses

import torch

from ds_hilore.grpo import group_advantages

__all__ = ["CLIP_OFFSET", "EPSILON_HIGH", "EPSILON_LOW", "NEAR_OFFSET", "GrpoShape",
           "attach_behaviour", "exposure", "grpo_steps"]

EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28  # the bench's GRPO clip range (DAPO's clip-higher)
CLIP_OFFSET = 0.5  # |old - logp| on clipped tokens: ratio e^-0.5 = 0.61 or e^0.5 = 1.65
NEAR_OFFSET = 0.05  # at most this elsewhere: ratio within [0.951, 1.051]


@dataclasses.dataclass(frozen=True)
class GrpoShape:
    """What one optimizer step of the bench holds (the flags of the same names)."""

    micro_batch: int = 8
    seq_len: int = 256
    group_size: int = 8
    grad_accum: int = 2
    zero_adv_share: float = 0.5
    clip_share: float = 0.1
    drop_zero_advantage: bool = False


def _rewards(groups: int, size: int, zero: set[int], g: torch.Generator) -> torch.Tensor:
    """(groups * size,) rewards: uniform within the ``zero`` groups, mixed 0 / 1 elsewhere."""
    out = []
    for k in range(groups):
        if k in zero:
            out.append(torch.full((size,), float(torch.randint(0, 2, (1,), generator=g))))
            continue
        r = (torch.rand(size, generator=g) < 0.5).float()
        if size > 1:
            r[0], r[-1] = 1.0, 0.0  # spread, whatever the draw
        out.append(r)
    return torch.cat(out)


def _offsets(mask: torch.Tensor, share: float, g: torch.Generator) -> torch.Tensor:
    """(B, T-1) behaviour offsets: +-CLIP_OFFSET on round(share * response tokens) of them."""
    near = (torch.rand(mask.shape, generator=g) * 2 - 1) * NEAR_OFFSET  # (B, T-1)
    where = mask.flatten().nonzero().squeeze(1)
    n_clip = round(share * where.numel())
    pick = where[torch.randperm(where.numel(), generator=g)[:n_clip]]
    sign = torch.where(torch.rand(n_clip, generator=g) < 0.5, -1.0, 1.0)
    flat = near.flatten()
    flat[pick] = sign * CLIP_OFFSET
    return flat.view(mask.shape) * mask


def _step(shape: GrpoShape, vocab: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One step's sequences, unsplit: ids (N, T), mask (N, T-1), advantages, offsets."""
    n = shape.micro_batch * shape.grad_accum
    t, groups = shape.seq_len, n // shape.group_size
    zero = set(torch.randperm(groups, generator=g)[:round(shape.zero_adv_share * groups)].tolist())
    rewards = _rewards(groups, shape.group_size, zero, g)  # (N,)
    advantages = group_advantages(rewards, shape.group_size).float()  # (N,), exact 0 in `zero`
    ids = torch.randint(0, vocab, (n, t), generator=g)  # (N, T)
    prompt = t // 4
    lengths = torch.randint(max(1, (t - prompt) // 4), t - prompt + 1, (n,), generator=g)  # (N,)
    pos = torch.arange(1, t)[None, :]  # predicted positions 1 .. T-1
    mask = ((pos >= prompt) & (pos < prompt + lengths[:, None])).float()  # (N, T-1)
    return {"input_ids": ids, "mask": mask, "advantages": advantages,
            "old_offset": _offsets(mask, shape.clip_share, g),
            "group": torch.arange(n) // shape.group_size}


def grpo_steps(shape: GrpoShape, vocab: int, steps: int, seed: int) -> list[list[dict]]:
    """``steps`` optimizer steps, each a list of microbatch dicts (CPU tensors): ``input_ids``
    (B, T) int64, ``mask`` (B, T-1) fp32 (response tokens), ``advantages`` (B,) fp32,
    ``old_offset`` (B, T-1) fp32 and ``group`` (B,) int64 (the prompt within the step)."""
    out = []
    for k in range(steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + 100 + k)
        whole = _step(shape, vocab, g)
        if shape.drop_zero_advantage:
            keep = whole["advantages"] != 0
            whole = {name: v[keep] for name, v in whole.items()}
        n = whole["input_ids"].shape[0]
        out.append([{name: v[i:i + shape.micro_batch] for name, v in whole.items()}
                    for i in range(0, n, shape.micro_batch)])
    return out


def exposure(micro: dict[str, torch.Tensor]) -> list[float]:
    """Predicted exposure per sequence, |A_i| * response tokens_i (what ``Scheduler.expect``
    takes before the forward: on-policy with beta = 0 a sequence's gradient scales with it)."""
    from ds_hilore.grpo.exposure import predicted

    return predicted(micro["advantages"], micro["mask"])


def attach_behaviour(steps: list[list[dict]], logprobs, device) -> list[list[dict]]:
    """Every microbatch moved to ``device`` with ``old_logp`` = the policy's log-probs at the
    initial weights (``logprobs(ids)``, no grad) plus ``old_offset``."""
    out = []
    for micro_batches in steps:
        moved = []
        for micro in micro_batches:
            m = {k: v.to(device) for k, v in micro.items()}
            with torch.no_grad():
                m["old_logp"] = logprobs(m["input_ids"]).float() + m["old_offset"]  # (B, T-1)
            moved.append(m)
        out.append(moved)
    return out
