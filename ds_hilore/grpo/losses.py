"""GRPO loss variants as data: surrogates, aggregation weights, KL estimators, ratio levels.

Every variant TRL's ``GRPOTrainer._compute_loss`` offers is one entry in a table here, and each
entry knows both its loss (written as TRL writes it, so autograd sees the same graph) and the
derivative of that loss with respect to the per-token log-prob in closed form. ``ds_hilore.grpo``
composes them; this module holds no state and imports nothing from the rest of the package.

Notation: per token t of sequence i, ``logp`` the policy log-prob, ``old`` the
behaviour log-prob, ``ref`` the reference log-prob, ``m`` the loss mask, ``A`` the advantage,
``w`` the aggregation weight of the loss type. The loss of every variant is

    L = Σ_{i,t} w_{i,t} · m_{i,t} · (ℓ_{i,t} + β · κ_{i,t})

with ℓ the surrogate's per-token loss and κ the KL estimator; hence

    ω_{i,t} = ∂L/∂logp_{i,t} = w·m·(∂ℓ/∂logp + β · κ'(logp))

where ∂ℓ/∂logp reaches logp directly (cispo) and through the log importance weight (token level:
the token's own log-ratio; sequence level: the masked mean of the sequence's log-ratios).

Source followed: huggingface/trl ``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``
(the version with ``loss_type in ["cispo", "dapo"]`` sharing ``num_items_in_batch``, two-sided
clipping via ``args.delta``, ``importance_sampling_level``), and ``GRPOConfig``'s field docs;
sapo, luspo, vespo and ``GRPOTrainer.get_gamma_weights`` as in TRL 1.16.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "Clip",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "RATIO_LEVELS",
    "KLEstimator",
    "LossType",
    "Normaliser",
    "RatioLevel",
    "Surrogate",
]


@dataclasses.dataclass(frozen=True)
class Clip:
    """Parameters of the surrogates. Clipping, TRL's names in brackets: ``low`` (epsilon),
    ``high`` (epsilon_high), ``dual`` (delta, "two-sided" clipping from INTELLECT-2; None = off).
    The soft gates of sapo and vespo carry TRL's names and defaults."""

    low: float
    high: float
    dual: float | None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclasses.dataclass(frozen=True)
class Normaliser:
    """What the aggregation weights of one microbatch are computed from."""

    batch_size: int  # rows B of the microbatch as the normaliser counts them (empty rows included)
    batch_tokens: Tensor  # 0-dim: Σ m over the microbatch (bnpo)
    max_completion_length: int | None  # dr_grpo's constant sequence length
    num_items_in_batch: float | Tensor | None  # dapo / cispo; see NOTE [ Normalisation under DeepSpeed ]


# ---------------------------------------------------------------------------------------------
# Surrogates: per-token loss ℓ as a function of the importance weight c = exp(log_weight).
# ``grads`` returns (∂ℓ/∂log_weight, ∂ℓ/∂logp through the direct path), each None when absent.
# ---------------------------------------------------------------------------------------------


def _min_split(x1: Tensor, x2: Tensor) -> tuple[Tensor, Tensor]:
    """How ``torch.min(x1, x2)`` routes its gradient: all to the smaller input, half each on a tie."""
    s1 = torch.where(x1 < x2, 1.0, torch.where(x1 == x2, 0.5, 0.0)).to(x1.dtype)
    return s1, 1.0 - s1


def _clipped_loss(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip) -> Tensor:
    # TRL: coef_2 = clamp(coef_1, 1 - ε_low, 1 + ε_high); coef_1 = clamp(coef_1, max=delta);
    #      per_token_loss = -min(coef_1 · A, coef_2 · A)
    coef_1 = torch.exp(log_weight)  # (B, T) or (B, 1)
    coef_2 = torch.clamp(coef_1, 1.0 - clip.low, 1.0 + clip.high)
    if clip.dual is not None:
        coef_1 = torch.clamp(coef_1, max=clip.dual)
    return -torch.min(coef_1 * adv, coef_2 * adv)


def _clipped_grads(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip):
    # d/dlw of -min(c1·A, c2·A): clamp passes the gradient on its closed interval, exp' = exp,
    # applied last as autograd does (a ratio that overflows to inf gives NaN there, never 0).
    c = torch.exp(log_weight)
    c1, pass1 = c, 1.0
    if clip.dual is not None:
        c1 = torch.clamp(c, max=clip.dual)
        pass1 = (c <= clip.dual).to(c.dtype)
    c2 = torch.clamp(c, 1.0 - clip.low, 1.0 + clip.high)
    pass2 = ((c >= 1.0 - clip.low) & (c <= 1.0 + clip.high)).to(c.dtype)
    s1, s2 = _min_split(c1 * adv, c2 * adv)
    return -adv * (s1 * pass1 + s2 * pass2) * c, None


def _clipped_flags(log_weight: Tensor, adv: Tensor, clip: Clip) -> dict[str, Tensor]:
    # TRL's metrics: is_low_clipped = (coef_1 < 1 - ε_low) & (A < 0), is_high_clipped likewise.
    c = torch.exp(log_weight)
    flags = {"low": (c < 1.0 - clip.low) & (adv < 0), "high": (c > 1.0 + clip.high) & (adv > 0)}
    if clip.dual is not None:
        flags["dual"] = (c > clip.dual) & (adv < 0)
    return flags


def _cispo_loss(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip) -> Tensor:
    # TRL: clamped_ratios = clamp(coef_1, max=epsilon_high).detach(); loss = -clamped · A · logp.
    # epsilon_high is the absolute cap ε_max here (ScaleRL recommends 5.0), not 1 + ε.
    capped = torch.clamp(torch.exp(log_weight), max=clip.high).detach()
    return -capped * adv * logp


def _cispo_grads(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip):
    return None, -torch.clamp(torch.exp(log_weight), max=clip.high) * adv


def _cispo_flags(log_weight: Tensor, adv: Tensor, clip: Clip) -> dict[str, Tensor]:
    # TRL: is_cispo_clipped = (coef_1 > epsilon_high) & (A > 0); the weight is capped, never zeroed.
    c = torch.exp(log_weight)
    return {"low": torch.zeros_like(c, dtype=torch.bool), "high": (c > clip.high) & (adv > 0)}


def _sapo_temperatures(adv: Tensor, clip: Clip) -> Tensor:
    # TRL: torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg), built from two
    # Python floats, i.e. in the default dtype (fp32) -- kept so, as TRL's values are those.
    return torch.where(adv > 0, clip.sapo_temperature_pos, clip.sapo_temperature_neg)  # (B, 1)


def _sapo_loss(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip) -> Tensor:
    # TRL: soft_coef_1 = sigmoid(τ · (coef_1 - 1)) · 4 / τ;  per_token_loss = -soft_coef_1 · A
    tau = _sapo_temperatures(adv, clip)
    soft_coef_1 = torch.sigmoid(tau * (torch.exp(log_weight) - 1)) * 4 / tau
    return -soft_coef_1 * adv


def _sapo_grads(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip):
    # d/dlw of -A · (4/τ) · σ(τ(c - 1)), c = exp(lw):  -A · 4 σ (1 - σ) · c   (σ' = σ(1 - σ))
    c = torch.exp(log_weight)
    gate = torch.sigmoid(_sapo_temperatures(adv, clip) * (c - 1))
    return -adv * 4 * gate * (1 - gate) * c, None


_VESPO_LOG_W_MIN = math.log(1e-8)  # TRL: the lower clamp of log w, as in the VESPO reference code


def _vespo_phi(log_weight: Tensor, adv: Tensor, clip: Clip) -> Tensor:
    # TRL get_gamma_weights (under no_grad), from the per-token log-ratios (masked ones are 0 here):
    #   log w = clamp(Σ_t clamp(log_ratio, -20, 20) · m, log 1e-8, 20)      (a sum, not a mean)
    #   φ(w) = exp(λ + k · log w - λ · w)   (Gamma weight, φ(1) = 1); (k, λ) by A >= 0 or A < 0
    seq_log_ratio = torch.clamp(log_weight, -20.0, 20.0).sum(-1, keepdim=True)  # (B, 1)
    log_w = torch.clamp(seq_log_ratio, _VESPO_LOG_W_MIN, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, clip.vespo_k_pos, clip.vespo_k_neg)
    lam = torch.where(nonneg, clip.vespo_lambda_pos, clip.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo_loss(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip) -> Tensor:
    # TRL: per_token_loss = -φ(w) · A · logp, φ detached
    return -_vespo_phi(log_weight.detach(), adv, clip) * adv * logp


def _vespo_grads(logp: Tensor, log_weight: Tensor, adv: Tensor, clip: Clip):
    return None, -_vespo_phi(log_weight, adv, clip) * adv


def _no_flags(log_weight: Tensor, adv: Tensor, clip: Clip) -> dict[str, Tensor]:
    # sapo and vespo gate softly: nothing is clipped (TRL logs no clip ratio for them)
    none = torch.zeros_like(log_weight, dtype=torch.bool)
    return {"low": none, "high": none}


@dataclasses.dataclass(frozen=True)
class Surrogate:
    name: str
    loss: Callable[[Tensor, Tensor, Tensor, Clip], Tensor]
    grads: Callable[[Tensor, Tensor, Tensor, Clip], tuple[Tensor | None, Tensor | None]]
    flags: Callable[[Tensor, Tensor, Clip], dict[str, Tensor]]
    uses_dual_clip: bool  # TRL's delta applies
    needs_epsilon_high: bool  # epsilon_high is a cap of its own, not "defaults to epsilon_low"


CLIPPED = Surrogate("clipped", _clipped_loss, _clipped_grads, _clipped_flags,
                    uses_dual_clip=True, needs_epsilon_high=False)
CISPO = Surrogate("cispo", _cispo_loss, _cispo_grads, _cispo_flags,
                  uses_dual_clip=False, needs_epsilon_high=True)
SAPO = Surrogate("sapo", _sapo_loss, _sapo_grads, _no_flags, uses_dual_clip=False, needs_epsilon_high=False)
VESPO = Surrogate("vespo", _vespo_loss, _vespo_grads, _no_flags, uses_dual_clip=False, needs_epsilon_high=False)


# ---------------------------------------------------------------------------------------------
# Aggregation weights w_{i,t} (broadcastable to (B, T)); the loss is Σ w · m · per_token_loss.
# ---------------------------------------------------------------------------------------------


def _per_sequence_mean(lengths: Tensor, norm: Normaliser) -> Tensor:
    # TRL grpo: ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()  ->  w = 1 / (B · |o_i|)
    return 1.0 / (norm.batch_size * lengths)  # (B, 1)


def _batch_token_mean(lengths: Tensor, norm: Normaliser) -> Tensor:
    # TRL bnpo: (ptl * m).sum() / m.sum().clamp(min=1)  ->  w = 1 / Σm of this microbatch
    tokens = torch.as_tensor(norm.batch_tokens, dtype=lengths.dtype, device=lengths.device)
    return (1.0 / tokens.clamp(min=1.0)).reshape(1, 1)


def _constant_length(lengths: Tensor, norm: Normaliser) -> Tensor:
    # TRL dr_grpo: (ptl * m).sum() / (B · max_completion_length)
    scale = 1.0 / (norm.batch_size * norm.max_completion_length)
    return torch.full((1, 1), scale, dtype=lengths.dtype, device=lengths.device)


def _sequence_sum_mean(lengths: Tensor, norm: Normaliser) -> Tensor:
    # TRL luspo: (ptl * m).sum(-1).mean()  ->  w = 1 / B: a sequence weighs by its length
    return torch.full((1, 1), 1.0 / norm.batch_size, dtype=lengths.dtype, device=lengths.device)


def _global_token_mean(lengths: Tensor, norm: Normaliser) -> Tensor:
    # TRL dapo / cispo / vespo: (ptl * m).sum() / (num_items_in_batch / num_processes); here the caller
    # passes the already-scaled count -- NOTE [ Normalisation under DeepSpeed ] in ds_hilore.grpo.
    n = torch.as_tensor(norm.num_items_in_batch, dtype=lengths.dtype, device=lengths.device)
    return (1.0 / n).reshape(1, 1)


@dataclasses.dataclass(frozen=True)
class LossType:
    """One TRL ``loss_type``: a surrogate and an aggregation weight."""

    surrogate: Surrogate
    weight: Callable[[Tensor, Normaliser], Tensor]
    needs: tuple[str, ...] = ()  # Normaliser fields that must not be None
    # The surrogate reads the per-token log-ratios whatever importance_sampling_level says
    # (vespo forms its own sequence weight from them; TRL ignores the level for it too).
    token_ratios: bool = False


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(CLIPPED, _per_sequence_mean),
    "bnpo": LossType(CLIPPED, _batch_token_mean),
    "dr_grpo": LossType(CLIPPED, _constant_length, needs=("max_completion_length",)),
    "dapo": LossType(CLIPPED, _global_token_mean, needs=("num_items_in_batch",)),
    "cispo": LossType(CISPO, _global_token_mean, needs=("num_items_in_batch",)),
    "sapo": LossType(SAPO, _per_sequence_mean),
    "luspo": LossType(CLIPPED, _sequence_sum_mean),
    "vespo": LossType(VESPO, _global_token_mean, needs=("num_items_in_batch",), token_ratios=True),
}


# ---------------------------------------------------------------------------------------------
# Importance-sampling level: how the log weight is formed and how ∂/∂log_weight reaches logp.
# ---------------------------------------------------------------------------------------------


def _token_log_weight(log_ratio: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
    return log_ratio  # (B, T)


def _token_chain(d_lw: Tensor, wm: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
    return wm * d_lw  # (B, T)


def _sequence_log_weight(log_ratio: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
    # TRL (GSPO): (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1), kept as (B, 1)
    return (log_ratio * mask).sum(-1, keepdim=True) / lengths  # (B, 1)


def _sequence_chain(d_lw: Tensor, wm: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
    # ℓ_i is shared by the row: Σ_t w m ℓ_i = W_i ℓ_i, and ∂lw_i/∂logp_t = m_t / |o_i|
    return wm.sum(-1, keepdim=True) * d_lw * mask / lengths  # (B, T)


@dataclasses.dataclass(frozen=True)
class RatioLevel:
    log_weight: Callable[[Tensor, Tensor, Tensor], Tensor]
    chain: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


RATIO_LEVELS: dict[str, RatioLevel] = {
    "token": RatioLevel(_token_log_weight, _token_chain),
    "sequence": RatioLevel(_sequence_log_weight, _sequence_chain),
}


# ---------------------------------------------------------------------------------------------
# KL estimators of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL divergence", 2020),
# with d = ref - logp (the log of π_ref/π). TRL implements k3 only:
#     per_token_kl = exp(ref - logp) - (ref - logp) - 1
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KLEstimator:
    value: Callable[[Tensor], Tensor]  # κ(d)
    dlogp: Callable[[Tensor], Tensor]  # ∂κ/∂logp = -κ'(d)


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": KLEstimator(lambda d: -d, lambda d: torch.ones_like(d)),
    "k2": KLEstimator(lambda d: 0.5 * d * d, lambda d: -d),
    "k3": KLEstimator(lambda d: torch.exp(d) - d - 1.0, lambda d: 1.0 - torch.exp(d)),
}
