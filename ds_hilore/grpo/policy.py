"""GRPO losses with exact per-token coefficients ω = ∂L/∂logp.

    adv = group_advantages(rewards, group_size=8)                      # (B,)
    logp = token_logprobs(hidden[:, :-1], model.lm_head, input_ids[:, 1:])  # (B, T) fp32, chunked
    out = policy_loss(logp, old_logp, adv, mask, loss_type="dapo",
                      num_items_in_batch=global_num_items(step_masks, gas))
    engine.backward(out.loss)      # out.coefficients: (B, T) detached ω, handed to the runtime

The loss variants are rows of tables in ``ds_hilore.grpo.losses`` (one per TRL ``loss_type``, ratio
level and KL estimator); this module validates, composes them and computes ω in closed form.

# NOTE [ Normalisation under DeepSpeed ]
One optimizer step runs G = gradient_accumulation_steps micro-steps on each of W data-parallel
ranks. ``engine.backward(loss)`` divides the loss by G (``scale_wrt_gas=True``, the default) and
accumulates; at the boundary ZeRO 0/1/2/3 sum the ranks' gradients and divide by W
(``gradient_predivide_factor`` f only splits that into 1/f before and f/W after). So the
gradient the optimizer sees is the mean of the G·W micro-step gradients:

    g = 1/(G·W) · Σ_{rank, micro-step} ∇ L_micro

``policy_loss`` returns L_micro for one micro-step and never divides by G itself (TRL's
grpo/bnpo/dr_grpo do, because HF's Trainer calls ``engine.backward(..., scale_wrt_gas=False)``
under DeepSpeed, transformers PR #35808; passing a TRL loss to a plain ``engine.backward`` would
divide twice). Per loss type:

* grpo, sapo  w = 1/(B·|o_i|): L_micro is the mean over its B rows of per-sequence token means, so
          g is that mean over all G·W·B sequences -- TRL's formula over the global batch, as
          long as every micro-batch counts the same B (DeepSpeed's fixed micro-batch size; after
          ``drop_zero_rows`` pass its ``loss_kwargs`` so B stays the original). Empty rows count.
* dr_grpo w = 1/(B·L_max): g = Σ_all ℓ·m / (G·W·B·L_max), the formula over G·W·B rows.
* luspo   w = 1/B: L_micro is the mean over its B rows of per-sequence sums, so g is that mean over
          all G·W·B sequences (each weighted by its length), as long as every micro-batch counts B.
* bnpo    w = 1/Σm of the micro-batch: g is the mean of per-micro-batch token means. That is
          TRL's definition ("batch" = one process's micro-batch) and is the global token mean
          only when all micro-batches hold equally many tokens; use dapo for the global mean.
* dapo, cispo, vespo  w = 1/num_items_in_batch. The formula is the global token mean
          g = Σ_all ∇(ℓ·m) / N,  N = active tokens over all W ranks and all G micro-steps of the
          optimizer step. DeepSpeed divides by G·W, so each micro-step must contribute
          Σ ℓ·m · (G·W)/N, i.e. pass   num_items_in_batch = N / (G·W)   (the mean active-token
          count per micro-batch), which ``global_num_items(masks, G)`` computes with one
          all_reduce. TRL's ``num_items_in_batch`` is N itself and its loss divides by N/W; to
          reuse it here pass N/(G·W). With ``engine.backward(loss, scale_wrt_gas=False)`` pass
          N/W instead (and divide grpo/bnpo/dr_grpo losses by G yourself).

Every rank must run the same G micro-steps (ZeRO's reductions are collectives); loss scaling for
fp16/bf16 does not change any of this. With sequence parallelism DeepSpeed divides by W / sp
instead of W; that case is not covered here. Checked on 2 CPU ranks with G = 2 for grpo and dapo
(tests/test_grpo_distributed.py: the engine's gradient equals the formula's to ~1e-7 relative).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from ds_hilore.grpo import handoff
from ds_hilore.grpo.logprobs import token_logprobs
from ds_hilore.grpo.losses import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    RATIO_LEVELS,
    Clip,
    Normaliser,
    Surrogate,
)

__all__ = [
    "PolicyLoss",
    "RowSelection",
    "drop_zero_rows",
    "global_num_items",
    "group_advantages",
    "policy_loss",
    "token_logprobs",
]


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """What ``policy_loss`` returns for one microbatch."""

    loss: Tensor  # 0-dim, differentiable; pass it to engine.backward
    coefficients: Tensor  # (B, T) detached ω = ∂loss/∂logp, dtype of logp
    metrics: dict[str, float]  # see _METRIC_DOCS


_METRIC_DOCS = {
    "clip_fraction_low": "share of active tokens (sequence level: rows) clipped below, A < 0 (0 for sapo, vespo)",
    "clip_fraction_high": "share clipped above, A > 0 (cispo: ratio capped at epsilon_high)",
    "clip_fraction_dual": "share with A < 0 and ratio > dual_clip (0 when dual_clip is None)",
    "mean_kl": "mean KL estimate over active tokens (nan without ref_logp)",
    "zero_fraction": "share of active tokens whose ω is exactly 0",
    "top10_share": "share of Σ|ω| carried by the top 10 % of active tokens (nan when Σ|ω| = 0)",
    "active_tokens": "number of tokens with mask != 0",
}


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def _scale_group(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    return centred / (grouped.std(dim=1, keepdim=True) + eps)  # TRL: std per group (unbiased)


def _scale_batch(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    return centred / (grouped.std() + eps)  # TRL: std over the whole batch


ADVANTAGE_SCALES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "group": _scale_group,
    "batch": _scale_batch,
    "none": lambda centred, grouped, eps: centred,
}


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """GRPO advantages ``(r - mean_group(r)) / (std + eps)`` as TRL computes them (``scale_rewards``).

    Rows are grouped consecutively: ``rewards[k*G:(k+1)*G]`` are the G completions of prompt k.
    A group whose rewards are all equal gets advantages of exactly 0 (a float mean can miss the
    common value by one ulp, which would leave ~1e-13 where exactness matters: such sequences
    contribute nothing to the gradient when β = 0, see ``drop_zero_rows``).

    Args:
        rewards: (B,) floating, B a multiple of ``group_size``.
        group_size: completions per prompt (TRL's ``num_generations``).
        scale: one of ``ADVANTAGE_SCALES``: "group" | "batch" | "none".
        eps: added to the standard deviation (TRL: 1e-4).

    Returns:
        (B,) advantages, dtype of ``rewards``.
    """
    scale_fn = _lookup(ADVANTAGE_SCALES, scale, "scale")
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError("group_advantages: rewards must be a 1-D floating tensor (B,).")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: group_size={group_size} must be >= 1 and divide the {rewards.numel()} rewards."
        )
    grouped = rewards.reshape(-1, group_size)  # (n_groups, G)
    if group_size == 1:
        return torch.zeros_like(rewards)  # TRL: std := 0, centred reward 0
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    adv = scale_fn(centred, grouped, eps)
    uniform = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # (n_groups, 1)
    return torch.where(uniform, 0.0, adv).reshape(-1).to(rewards.dtype)


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "grpo",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    dual_clip: float | None = None,
    kl_estimator: str = "k3",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    batch_size: int | None = None,
    batch_tokens: Tensor | None = None,
    model: torch.nn.Module | None = None,
) -> PolicyLoss:
    """GRPO-family policy loss of one microbatch and its exact per-token coefficients.

    ``loss = Σ_{i,t} w_{i,t} m_{i,t} (ℓ_{i,t} + β κ_{i,t})`` with TRL's surrogate ℓ, aggregation
    weight w and KL estimator κ (``ds_hilore.grpo.losses``); ``coefficients`` is ∂loss/∂logp in closed
    form (no extra backward). If a HiLoRe runtime is attached (to ``model``, or the only one),
    ω is handed to it before the backward starts.

    Args:
        logp: (B, T) log-probs of the sampled tokens under the policy (floating, requires grad).
        old_logp: (B, T) behaviour log-probs, or None for on-policy (TRL: ``logp.detach()``).
        advantages: (B,) per-sequence advantages.
        mask: (B, T) completion mask (bool or 0/1 numbers); rows may be empty.
        loss_type: one of ``LOSS_TYPES``: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo.
        ref_logp: (B, T) reference log-probs; required when ``beta != 0``.
        beta: KL coefficient (>= 0).
        epsilon_low, epsilon_high: clip range ``[1 - low, 1 + high]``; high defaults to low. For
            cispo ``epsilon_high`` is the absolute ratio cap ε_max (TRL; ScaleRL recommends 5.0).
        dual_clip: TRL's ``delta``: the ratio is capped at this value (> 1; TRL recommends > 1 + ε),
            which zeroes the gradient of A < 0 tokens whose ratio exceeds it. Not for cispo.
        kl_estimator: one of ``KL_ESTIMATORS``: k1, k2, k3 (TRL uses k3).
        importance_sampling_level: one of ``RATIO_LEVELS``: "token", or "sequence" (GSPO; luspo's
            recommended level). vespo forms its own sequence weight from the per-token ratios and
            ignores it, as TRL does.
        max_completion_length: dr_grpo's constant length L_max.
        num_items_in_batch: dapo/cispo/vespo normaliser; see NOTE [ Normalisation under DeepSpeed ].
        sapo_temperature_pos, sapo_temperature_neg: sapo's gate temperatures τ for A > 0 and A <= 0
            (> 0; TRL's defaults).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: vespo's Gamma weight
            φ(w) = e^λ w^k e^(-λw) for A >= 0 and A < 0 (TRL's defaults).
        batch_size, batch_tokens: normaliser overrides after ``drop_zero_rows`` (its ``loss_kwargs``).
        model: the module that produced ``logp``, to pick its runtime for the hand-off.

    Returns:
        ``PolicyLoss(loss, coefficients, metrics)``.

    Raises:
        ValueError / TypeError: unknown names (the message lists the known ones), bad shapes or
            dtypes, a missing normaliser, an all-zero mask.
    """
    variant = _lookup(LOSS_TYPES, loss_type, "loss_type")
    level = _lookup(RATIO_LEVELS, importance_sampling_level, "importance_sampling_level")
    if variant.token_ratios:
        level = RATIO_LEVELS["token"]
    kl = _lookup(KL_ESTIMATORS, kl_estimator, "kl_estimator")
    dtype = _check_tensors(logp, old_logp, advantages, mask, ref_logp, beta)
    clip = _clip_from(loss_type, variant.surrogate, epsilon_low, epsilon_high, dual_clip)
    clip = _gates_from(clip, sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                       vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                       vespo_lambda_neg=vespo_lambda_neg)

    m = mask.to(dtype)  # (B, T)
    lengths = m.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1) |o_i|
    norm = Normaliser(
        batch_size=logp.shape[0] if batch_size is None else batch_size,
        batch_tokens=m.sum() if batch_tokens is None else batch_tokens,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    _check_normaliser(loss_type, variant.needs, norm, logp.shape[0], m)

    # NOTE [ Masked positions ]: padded positions may hold anything (-inf, NaN, stale values);
    # they are replaced by 0 *before* any arithmetic, so 0 · inf never turns the loss or ω into
    # NaN, and torch.where routes no gradient to them.
    active = m != 0  # (B, T)
    lp = torch.where(active, logp.to(dtype), 0.0)
    old = lp.detach() if old_logp is None else torch.where(active, old_logp.to(dtype), 0.0)
    adv = advantages.to(dtype).unsqueeze(-1)  # (B, 1)
    wm = variant.weight(lengths, norm) * m  # (B, T) w_{i,t} m_{i,t}
    log_weight = level.log_weight(lp - old, m, lengths)  # (B, T) token level, (B, 1) sequence level
    per_token = variant.surrogate.loss(lp, log_weight, adv, clip)
    delta = None if ref_logp is None else torch.where(active, ref_logp.to(dtype), 0.0) - lp  # log(π_ref/π)
    if beta != 0.0:
        per_token = per_token + beta * kl.value(delta)
    loss = (per_token * wm).sum()

    with torch.no_grad():
        lw = log_weight.detach()
        d_lw, d_direct = variant.surrogate.grads(lp.detach(), lw, adv, clip)
        omega = torch.zeros_like(wm)  # (B, T)
        if d_direct is not None:
            omega += wm * d_direct
        if d_lw is not None:
            omega += level.chain(d_lw, wm, m, lengths)
        if beta != 0.0:
            omega += beta * wm * kl.dlogp(delta.detach())
        omega = omega.to(logp.dtype)
        kl_value = None if delta is None else kl.value(delta.detach())
        metrics = _metrics(omega, m, variant.surrogate.flags(lw, adv, clip), kl_value)

    _hand_off(omega, logp, model=model)
    return PolicyLoss(loss=loss, coefficients=omega, metrics=metrics)


def _lookup(table: dict, name, key: str):
    if name not in table:
        raise ValueError(f"{key}={name!r} is not known; known: {', '.join(table)}.")
    return table[name]


def _check_tensors(logp, old_logp, advantages, mask, ref_logp, beta) -> torch.dtype:
    """Validates shapes and dtypes; returns the compute dtype (fp32, or fp64 if an input is)."""
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError(f"policy_loss: logp must be a (B, T) tensor, got {_shape(logp)}.")
    shape = tuple(logp.shape)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if x is not None and (not isinstance(x, Tensor) or tuple(x.shape) != shape):
            raise ValueError(f"policy_loss: {name} must have logp's shape {shape}, got {_shape(x)}.")
    if mask is None:
        raise ValueError("policy_loss: mask is required ((B, T), 1 for completion tokens).")
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"policy_loss: advantages must be ({shape[0]},), one per sequence, got {_shape(advantages)}."
        )
    floats = [("logp", logp), ("old_logp", old_logp), ("ref_logp", ref_logp), ("advantages", advantages)]
    for name, x in floats:
        if x is not None and not x.is_floating_point():
            raise TypeError(f"policy_loss: {name} must be floating, got {x.dtype}.")
    if mask.is_complex():
        raise TypeError(f"policy_loss: mask must be bool or real numbers, got {mask.dtype}.")
    if not beta >= 0.0:
        raise ValueError(f"policy_loss: beta must be >= 0, got {beta}.")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("policy_loss: beta != 0 needs ref_logp (the reference model's (B, T) log-probs).")
    dtype = torch.float32
    for _, x in floats:
        if x is not None:
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__


def _clip_from(loss_type, surrogate: Surrogate, epsilon_low, epsilon_high, dual_clip) -> Clip:
    if surrogate.needs_epsilon_high and epsilon_high is None:
        raise ValueError(
            f"policy_loss: loss_type={loss_type!r} caps the ratio at epsilon_high (ε_max, TRL/ScaleRL recommend "
            "5.0); TRL would silently default it to epsilon_low=0.2. Pass epsilon_high explicitly."
        )
    high = epsilon_low if epsilon_high is None else epsilon_high
    if not (epsilon_low >= 0.0 and high >= 0.0):
        raise ValueError(f"policy_loss: epsilon_low and epsilon_high must be >= 0, got {epsilon_low}, {high}.")
    if dual_clip is not None and not surrogate.uses_dual_clip:
        raise ValueError(f"policy_loss: dual_clip does not apply to loss_type={loss_type!r}; leave it None.")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"policy_loss: dual_clip must be > 1 (TRL recommends > 1 + epsilon_high), got {dual_clip}.")
    return Clip(low=float(epsilon_low), high=float(high), dual=None if dual_clip is None else float(dual_clip))


def _gates_from(clip: Clip, **gates: float) -> Clip:
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not gates[name] > 0.0:
            raise ValueError(f"policy_loss: {name} must be > 0 (sapo divides by it), got {gates[name]}.")
    return dataclasses.replace(clip, **{name: float(value) for name, value in gates.items()})


def _check_normaliser(loss_type, needs, norm: Normaliser, rows: int, m: Tensor) -> None:
    if "max_completion_length" in needs and not (norm.max_completion_length or 0) >= 1:
        raise ValueError(
            f"policy_loss: loss_type={loss_type!r} normalises by B * max_completion_length; pass "
            f"max_completion_length (the generation limit), got {norm.max_completion_length}."
        )
    if "num_items_in_batch" in needs:
        if norm.num_items_in_batch is None or not float(norm.num_items_in_batch) > 0:
            raise ValueError(
                f"policy_loss: loss_type={loss_type!r} normalises by num_items_in_batch (> 0), got "
                f"{norm.num_items_in_batch}; under DeepSpeed pass global_num_items(masks, "
                "gradient_accumulation_steps) -- see NOTE [ Normalisation under DeepSpeed ] in ds_hilore.grpo."
            )
    if norm.batch_size < rows:
        raise ValueError(f"policy_loss: batch_size={norm.batch_size} is smaller than the {rows} rows given.")
    active, longest = torch.stack([(m != 0).sum().to(m.dtype), m.sum(-1).amax()]).tolist()
    if active == 0:
        raise ValueError(
            "policy_loss: the mask has no active token, so the loss would be 0/0; skip this microbatch's "
            "loss (still run a backward on every rank) or keep at least one completion token."
        )
    if "max_completion_length" in needs and longest > norm.max_completion_length:
        raise ValueError(
            f"policy_loss: a row has {longest:g} active tokens > max_completion_length="
            f"{norm.max_completion_length}; pass the true generation limit."
        )


def _metrics(omega: Tensor, m: Tensor, flags: dict[str, Tensor], kl_value: Tensor | None) -> dict[str, float]:
    active = m != 0  # (B, T)
    n = active.sum()

    def share(flag: Tensor) -> Tensor:  # TRL's masked_batch_mean: rows at sequence level
        return flag.float().mean() if flag.shape[-1] == 1 else (flag & active).sum() / n

    nan = torch.tensor(float("nan"))
    values = {
        "clip_fraction_low": share(flags["low"]),
        "clip_fraction_high": share(flags["high"]),
        "clip_fraction_dual": share(flags["dual"]) if "dual" in flags else torch.tensor(0.0),
        "mean_kl": nan if kl_value is None else (kl_value * m).sum() / n,
        "zero_fraction": ((omega == 0) & active).sum() / n,
        "active_tokens": n,
    }
    mass = omega.abs()[active].double()  # (n,)
    k = max(1, math.ceil(0.1 * mass.numel()))
    total = mass.sum()
    values["top10_share"] = torch.where(total > 0, mass.topk(k).values.sum() / total, nan.double())
    read = torch.stack([v.detach().double().to(omega.device) for v in values.values()]).tolist()
    return dict(zip(values, read))  # one read of the device for all metrics


def _hand_off(coefficients: Tensor, logp: Tensor, model: torch.nn.Module | None = None) -> None:
    """Gives ω to the HiLoRe runtime of ``model`` (or the only attached one) before the backward."""
    if not (torch.is_grad_enabled() and logp.requires_grad):
        return  # evaluation: no backward will follow, nothing was captured
    handoff.publish(coefficients, logp, model)


# ---------------------------------------------------------------------------------------------
# Zero rows and the DeepSpeed normaliser
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowSelection:
    """Rows kept by ``drop_zero_rows`` and what the loss needs to keep its normaliser."""

    index: Tensor  # (B',) int64, kept rows in their original order
    batch_size: int  # B before dropping
    batch_tokens: Tensor  # 0-dim, Σ mask before dropping (bnpo)

    def select(self, x: Tensor) -> Tensor:
        """The kept rows of any (B, ...) tensor: input_ids, masks, old/ref log-probs, advantages."""
        return x.index_select(0, self.index.to(x.device))

    @property
    def loss_kwargs(self) -> dict:
        """Pass to ``policy_loss(**sel.loss_kwargs)`` so w_{i,t} stays that of the full microbatch."""
        return {"batch_size": self.batch_size, "batch_tokens": self.batch_tokens}

    @property
    def dropped(self) -> int:
        return self.batch_size - int(self.index.numel())


def drop_zero_rows(advantages: Tensor, mask: Tensor, *, beta: float = 0.0) -> RowSelection:
    """Rows of a microbatch that can be removed before the forward without changing the gradient.

    With β = 0 a sequence whose advantage is exactly 0 (or whose mask is empty) has ω ≡ 0 under
    every loss type and ratio level, so it contributes nothing to any parameter gradient (causal
    attention never mixes sequences). Dropping it saves its forward and backward; keeping the
    normaliser (``loss_kwargs``; dapo's ``num_items_in_batch`` must still count its tokens, as
    TRL's does) leaves every other row's ω, hence the gradient, unchanged. At least one row is
    kept (one with a completion token where any row has one, so its loss is defined), so every
    rank still runs a backward and ZeRO's reductions do not hang.

    "Unchanged" is exact in value; in floating point, parameter gradients that sum over all
    positions (norm weights, biases) are bitwise equal only while the shorter sum adds the same
    partial sums in the same order (on CPU: T a multiple of 16 and B·T <= 256, NOTE [ Bitwise
    shapes ] in tests/test_grpo.py); otherwise they differ at rounding level (~1e-10 relative).

    Args:
        advantages: (B,) advantages of the microbatch.
        mask: (B, T) completion mask.
        beta: the KL coefficient of the loss; must be 0 (the KL term's gradient does not vanish
            with A = 0).

    Returns:
        ``RowSelection``; apply ``sel.select`` to each (B, ...) input and pass ``sel.loss_kwargs``.
    """
    if beta != 0.0:
        raise ValueError(
            f"drop_zero_rows: beta={beta} -- with a KL term a sequence with A = 0 still has a gradient; "
            "only beta == 0 allows dropping rows."
        )
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"drop_zero_rows: need advantages (B,) and mask (B, T), got {_shape(advantages)} and {_shape(mask)}."
        )
    live = (advantages != 0) & (mask != 0).any(dim=-1)  # (B,)
    index = live.nonzero().flatten()
    if index.numel() == 0:  # keep one row, with a token if any has one: ω ≡ 0 there, the loss 0
        with_tokens = (mask != 0).any(dim=-1).nonzero().flatten()
        index = (with_tokens[:1] if with_tokens.numel()
                 else torch.zeros(1, dtype=torch.long, device=advantages.device))
    # Σ mask in the dtype policy_loss uses, so the normaliser is bitwise the full batch's one.
    batch_tokens = mask.to(torch.promote_types(torch.float32, advantages.dtype)).sum()
    return RowSelection(index=index, batch_size=int(advantages.shape[0]), batch_tokens=batch_tokens)


def global_num_items(
    masks: Tensor | Sequence[Tensor], gradient_accumulation_steps: int, group=None
) -> float:
    """dapo/cispo's ``num_items_in_batch`` for one optimizer step under DeepSpeed: N / (G · W).

    N = active tokens over this rank's ``masks`` (all G micro-steps of the step: a list of (B, T)
    masks, or one tensor holding them all) summed over the W ranks of ``group`` with an
    all_reduce when torch.distributed is initialised. See NOTE [ Normalisation under DeepSpeed ].
    Call it at the same point on every rank (it is a collective).
    """
    parts = [masks] if isinstance(masks, Tensor) else list(masks)
    if not parts:
        raise ValueError("global_num_items: masks is empty; pass the masks of this rank's micro-steps.")
    if gradient_accumulation_steps < 1:
        raise ValueError(f"global_num_items: gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}.")
    if not isinstance(masks, Tensor) and len(parts) != gradient_accumulation_steps:
        raise ValueError(
            f"global_num_items: got {len(parts)} masks for gradient_accumulation_steps={gradient_accumulation_steps}; "
            "pass one mask per micro-step of the optimizer step."
        )
    count = sum((p != 0).sum().to(torch.float64) for p in parts)  # 0-dim
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.SUM, group=group)
        world = torch.distributed.get_world_size(group)
    return float(count) / (gradient_accumulation_steps * world)
