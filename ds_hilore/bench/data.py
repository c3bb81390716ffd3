"""GRPO-shaped data for ``hilore bench``: one optimizer step of every rank (pure).

``global_step(shape, vocab, seq_len, seed, index)`` draws step ``index`` of the run from
nothing but its arguments: ``ranks x grad_accum x micro_batch`` sequences of ``seq_len`` tokens
-- a prompt of ``seq_len // 4`` tokens, then a response of random length (a quarter of the rest
up to all of it) -- in GRPO groups of ``group_size`` completions of one prompt. A share
``zero_adv_share`` of the step's groups has no reward spread (every completion scored alike:
A = 0 exactly); the others mix rewards 0 and 1. On a share ``clip_share`` of the response
tokens the behaviour log-probs are off by ``CLIP_OFFSET`` from the policy's (the ratio
exp(logp - old) is outside the clip range [1 - 0.2, 1 + 0.28], so those tokens are clipped),
on the rest by at most ``NEAR_OFFSET`` (inside). The offsets are the data (``old_offset``):
the update reads old = logp.detach() + old_offset, so the clipped tokens stay clipped at any
weights and no forward is needed to make the data.

NOTE [ Layouts ]
``shuffled`` (the default): the step's sequences in a random order before they are cut into
microbatches, as TRL shuffles its generation batch: a group's completions land in several
microbatches (and ranks), so a microbatch is rarely all A = 0. ``grouped``: in group order, a
group never spans two microbatches (``group_size`` divides ``micro_batch``), as a trainer
that keeps a prompt's completions together lays them out; a microbatch of A = 0 groups is then
all zero. ``drop_zero_advantage`` is the filtered variant: the step's A = 0 completions are
dropped before the update and the rest, in order, is cut into the same ``ranks x grad_accum``
microbatches, as even as can be (DeepSpeed's gradient accumulation is a fixed count of
micro-steps), so a microbatch holds about half of ``micro_batch`` at ``zero_adv_share`` 0.5.
Rank r trains microbatches ``r * grad_accum`` to ``(r + 1) * grad_accum - 1``.
"""

from __future__ import annotations

import dataclasses

import torch

from ds_hilore.grpo import group_advantages

__all__ = ["CLIP_OFFSET", "EPSILON_HIGH", "EPSILON_LOW", "LAYOUTS", "NEAR_OFFSET", "Shape",
           "exposure", "global_step", "prediction", "rank_microbatches", "step_lengths",
           "tokens"]

EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28  # the bench's GRPO clip range (DAPO's clip-higher)
CLIP_OFFSET = 0.5  # |old - logp| on clipped tokens: ratio e^-0.5 = 0.61 or e^0.5 = 1.65
NEAR_OFFSET = 0.05  # at most this elsewhere: ratio within [0.951, 1.051]
LAYOUTS = ("shuffled", "grouped")  # NOTE [ Layouts ]


@dataclasses.dataclass(frozen=True)
class Shape:
    """What one optimizer step holds (the flags of the same names)."""

    micro_batch: int = 8
    group_size: int = 8
    grad_accum: int = 2
    ranks: int = 1
    zero_adv_share: float = 0.5
    clip_share: float = 0.1
    layout: str = "shuffled"
    drop_zero_advantage: bool = False

    @property
    def microbatches(self) -> int:
        """Microbatches of a step, every rank's."""
        return self.ranks * self.grad_accum

    @property
    def sequences(self) -> int:
        """Sequences of a step before any is dropped, every rank's."""
        return self.microbatches * self.micro_batch


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
    """(N, T-1) behaviour offsets: +-CLIP_OFFSET on round(share * response tokens) of them."""
    near = (torch.rand(mask.shape, generator=g) * 2 - 1) * NEAR_OFFSET  # (N, T-1)
    where = mask.flatten().nonzero().squeeze(1)
    n_clip = round(share * where.numel())
    pick = where[torch.randperm(where.numel(), generator=g)[:n_clip]]
    sign = torch.where(torch.rand(n_clip, generator=g) < 0.5, -1.0, 1.0)
    flat = near.flatten()
    flat[pick] = sign * CLIP_OFFSET
    return flat.view(mask.shape) * mask


def _sequences(shape: Shape, vocab: int, seq_len: int, g: torch.Generator) -> dict:
    """The step's sequences in group order: ids (N, T), mask (N, T-1), advantages (N,),
    old_offset (N, T-1), group (N,)."""
    n, t = shape.sequences, seq_len
    groups = n // shape.group_size
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


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges over n rows, sizes differing by at most one, larger first."""
    base, extra = divmod(n, parts)
    out, begin = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append((begin, begin + size))
        begin += size
    return out


def global_step(shape: Shape, vocab: int, seq_len: int, seed: int, index: int) -> list[dict]:
    """Step ``index``: every rank's microbatches (``shape.microbatches`` dicts of CPU tensors),
    laid out as NOTE [ Layouts ] says: ``input_ids`` (B, T) int64, ``mask`` (B, T-1) fp32
    (response tokens), ``advantages`` (B,) fp32, ``old_offset`` (B, T-1) fp32, ``group`` (B,)
    int64 (the prompt within the step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 100 + index)
    whole = _sequences(shape, vocab, seq_len, g)
    if shape.layout == "shuffled":
        order = torch.randperm(shape.sequences, generator=g)
        whole = {name: v[order] for name, v in whole.items()}
    if shape.drop_zero_advantage:
        keep = whole["advantages"] != 0
        whole = {name: v[keep] for name, v in whole.items()}
        cuts = _cuts(int(whole["input_ids"].shape[0]), shape.microbatches)
    else:
        cuts = [(i, i + shape.micro_batch) for i in range(0, shape.sequences, shape.micro_batch)]
    return [{name: v[a:b] for name, v in whole.items()} for a, b in cuts]


def rank_microbatches(step: list[dict], shape: Shape, rank: int) -> list[dict]:
    """The ``grad_accum`` microbatches of ``step`` (``global_step``) that ``rank`` trains."""
    return step[rank * shape.grad_accum:(rank + 1) * shape.grad_accum]


def step_lengths(lengths: list[int], steps: int, seed: int) -> list[int]:
    """Sequence length of each of ``steps`` steps, drawn from ``lengths`` (seeded), as rollouts
    of varying length give (the whole-run mode)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7)
    picks = torch.randint(0, len(lengths), (steps,), generator=g).tolist()
    return [lengths[i] for i in picks]


def exposure(micro: dict) -> list[float]:
    """Predicted exposure per sequence, |A_i| * response tokens_i (what ``expect`` takes before
    the forward: on-policy with beta = 0 a sequence's gradient scales with it)."""
    from ds_hilore.grpo.exposure import predicted

    return predicted(micro["advantages"], micro["mask"])


def prediction(step: list[dict]) -> tuple[float, int | None]:
    """(the step's predicted exposure summed over every rank's microbatches, how many of them
    are non-zero; None when none is) -- ``expect``'s step arguments, the same on every rank."""
    per_micro = [sum(exposure(m)) for m in step]
    exposed = sum(1 for p in per_micro if p > 0)
    return float(sum(per_micro)), (exposed or None)


def tokens(step: list[dict]) -> int:
    """Tokens of a step, every rank's (forwarded and backwarded)."""
    return sum(int(m["input_ids"].numel()) for m in step)
