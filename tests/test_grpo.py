"""ds_hilore.grpo: exact coefficients, TRL's loss definitions, chunked log-probs, exact zero rows.

The reference loss below is written from TRL's ``GRPOTrainer._compute_loss`` formulas (see
ds_hilore/losses.py for the source) and uses nothing from ds_hilore.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from models import tiny_model

from ds_hilore.grpo import (
    drop_zero_rows,
    global_num_items,
    group_advantages,
    policy_loss,
    token_logprobs,
)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")
KLS = (None, "k1", "k2", "k3")  # None: beta = 0 (TRL's default)
CLIPS = {  # (epsilon_low, epsilon_high, dual_clip); cispo reads epsilon_high as the ratio cap
    "symmetric": (0.2, None, None),
    "asymmetric": (0.2, 0.28, None),
    "dual": (0.2, 0.28, 1.5),
}
CISPO_CAPS = {"symmetric": 1.1, "asymmetric": 5.0}  # cispo needs an explicit epsilon_high
L_MAX, N_ITEMS = 12, 37.5


# ---------------------------------------------------------------------------------------------
# Reference: TRL's formulas, written out independently
# ---------------------------------------------------------------------------------------------


SAPO_TAU = (1.0, 1.05)  # TRL's defaults (A > 0, A <= 0)
VESPO_K_LAMBDA = (2.0, 3.0, 3.0, 2.0)  # TRL's defaults: k_pos, lambda_pos, k_neg, lambda_neg


@torch.no_grad()
def gamma_weights(adv, log_ratio, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """TRL's GRPOTrainer.get_gamma_weights (VESPO), without the vLLM sampling correction."""
    log_ratio_clamped = torch.clamp(log_ratio, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, math.log(1e-8), 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = adv >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def reference_loss(logp, old, adv, mask, *, loss_type, ref, beta, kl, level, eps_low, eps_high, delta,
                   sapo_tau=SAPO_TAU, vespo=VESPO_K_LAMBDA):
    m = mask.to(logp.dtype)
    log_ratio = logp - old
    if level == "token":
        log_iw = log_ratio
    else:  # GSPO: masked mean of the sequence's log-ratios, one weight per row
        log_iw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_iw)
    a = adv.unsqueeze(1)
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * a * logp
    elif loss_type == "sapo":
        temperatures = torch.where(a > 0, *sapo_tau)
        per_token = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * a
    elif loss_type == "vespo":  # TRL ignores the level here: φ comes from the per-token ratios
        per_token = -gamma_weights(a, log_ratio, m, *vespo) * a * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
    if beta != 0.0:
        d = ref - logp
        per_token = per_token + beta * {"k1": -d, "k2": 0.5 * d**2, "k3": torch.exp(d) - d - 1}[kl]
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * L_MAX)
    if loss_type == "sapo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "luspo":
        return (per_token * m).sum(-1).mean()
    return (per_token * m).sum() / N_ITEMS  # dapo, cispo, vespo


def random_batch(seed=0, dtype=torch.float64):
    """12 rows x 12 tokens: groups of 4, one group with A = 0, an empty row, masked tails, and
    ratios spread widely enough that tokens and whole sequences fall outside every clip range."""
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 12
    logp = -torch.rand(b, t, generator=g, dtype=dtype) * 3  # (B, T)
    row_shift = (torch.rand(b, 1, generator=g, dtype=dtype) - 0.5) * 1.2  # whole-sequence drift
    old = logp + row_shift + 0.35 * torch.randn(b, t, generator=g, dtype=dtype)
    ref = logp + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)
    lengths = torch.randint(3, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]  # (B, T) bool
    mask[5] = False  # an empty completion
    rewards = torch.rand(b, generator=g, dtype=dtype)
    rewards[4:8] = 0.7  # a group with identical rewards
    adv = group_advantages(rewards, 4)
    assert (adv[4:8] == 0).all()
    return logp, old, ref, mask, adv


def loss_kwargs(loss_type, level, kl, clip):
    eps_low, eps_high, delta = CLIPS[clip]
    if loss_type == "cispo":
        eps_high = CISPO_CAPS[clip]
    return dict(loss_type=loss_type, importance_sampling_level=level, beta=0.0 if kl is None else 0.1,
                kl_estimator=kl or "k3", epsilon_low=eps_low, epsilon_high=eps_high, dual_clip=delta,
                max_completion_length=L_MAX, num_items_in_batch=N_ITEMS)


SOFT = ("sapo", "vespo")  # no clipping: one clip setting is enough (dual_clip does not apply)
GRID = [c for c in itertools.product(LOSS_TYPES, LEVELS, KLS, CLIPS)
        if not (c[0] == "cispo" and c[3] == "dual") and not (c[0] in SOFT and c[3] != "symmetric")]


@pytest.mark.parametrize("loss_type,level,kl,clip", GRID)
def test_coefficients_equal_autograd_and_loss_equals_reference(loss_type, level, kl, clip):
    logp, old, ref, mask, adv = random_batch()
    logp.requires_grad_(True)
    kw = loss_kwargs(loss_type, level, kl, clip)
    out = policy_loss(logp, old, adv, mask, ref_logp=ref, **kw)

    (grad,) = torch.autograd.grad(out.loss, logp, retain_graph=True)
    expected = reference_loss(logp, old, adv, mask, loss_type=loss_type, ref=ref, beta=kw["beta"], kl=kl,
                              level=level, eps_low=kw["epsilon_low"],
                              eps_high=kw["epsilon_high"] if kw["epsilon_high"] is not None else kw["epsilon_low"],
                              delta=kw["dual_clip"])
    (ref_grad,) = torch.autograd.grad(expected, logp)

    assert out.coefficients.dtype == torch.float64 and not out.coefficients.requires_grad
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    scale = grad.abs().max()
    torch.testing.assert_close(out.coefficients, grad, rtol=1e-6, atol=1e-6 * scale)
    torch.testing.assert_close(out.coefficients, ref_grad, rtol=1e-6, atol=1e-6 * scale)
    assert (out.coefficients[~mask] == 0).all()  # masked tokens and the empty row
    if kl is None:  # exact zeros where autograd has exact zeros: A = 0 rows, clipped tokens
        assert ((out.coefficients == 0) == (grad == 0)).all()
        assert (out.coefficients[4:8] == 0).all()


@pytest.mark.parametrize("loss_type", ["sapo", "vespo"])
def test_soft_gates_follow_trl_with_their_parameters_and_clamps(loss_type):
    """Non-default gate parameters, and log-ratios beyond vespo's clamps (a token above 20, a
    sequence sum above 20 and one below log 1e-8)."""
    logp, old, ref, mask, adv = random_batch(seed=1)
    old = old.clone()
    old[0] -= 5.0  # row 0: Σ log-ratio > 20
    old[2] += 5.0  # row 2: Σ log-ratio < log(1e-8)
    old[3, 0] -= 30.0  # a single token's log-ratio > 20
    params = dict(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, vespo_k_pos=1.5, vespo_lambda_pos=2.5,
                  vespo_k_neg=2.5, vespo_lambda_neg=1.5)
    logp.requires_grad_(True)
    out = policy_loss(logp, old, adv, mask, loss_type=loss_type, num_items_in_batch=N_ITEMS, **params)
    expected = reference_loss(logp, old, adv, mask, loss_type=loss_type, ref=ref, beta=0.0, kl=None, level="token",
                              eps_low=0.2, eps_high=0.2, delta=None, sapo_tau=(0.5, 2.0), vespo=(1.5, 2.5, 2.5, 1.5))
    (grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.coefficients, grad, rtol=1e-6, atol=1e-6 * grad.abs().max())
    assert ((out.coefficients == 0) == (grad == 0)).all()
    assert out.metrics["clip_fraction_low"] == out.metrics["clip_fraction_high"] == 0.0
    if loss_type == "vespo":  # φ(e^20) underflows to 0: row 0 carries no gradient, as in TRL
        assert (out.coefficients[0] == 0).all() and (out.coefficients[2][mask[2]] != 0).all()
    with pytest.raises(ValueError, match="sapo_temperature_neg must be > 0"):
        policy_loss(logp, old, adv, mask, loss_type="sapo", sapo_temperature_neg=0.0)


def test_grid_exercises_every_clipping_branch():
    """The random batch really has tokens/sequences clipped low, high and by the dual clip."""
    logp, old, ref, mask, adv = random_batch()
    for level in LEVELS:
        mt = policy_loss(logp, old, adv, mask, **{**loss_kwargs("grpo", level, None, "dual"), "loss_type": "grpo"}).metrics
        assert mt["clip_fraction_low"] > 0 and mt["clip_fraction_high"] > 0 and mt["clip_fraction_dual"] > 0, mt
    mt = policy_loss(logp, old, adv, mask, **loss_kwargs("cispo", "token", None, "symmetric")).metrics
    assert mt["clip_fraction_high"] > 0 and mt["clip_fraction_low"] == 0


def test_metrics_match_their_definitions():
    logp, old, ref, mask, adv = random_batch()
    out = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.0, epsilon_high=0.28)
    active = mask
    n = int(active.sum())
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand_as(ratio)
    low = ((ratio < 0.8) & (a < 0) & active).sum().item() / n
    high = ((ratio > 1.28) & (a > 0) & active).sum().item() / n
    omega = out.coefficients[active].abs()
    top = omega.sort(descending=True).values[: math.ceil(0.1 * n)].sum() / omega.sum()
    d = ref - logp
    kl = ((torch.exp(d) - d - 1)[active]).mean()
    mt = out.metrics
    assert mt["active_tokens"] == n
    assert mt["clip_fraction_low"] == pytest.approx(low) and mt["clip_fraction_high"] == pytest.approx(high)
    assert mt["zero_fraction"] == pytest.approx((out.coefficients[active] == 0).sum().item() / n)
    assert mt["top10_share"] == pytest.approx(top.item()) and mt["mean_kl"] == pytest.approx(kl.item())
    assert 0 < mt["zero_fraction"] < 1 and mt["clip_fraction_dual"] == 0
    assert math.isnan(policy_loss(logp, old, adv, mask).metrics["mean_kl"])


def test_on_policy_default_and_float32():
    """old_logp=None is TRL's on-policy case (ratio 1): ω = -A · w · m exactly."""
    logp, _, _, mask, adv = random_batch(dtype=torch.float32)
    out = policy_loss(logp.requires_grad_(), None, adv, mask, loss_type="dr_grpo", max_completion_length=L_MAX)
    m = mask.float()
    expected = -adv[:, None] * m / (logp.shape[0] * L_MAX)
    assert out.coefficients.dtype == torch.float32
    torch.testing.assert_close(out.coefficients, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("cispo", "token")])
def test_masked_positions_may_hold_anything(loss_type, level):
    """NOTE [ Masked positions ]: -inf / NaN / huge values under the mask change nothing."""
    logp, old, ref, mask, adv = random_batch()
    kw = {**loss_kwargs(loss_type, level, "k3", "asymmetric"), "ref_logp": ref}
    clean_logp = logp.clone().requires_grad_()
    clean = policy_loss(clean_logp, old, adv, mask, **kw)
    dirty_logp = logp.masked_fill(~mask, float("nan")).requires_grad_()
    dirty = policy_loss(dirty_logp, old.masked_fill(~mask, -1e30), adv, mask,
                        **{**kw, "ref_logp": ref.masked_fill(~mask, float("-inf"))})
    assert torch.isfinite(dirty.loss) and torch.isfinite(dirty.coefficients).all()
    assert torch.equal(dirty.loss, clean.loss) and torch.equal(dirty.coefficients, clean.coefficients)
    (grad,) = torch.autograd.grad(dirty.loss, dirty_logp)
    assert torch.equal(grad, torch.autograd.grad(clean.loss, clean_logp)[0])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _call(**over):
    logp, old, ref, mask, adv = random_batch()
    args = dict(logp=logp, old_logp=old, advantages=adv, mask=mask)
    kw = dict(ref_logp=ref)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return policy_loss(args["logp"], args["old_logp"], args["advantages"], args["mask"], **kw)


@pytest.mark.parametrize("key,value,known", [
    ("loss_type", "ppo", "grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"),
    ("importance_sampling_level", "segment", "token, sequence"),
    ("kl_estimator", "k4", "k1, k2, k3"),
])
def test_unknown_names_list_the_known_ones(key, value, known):
    with pytest.raises(ValueError, match=f"{key}='{value}' is not known; known: {known}"):
        _call(**{key: value})


@pytest.mark.parametrize("over,exc,pattern", [
    (dict(logp=torch.zeros(12)), ValueError, r"logp must be a \(B, T\) tensor"),
    (dict(mask=torch.ones(12, 11)), ValueError, r"mask must have logp's shape \(12, 12\)"),
    (dict(old_logp=torch.zeros(12, 13)), ValueError, "old_logp must have logp's shape"),
    (dict(advantages=torch.zeros(12, 12)), ValueError, r"advantages must be \(12,\), one per sequence"),
    (dict(logp=torch.zeros(12, 12, dtype=torch.long)), TypeError, "logp must be floating"),
    (dict(advantages=torch.zeros(12, dtype=torch.long)), TypeError, "advantages must be floating"),
    (dict(beta=0.1, ref_logp=None), ValueError, "beta != 0 needs ref_logp"),
    (dict(beta=-0.1), ValueError, "beta must be >= 0"),
    (dict(loss_type="dr_grpo"), ValueError, "pass max_completion_length"),
    (dict(loss_type="dr_grpo", max_completion_length=5), ValueError, "active tokens > max_completion_length=5"),
    (dict(loss_type="dapo"), ValueError, "normalises by num_items_in_batch.*global_num_items"),
    (dict(loss_type="dapo", num_items_in_batch=0), ValueError, r"num_items_in_batch \(> 0\)"),
    (dict(loss_type="cispo", num_items_in_batch=3.0), ValueError, "Pass epsilon_high explicitly"),
    (dict(loss_type="cispo", num_items_in_batch=3.0, epsilon_high=5.0, dual_clip=3.0), ValueError,
     "dual_clip does not apply to loss_type='cispo'"),
    (dict(dual_clip=1.0), ValueError, "dual_clip must be > 1"),
    (dict(epsilon_low=-0.1), ValueError, "must be >= 0"),
    (dict(batch_size=3), ValueError, "batch_size=3 is smaller than the 12 rows"),
])
def test_bad_inputs_raise_clear_errors(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _call(**over)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_zero_mask_is_an_error_not_nan(loss_type):
    logp, old, _, mask, adv = random_batch()
    with pytest.raises(ValueError, match="the mask has no active token"):
        policy_loss(logp, old, adv, torch.zeros_like(mask), loss_type=loss_type, epsilon_high=5.0,
                    max_completion_length=L_MAX, num_items_in_batch=N_ITEMS)


# ---------------------------------------------------------------------------------------------
# Advantages and the DeepSpeed normaliser
# ---------------------------------------------------------------------------------------------


def test_group_advantages_follow_trl_and_give_exact_zeros():
    varied = [1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.5]
    rewards = torch.tensor([0.1] * 8 + varied + [0.3] * 8)  # groups of 8, TRL's num_generations
    grouped = rewards.view(-1, 8)
    centred = (grouped - grouped.mean(1, keepdim=True)).flatten()
    trl = centred / (grouped.std(1).repeat_interleave(8) + 1e-4)  # TRL's scale_rewards="group"
    assert trl[:8].abs().max() > 1e-5  # fp32 mean of 0.1 x 8 is not 0.1: TRL gives A ~ 7e-5, not 0
    adv = group_advantages(rewards, 8)
    torch.testing.assert_close(adv[8:16], trl[8:16])
    assert (adv[:8] == 0).all() and (adv[16:] == 0).all()
    torch.testing.assert_close(group_advantages(rewards, 8, scale="batch")[8:16], centred[8:16] / (rewards.std() + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, 8, scale="none")[8:16], centred[8:16])
    assert (group_advantages(rewards, 1) == 0).all()
    with pytest.raises(ValueError, match="scale='std' is not known; known: group, batch, none"):
        group_advantages(rewards, 8, scale="std")
    with pytest.raises(ValueError, match="must be >= 1 and divide the 24 rewards"):
        group_advantages(rewards, 5)


def test_global_num_items_single_process():
    masks = [torch.ones(2, 5), torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])]
    assert global_num_items(masks, 2) == (10 + 2) / 2
    assert global_num_items(torch.ones(4, 3), 4) == 3.0
    with pytest.raises(ValueError, match="got 2 masks for gradient_accumulation_steps=3"):
        global_num_items(masks, 3)


# ---------------------------------------------------------------------------------------------
# token_logprobs
# ---------------------------------------------------------------------------------------------


def _direct_logprobs(hidden, weight, bias, targets, temperature=1.0):
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)


def _values_and_grads(fn, hidden, weight, bias, targets, upstream):
    for x in (hidden, weight, bias):
        if x is not None:
            x.grad = None
    out = fn(hidden, weight, bias, targets)
    (out * upstream).sum().backward()
    return out.detach(), [None if x is None or x.grad is None else x.grad.clone() for x in (hidden, weight, bias)]


@pytest.mark.parametrize("dtype,with_bias,frozen,temperature", [
    (torch.float32, True, False, 1.0),
    (torch.float32, False, True, 0.7),
    (torch.bfloat16, False, False, 1.0),
])
def test_token_logprobs_equal_direct_computation(dtype, with_bias, frozen, temperature):
    g = torch.Generator().manual_seed(0)
    b, t, h, v = 3, 17, 16, 50
    hidden = torch.randn(b, t, h, generator=g).to(dtype).requires_grad_()
    head = torch.nn.Linear(h, v, bias=with_bias).to(dtype)
    head.weight.requires_grad_(not frozen)
    targets = torch.randint(0, v, (b, t), generator=g)
    upstream = torch.randn(b, t, generator=g)  # arbitrary ∂L/∂logp

    chunked = lambda hd, w, bs, tg: token_logprobs(hd, w, tg, bias=bs, chunk_size=5, temperature=temperature)  # noqa: E731
    direct = lambda hd, w, bs, tg: _direct_logprobs(hd, w, bs, tg, temperature)  # noqa: E731
    got, got_grads = _values_and_grads(chunked, hidden, head.weight, head.bias, targets, upstream)
    want, want_grads = _values_and_grads(direct, hidden, head.weight, head.bias, targets, upstream)

    assert got.dtype == torch.float32 and got.shape == (b, t)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    for name, a, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert (a is None) == (w is None), name
        if a is not None:
            assert a.dtype == w.dtype, name
            torch.testing.assert_close(a.float(), w.float(), **tol, msg=lambda m: f"{name}: {m}")
    if frozen:
        assert head.weight.grad is None


def test_token_logprobs_backward_skips_positions_without_gradient():
    """Positions whose ∂L/∂logp is zero (a zero-advantage sequence, masked prompt positions)
    cost no backward: the gradients equal the direct computation's, those rows of ∂h are zero,
    and the backward's FLOPs are those of the other positions only (NOTE [ Chunked log-probs ])."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(1)
    b, t, h, v = 4, 12, 16, 64
    hidden = torch.randn(b, t, h, generator=g).requires_grad_()
    head = torch.nn.Linear(h, v, bias=True)
    targets = torch.randint(0, v, (b, t), generator=g)
    upstream = torch.randn(b, t, generator=g)
    upstream[1] = 0.0  # a sequence with A = 0
    upstream[:, :3] = 0.0  # its prompt, masked
    live = int((upstream != 0).sum())

    chunked = lambda hd, w, bs, tg: token_logprobs(hd, w, tg, bias=bs, chunk_size=7)  # noqa: E731
    got, got_grads = _values_and_grads(chunked, hidden, head.weight, head.bias, targets, upstream)
    want, want_grads = _values_and_grads(_direct_logprobs, hidden, head.weight, head.bias, targets,
                                         upstream)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, w in zip(got_grads, want_grads):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_grads[0][upstream == 0], torch.zeros(b * t - live, h))

    def backward_flops(weights):
        hidden.grad = head.weight.grad = head.bias.grad = None
        out = token_logprobs(hidden, head, targets, chunk_size=7)
        with FlopCounterMode(display=False) as counter:
            (out * weights).sum().backward()
        return counter.get_total_flops()

    every = backward_flops(torch.ones(b, t))  # the head's matmuls over every position
    assert every >= 2 * 2 * b * t * h * v  # at least the recompute and ∂h
    assert backward_flops(upstream) * (b * t) == every * live


def test_token_logprobs_accepts_a_linear_and_checks_its_inputs():
    head = torch.nn.Linear(8, 20)
    hidden, targets = torch.randn(2, 4, 8), torch.randint(0, 20, (2, 4))
    torch.testing.assert_close(token_logprobs(hidden, head, targets),
                               _direct_logprobs(hidden, head.weight, head.bias, targets))
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 20\).*mask them in the loss"):
        token_logprobs(hidden, head, torch.full((2, 4), -100))
    with pytest.raises(ValueError, match="shift first"):
        token_logprobs(hidden, head, targets[:, :3])
    with pytest.raises(ValueError, match=r"weight must be \(V, H\) with H = hidden.shape\[-1\] = 8"):
        token_logprobs(hidden, torch.randn(20, 7), targets)
    with pytest.raises(TypeError, match="lm_head must be an nn.Linear or its"):
        token_logprobs(hidden, "lm_head", targets)
    with pytest.raises(TypeError, match="targets must hold integer token ids"):
        token_logprobs(hidden, head, targets.float())


def test_token_logprobs_peak_memory_is_a_fraction_of_the_direct_one():
    from ds_hilore.runtime.memory import PeakMeter

    b, t, h, v = 2, 256, 64, 152_064  # Qwen2's vocabulary
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, h, generator=g, requires_grad=True)
    head = torch.nn.Linear(h, v, bias=False)
    targets = torch.randint(0, v, (b, t), generator=g)

    def run(fn):
        hidden.grad, head.weight.grad = None, None
        with PeakMeter() as meter:
            fn().sum().backward()
        return meter.peak_delta

    direct = run(lambda: _direct_logprobs(hidden, head.weight, None, targets))
    chunked = run(lambda: token_logprobs(hidden, head, targets, chunk_size=32))
    logits_bytes = b * t * v * 4
    print(f"\ntoken_logprobs peak (B={b}, T={t}, H={h}, V={v}): direct {direct / 2**20:.1f} MiB, "
          f"chunked(32) {chunked / 2**20:.1f} MiB, ratio {chunked / direct:.3f}; "
          f"one fp32 logits tensor {logits_bytes / 2**20:.1f} MiB, weight grad {v * h * 4 / 2**20:.1f} MiB")
    assert direct > 2 * logits_bytes  # logits and their gradient/softmax coexist
    assert chunked < 0.2 * direct


# ---------------------------------------------------------------------------------------------
# Exact zero rows on a real (tiny) model
# ---------------------------------------------------------------------------------------------

# NOTE [ Bitwise shapes ]
# Removing rows changes the length of every reduction over B·T (norm weights' gradients are
# sums over all positions). torch's CPU sum (a cascade of 16-row blocks) then adds exactly the
# same partial sums in the same order only while each sequence covers whole blocks and one
# cascade level suffices: T a multiple of 16 and B·T <= 256. Under those shapes dropping rows is
# bitwise; beyond them the norm-weight gradients differ at rounding level (test below).
B_ZERO, T_ZERO = 6, 16
ADV_ZERO = torch.tensor([0.5, 0.0, -1.0, 0.0, 0.7, 0.0])


def _zero_row_batch(b=B_ZERO, t=T_ZERO):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (b, t), generator=g)
    mask = torch.ones(b, t - 1)
    mask[:, :3] = 0  # prompt
    mask[2, 9:] = 0  # right padding
    adv = ADV_ZERO.repeat(math.ceil(b / 6))[:b]
    noise = 0.3 * torch.randn(b, t - 1, generator=g)
    return ids, mask, adv, noise


def _model_logp(model, ids):
    logits = model(ids).logits[:, :-1]  # (B, T-1, V): position t predicts token t+1
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _grads(model, ids, mask, adv, noise, loss_type, hooks=None, **kw):
    model.zero_grad(set_to_none=True)
    ctx = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else _null()
    with ctx:
        logp = _model_logp(model, ids)
    old = logp.detach() + noise  # off-policy, so clipping happens
    out = policy_loss(logp, old, adv, mask, loss_type=loss_type, max_completion_length=T_ZERO,
                      num_items_in_batch=40.0, epsilon_high=5.0 if loss_type == "cispo" else None, **kw)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", dropout=False).float()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_drop_zero_rows_leaves_gradients_bitwise_unchanged(model, loss_type):
    ids, mask, adv, noise = _zero_row_batch()
    full, _ = _grads(model, ids, mask, adv, noise, loss_type)
    sel = drop_zero_rows(adv, mask)
    assert sel.index.tolist() == [0, 2, 4] and sel.dropped == 3
    kept, _ = _grads(model, sel.select(ids), sel.select(mask), sel.select(adv), sel.select(noise), loss_type,
                     **sel.loss_kwargs)
    assert any(g.abs().sum() > 0 for g in full.values())
    differ = [n for n in full if not torch.equal(full[n], kept[n])]
    assert not differ, f"gradients changed for {differ}"


def test_drop_zero_rows_beyond_one_cascade_level_differs_only_by_rounding(model):
    ids, mask, adv, noise = _zero_row_batch(b=20)  # B·T = 320 > 256: NOTE [ Bitwise shapes ]
    full, _ = _grads(model, ids, mask, adv, noise, "grpo")
    sel = drop_zero_rows(adv, mask)
    kept, _ = _grads(model, sel.select(ids), sel.select(mask), sel.select(adv), sel.select(noise), "grpo",
                     **sel.loss_kwargs)
    for n in full:
        torch.testing.assert_close(kept[n], full[n], rtol=1e-6, atol=1e-6 * full[n].abs().max().item())


def test_drop_zero_rows_keeps_one_row_and_refuses_a_kl_term():
    mask = torch.ones(3, 4)
    sel = drop_zero_rows(torch.zeros(3), mask)
    assert sel.index.tolist() == [0] and sel.loss_kwargs["batch_size"] == 3
    assert drop_zero_rows(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([[1.0] * 4, [0.0] * 4, [1.0] * 4])).index.tolist() == [0]
    with pytest.raises(ValueError, match="only beta == 0 allows dropping rows"):
        drop_zero_rows(torch.ones(3), mask, beta=0.04)


def test_drop_zero_rows_keeps_a_row_whose_loss_is_defined():
    """Every row zero and the first one padding: the row kept has a token, so its loss is 0
    (not the 0/0 a row without any would raise) and the rank still runs a backward."""
    mask = torch.tensor([[0.0] * 4, [1.0, 1.0, 0.0, 0.0], [1.0] * 4])
    sel = drop_zero_rows(torch.zeros(3), mask)
    assert sel.index.tolist() == [1]
    logp = torch.zeros(3, 4, requires_grad=True)
    out = policy_loss(sel.select(logp), sel.select(logp.detach()), sel.select(torch.zeros(3)),
                      sel.select(mask), **sel.loss_kwargs)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert (logp.grad == 0).all()
    assert drop_zero_rows(torch.zeros(2), torch.zeros(2, 4)).index.tolist() == [0]  # no tokens at all


@pytest.mark.parametrize("adv", [0.0, -1.0, 1.0])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_a_ratio_that_overflows_gives_the_coefficient_autograd_gives(adv, dual):
    """A token's ratio beyond fp32's range (exp -> inf): autograd's gradient there is inf or NaN
    (a clamp's zero times exp's inf), never 0, so the row is not declared zero where its true
    gradient is not (with the dual clip it once was)."""
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -101.0, -1.5]])  # log-ratios 0, 100 (inf in fp32), 0.5
    out = policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 3), dual_clip=dual)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(out.coefficients.to(grad.dtype), grad, equal_nan=True)
    assert not (out.coefficients[0, 1] == 0)  # inf or NaN, as autograd's


def test_garbage_in_zero_sequences_saved_activations_leaves_gradients_bitwise_unchanged(model):
    """Every floating saved tensor of the model's forward whose dim 0 is B (or B·T) gets finite
    garbage in the rows of A = 0 sequences on unpack; no parameter gradient may change."""
    ids, mask, adv, noise = _zero_row_batch()
    zero_rows = (adv == 0).nonzero().flatten()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    garbled = []

    def pack(x):
        return x

    def unpack(x):
        if not x.is_floating_point() or x.untyped_storage().data_ptr() in params or x.dim() == 0:
            return x
        if x.shape[0] == B_ZERO:
            rows = zero_rows
        elif x.shape[0] == B_ZERO * T_ZERO:
            rows = (zero_rows[:, None] * T_ZERO + torch.arange(T_ZERO)).flatten()
        else:
            return x
        g = torch.Generator().manual_seed(len(garbled))
        noise_rows = 0.5 + torch.rand((rows.numel(), *x.shape[1:]), generator=g)  # finite, nonzero
        garbled.append(tuple(x.shape))
        return x.clone().index_copy_(0, rows, noise_rows.to(x.dtype))

    clean, out = _grads(model, ids, mask, adv, noise, "grpo")
    dirty, _ = _grads(model, ids, mask, adv, noise, "grpo", hooks=(pack, unpack))
    assert (out.coefficients[zero_rows] == 0).all()
    assert len(garbled) >= 20, garbled  # norms, projections, attention, MLP of both layers, the head
    differ = [n for n in clean if not torch.equal(clean[n], dirty[n])]
    assert not differ, f"gradients changed for {differ}"
