"""Policy-update exposure: how much the current update depends on each unit's slice of each sequence.

Pure functions of plain tensors (paper §3.2 and App. B.1):

    E_{u,i} = Σ_t |ω_{i,t}| · a_{u,t}

ω_{i,t} = ∂L/∂logp_t is the per-token loss coefficient (analytic source: ``ds_hilore.grpo``), or,
for any loss, the per-token norm ‖∂L/∂h_t‖ of the gradient arriving at the last hidden state
(automatic source). a_{u,t} is an activation-based token weight: the norm of the unit's input at
position t, normalised to mean 1 over the positions ω covers, within the unit and microbatch.
A sequence whose ω is exactly zero everywhere contributes nothing to any parameter gradient
(causal attention never mixes sequences): it is *exact-zero* and its slices need no storage.

Packed rows (several sequences in one row of T tokens, NOTE [ Packed sequences ] in
ds_hilore/runtime/packed.py): the sequences are the row's segments, token ranges [s_k, e_k);
``segment_exposure`` and ``zero_segments`` are ``slice_exposure`` and ``zero_rows`` per segment.
"""

from __future__ import annotations

import torch

from ds_hilore._errors import HiLoReError

SOURCES = ("analytic", "hidden_grad")


def align(coefficients: torch.Tensor, seq_len: int, offset: int | None = None) -> torch.Tensor:
    """|ω| placed on hidden positions: (B, T') -> (B, T), zero where ω has no column.

    Args:
        coefficients: (B, T') ω of the microbatch.
        seq_len: T, the number of hidden positions of the forward.
        offset: hidden position of ω's first column. Default: ω ends at position T - 2, since
            the hidden state at t produces the log-prob of token t + 1 and the last position
            predicts nothing (``T - 1 - T'``; 0 when T' = T).
    """
    batch, cols = coefficients.shape
    offset = default_offset(seq_len, cols) if offset is None else offset
    if offset < 0 or offset + cols > seq_len:
        raise HiLoReError(f"coefficients with {cols} positions at offset {offset} do not fit in "
                         f"{seq_len} hidden positions; pass the (B, T') ω of this microbatch "
                         "with T' <= T, or the right offset.")
    out = coefficients.new_zeros((batch, seq_len), dtype=torch.float32)  # (B, T)
    out[:, offset:offset + cols] = coefficients.detach().abs().float()
    return out


def default_offset(seq_len: int, cols: int) -> int:
    return max(seq_len - 1 - cols, 0)


def window(like: torch.Tensor, cols: int, offset: int | None) -> torch.Tensor:
    """1 on the hidden positions ω's ``cols`` columns cover, 0 elsewhere: (B, T) like ``like``."""
    covered = torch.zeros_like(like)
    start = default_offset(like.shape[1], cols) if offset is None else offset
    covered[:, start:start + cols] = 1.0
    return covered


def token_weights(norms: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
    """a_{u,t}: per-token activation norms (B, T) scaled to mean 1 over ``covered`` positions."""
    norms = norms.float() * covered  # (B, T)
    mean = norms.sum() / covered.sum().clamp_min(1)
    return norms / mean.clamp_min(torch.finfo(torch.float32).tiny)


def slice_exposure(abs_omega: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """E_{u,i} for every sequence i: (B, T) |ω| and (B, T) a_u -> (B,)."""
    return (abs_omega * weights).sum(dim=1)


def zero_rows(abs_omega: torch.Tensor) -> list[int]:
    """Sequences whose coefficients are exactly zero at every position."""
    return (abs_omega == 0).all(dim=1).nonzero().flatten().tolist()


def segment_index(segments, seq_len: int, device) -> torch.Tensor:
    """(T,) segment number of every hidden position of a packed row (segments: [(s, e)])."""
    lengths = [e - s for s, e in segments]
    if sum(lengths) != seq_len or any(n <= 0 for n in lengths):
        raise HiLoReError(f"segments {segments} do not cover the {seq_len} positions of the row")
    return torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(lengths)).to(device)


def segment_exposure(abs_omega: torch.Tensor, weights: torch.Tensor, segments) -> torch.Tensor:
    """E_{u,k} for every segment k of a packed row: (1, T) |ω| and (1, T) a_u -> (K,)."""
    per_token = (abs_omega * weights)[0]  # (T,)
    return torch.stack([per_token[s:e].sum() for s, e in segments])


def zero_segments(abs_omega: torch.Tensor, segments) -> list[int]:
    """Segments of a packed row whose coefficients are exactly zero at every position (one read)."""
    index = segment_index(segments, abs_omega.shape[1], abs_omega.device)
    nonzero = torch.zeros(len(segments), device=abs_omega.device).index_add_(
        0, index, (abs_omega[0] != 0).float())
    return (nonzero == 0).nonzero().flatten().tolist()


def hidden_grad_norms(grad: torch.Tensor) -> torch.Tensor:
    """Automatic source: per-token ‖∂L/∂h_t‖ from the last hidden state's gradient (B, T, H) -> (B, T)."""
    return grad.detach().float().norm(dim=-1)


def input_norms(hidden: torch.Tensor) -> torch.Tensor | None:
    """Per-token norm of a unit's input (B, T, H) -> (B, T); None for other shapes."""
    if hidden.dim() != 3 or not hidden.is_floating_point():
        return None
    return hidden.detach().float().norm(dim=-1)


def row_mass(abs_omega: torch.Tensor, segments=None) -> torch.Tensor:
    """M_i = Σ_t |ω_{i,t}| of every sequence: (B, T) -> (B,); of every segment of a packed row
    when ``segments`` is given: (1, T) -> (K,). The microbatch's exposure mass M_m is their sum
    (NOTE [ Risk in step units ] in ds_hilore/plan/risk.py)."""
    if segments is None:
        return abs_omega.sum(dim=1)
    index = segment_index(segments, abs_omega.shape[1], abs_omega.device)
    return torch.zeros(len(segments), device=abs_omega.device).index_add_(0, index, abs_omega[0])


def predicted(advantages, response_mask, loss_weights=None) -> list[float]:
    """Exposure of every sequence predicted before the forward: Σ_t |A_i| · w_{i,t} · m_{i,t}.

    Exact for the policy term on-policy (ratio 1, nothing clipped) and with no KL or entropy
    term (beta = 0): a zero means a zero coefficient. ``loss_weights`` (B, T') are the loss's
    aggregation weights w_{i,t} (1 / |o_i| for TRL's "grpo"); None weighs every token 1, which
    still ranks sequences by |A_i| x response tokens and keeps every zero exact.

    Args:
        advantages: (B,) A_i, or (B, T') per token (OpenRLHF's experiences).
        response_mask: (B, T') 1 on response tokens, 0 on prompt and padding.
        loss_weights: optional (B, T') w_{i,t}.
    """
    mask = response_mask.detach().float()  # (B, T')
    if loss_weights is not None:
        mask = mask * loss_weights.detach().float()
    adv = advantages.detach().float().abs()
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) or (B, T')
    return (adv * mask).sum(dim=1).tolist()


# a sequence whose every token was clipped last epoch: this share of its unclipped exposure
CLIPPED_FLOOR = 1e-6


def predicted_after_clip(advantages, response_mask, ratios, epsilon_low: float,
                         epsilon_high: float | None = None, loss_weights=None) -> list[float]:
    """Exposure of every sequence at a later PPO epoch, from the previous epoch's ratios.

    NOTE [ Exposure at later PPO epochs ]
    When one rollout feeds several updates, the clipped surrogate -min(r A, clip(r) A) has
    coefficient ∂/∂logp_t = -r_t A_i on a token inside the clip range and exactly 0 on a
    clipped one (r_t > 1 + ε_high with A_i > 0, or r_t < 1 - ε_low with A_i < 0). This epoch's
    ratios are known only after its forward, but the previous epoch's r_t (from the same
    tokens, one or a few optimizer steps earlier) tell which tokens are likely clipped:

        P_i = Σ_t |A_i| · r_t · (1 - clipped_t) · w_{i,t} · m_{i,t}

    It is exact only for tokens that stay clipped and ratios that did not move, so it is a
    prediction, used to order and pack, never to elide: elision needs exact zeros. A sequence
    predicted 0 only because every token was clipped keeps ``CLIPPED_FLOOR`` of its unclipped
    exposure (packed first, still stored and backwarded); P_i = 0 only when A_i · m_i = 0,
    which is exact at any epoch (beta = 0). For the clipped surrogates only (grpo, bnpo,
    dr_grpo, dapo, luspo); cispo caps the ratio without zeroing, sapo and vespo gate softly:
    use ``predicted`` there.

    Args:
        advantages: (B,) A_i, or (B, T') per token.
        response_mask: (B, T') 1 on response tokens.
        ratios: (B, T') or (B, 1) the previous epoch's π_θ / π_old of these tokens; None at the
            first epoch (then ``predicted``).
        epsilon_low, epsilon_high: the clip range (``epsilon_high`` defaults to ``epsilon_low``).
        loss_weights: optional (B, T') aggregation weights, as in ``predicted``.
    """
    if ratios is None:
        return predicted(advantages, response_mask, loss_weights)
    high = epsilon_low if epsilon_high is None else epsilon_high
    mask = response_mask.detach().float()  # (B, T')
    if loss_weights is not None:
        mask = mask * loss_weights.detach().float()
    adv = advantages.detach().float()
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) or (B, T')
    r = ratios.detach().float()
    clipped = ((r > 1.0 + high) & (adv > 0)) | ((r < 1.0 - epsilon_low) & (adv < 0))
    per_token = torch.where((mask > 0) & ~clipped, adv.abs() * r, 0.0)  # an inf ratio off the mask: 0
    kept = (per_token * mask).sum(dim=1)  # (B,)
    whole = (adv.abs() * mask).sum(dim=1)  # (B,) zero exactly where the coefficient is
    return torch.where((kept == 0) & (whole > 0), CLIPPED_FLOOR * whole, kept).tolist()
