"""Exposure: exact-zero sequences, per-slice exposure, and the automatic (hidden-gradient) source."""

import math

import pytest
import torch
from models import batch, tiny_model

import ds_hilore
from ds_hilore import grpo
from ds_hilore.grpo import exposure

EXACT = {"low_precision": "none"}


def _grpo_loss(model, inputs, advantages, *, seed=5):
    """Forward + GRPO loss on the completion (every position after the first)."""
    torch.manual_seed(seed)
    logits = model(**inputs).logits.float()  # (B, T, V)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    mask = inputs["attention_mask"][:, 1:].float()
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    return grpo.policy_loss(logp, old, advantages, mask, model=model)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(arch, inputs, advantages):
    model = tiny_model(arch, layers=2)
    _grpo_loss(model, inputs, advantages).loss.backward()
    return _grads(model)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_zero_advantage_sequences_are_elided_bitwise(arch):
    inputs = batch(batch_size=4, seq=16)
    advantages = torch.tensor([0.0, 1.3, 0.0, -0.7])  # two groups with identical rewards
    ref = _reference(arch, inputs, advantages)
    model = tiny_model(arch, layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    out = _grpo_loss(model, inputs, advantages)  # the loss hands ω to the runtime by itself
    out.loss.backward()
    runtime.end_step()
    stats = runtime.stats["microbatches"][-1]
    assert stats["exact_zero_sequences"] == 2 and stats["exposure_source"] == "analytic"
    assert all(u.action == "H" for u in runtime.units)
    got = _grads(model)
    assert ref.keys() == got.keys()
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []


def test_elided_rows_free_their_bytes():
    inputs = batch(batch_size=4, seq=16)
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    full = _grpo_loss(model, inputs, torch.tensor([0.5, 1.3, -0.2, -0.7]))
    full_bytes = dict(runtime.stats["microbatches"][-1]["bytes"])
    full.loss.backward()
    half = _grpo_loss(model, inputs, torch.tensor([0.0, 1.3, 0.0, -0.7]))
    half_bytes = runtime.stats["microbatches"][-1]["bytes"]
    half.loss.backward()
    # activations of two of four sequences are gone; shared tables and masks stay
    assert 0.4 * full_bytes["H"] < half_bytes["H"] < 0.6 * full_bytes["H"]
    assert [u.action for u in runtime.units] == ["H"] * 4


def test_all_zero_microbatch_skips_recompute():
    inputs = batch(batch_size=2, seq=16)
    advantages = torch.zeros(2)
    ref = _reference("llama", inputs, advantages)
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="R"))
    _grpo_loss(model, inputs, advantages).loss.backward()
    runtime.end_step()
    assert runtime.stats["recomputed_units"] == 0
    got = _grads(model)
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []


def test_exposure_matches_the_formula():
    inputs = batch(batch_size=3, seq=16)
    model = tiny_model("llama", layers=2, dropout=False)
    runtime = ds_hilore.attach(model, {"low_precision": "int8", "codec_backend": "eager",
                                       "min_pack_numel": 64, "force_plan": "L"})
    unit_inputs = {}
    for i, layer in enumerate(model.model.layers):
        for child, kind in (("input_layernorm", "attn"), ("post_attention_layernorm", "mlp")):
            getattr(layer, child).register_forward_pre_hook(
                lambda m, a, name=f"model.layers.{i}.{kind}": unit_inputs.__setitem__(name, a[0].detach()))
    out = _grpo_loss(model, inputs, torch.tensor([1.0, -0.5, 0.0]))
    omega = out.coefficients.abs()  # (B, T-1): hidden positions 0 .. T-2
    covered = torch.zeros(3, 16)
    covered[:, :15] = 1.0
    for name, values in runtime.exposure.items():
        norms = unit_inputs[name].float().norm(dim=-1) * covered  # (B, T)
        a = norms / (norms.sum() / covered.sum())
        expected = (omega * a[:, :15]).sum(dim=1)
        torch.testing.assert_close(torch.tensor(values), expected, rtol=1e-6, atol=0)
    assert len(runtime.exposure) == 4 and runtime.exposure["model.layers.0.mlp"][2] == 0.0
    out.loss.backward()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_automatic_source_sees_the_last_hidden_gradient_first():
    inputs = batch(batch_size=3, seq=16)
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H", exposure_source="hidden_grad"))
    order = []
    for i, layer in enumerate(model.model.layers):  # these fire once a sub-block's backward ran
        for child in ("self_attn", "mlp"):
            getattr(layer, child).register_full_backward_hook(
                lambda m, gi, go, name=f"{i}.{child}": order.append(name))
    on_grad = runtime._elision._on_hidden_grad
    runtime._elision._on_hidden_grad = lambda mb, grad: (order.append("hidden"), on_grad(mb, grad))[1]
    last = {}
    model.model.layers[-1].register_forward_hook(lambda m, a, out: last.update(h=out) or out.retain_grad())
    torch.manual_seed(0)
    logits = model(**inputs).logits
    weights = torch.tensor([1.0, 0.0, 2.0])[:, None, None]  # sequence 1 does not reach the loss
    (logits.square() * weights).mean().backward()
    assert order == ["hidden", "1.mlp", "1.self_attn", "0.mlp", "0.self_attn"]
    expected = last["h"].grad.float().norm(dim=-1)  # (B, T)
    assert torch.equal(runtime.token_weights, expected)
    assert runtime.stats["microbatches"][-1]["exact_zero_sequences"] == 1


def test_policy_loss_finds_the_only_runtime_and_skips_evaluation():
    import gc
    gc.collect()  # runtimes of earlier tests, whose models are gone
    inputs = batch(batch_size=2, seq=16)
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    logits = model(**inputs).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    mask = inputs["attention_mask"][:, 1:].float()
    with torch.no_grad():  # evaluation: no backward follows, nothing is handed over
        grpo.policy_loss(logp.detach(), logp.detach(), torch.tensor([0.0, 1.0]), mask)
    assert runtime.stats["microbatches"][-1]["exposure_source"] is None
    others = [rt for rt in ds_hilore.runtime.core._ATTACHED if rt is not runtime]
    for rt in others:
        rt.detach()
    grpo.policy_loss(logp, logp.detach(), torch.tensor([0.0, 1.0]), mask).loss.backward()
    assert runtime.stats["microbatches"][-1]["exact_zero_sequences"] == 1


@pytest.mark.parametrize("plan", ["H", "R"])
def test_loss_terms_beyond_the_coefficients_fall_back_to_recompute(plan, caplog):
    # an entropy bonus reaches sequences whose GRPO coefficients are zero: elision must not hold
    inputs = batch(batch_size=4, seq=16)
    advantages = torch.tensor([0.0, 1.3, 0.0, -0.7]) if plan == "H" else torch.zeros(4)

    def loss_with_entropy(model):
        torch.manual_seed(5)
        logits = model(**inputs).logits.float()
        logp = logits[:, :-1].log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
        mask = inputs["attention_mask"][:, 1:].float()
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        return grpo.policy_loss(logp, logp.detach(), advantages, mask, model=model).loss - 0.01 * entropy

    reference = tiny_model("llama", layers=2)
    loss_with_entropy(reference).backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan=plan))
    loss_with_entropy(model).backward()
    runtime.end_step()
    ref, got = _grads(reference), _grads(model)
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []
    assert "get gradient from other loss terms" in caplog.text
    assert runtime.stats["recomputed_units"] == 4  # every layer fell back to R


def test_coefficients_go_to_the_forward_their_log_probs_came_from():
    inputs = batch(batch_size=4, seq=16)
    other = batch(batch_size=4, seq=16, seed=3)
    advantages = torch.tensor([0.0, 1.3, 0.0, -0.7])

    def two_forwards(model):
        torch.manual_seed(5)
        logits = model(**inputs).logits.float()
        extra = model(**other).logits.float().square().mean()  # a second forward with gradients
        logp = logits[:, :-1].log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
        mask = inputs["attention_mask"][:, 1:].float()
        return grpo.policy_loss(logp, logp.detach(), advantages, mask, model=model).loss + extra

    reference = tiny_model("llama", layers=2)
    two_forwards(reference).backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    two_forwards(model).backward()
    runtime.end_step()
    assert [m["exact_zero_sequences"] for m in runtime.stats["microbatches"]] == [2, 0]
    ref, got = _grads(reference), _grads(model)
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []


# ---- later PPO epochs: the previous epoch's ratios predict the clipped tokens --------------
def _epoch_case():
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]).float()
    ratios = torch.tensor([[1.3, 1.0, 0.9, 5.0],    # 1.3 clipped above (A > 0); 5.0 is padding
                           [0.7, 1.25, 1.0, 0.6],   # 0.7, 0.6 clipped below (A < 0); 1.25 is not
                           [1.5, 1.5, 1.5, 1.0],    # every response token clipped
                           [1.0, 1.0, 1.0, 1.0]])   # A = 0
    return advantages, mask, ratios


def test_later_epoch_exposure_zeroes_the_clipped_tokens():
    advantages, mask, ratios = _epoch_case()
    ratios[0, 3] = math.inf  # off the mask, whatever it is, it counts nothing
    got = exposure.predicted_after_clip(advantages, mask, ratios, epsilon_low=0.2, epsilon_high=0.2)
    assert got[0] == pytest.approx(1.0 * (1.0 + 0.9)) and got[1] == pytest.approx(0.5 * (1.25 + 1.0))
    # every token clipped: packed first (the least), never predicted 0 -- the prediction is not
    # exact, and only an exact zero may be elided
    assert 0 < got[2] < min(got[0], got[1])
    assert got[3] == 0.0  # A = 0: exact
    assert exposure.predicted_after_clip(advantages, mask, None, 0.2, 0.2) == \
        exposure.predicted(advantages, mask)  # epoch 1: nothing known yet


def test_later_epoch_exposure_is_the_coefficients_when_the_ratios_are_this_epochs():
    advantages, mask, ratios = _epoch_case()
    old = torch.zeros(4, 4)
    logp = ratios.log().requires_grad_()
    out = grpo.policy_loss(logp, old, advantages, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2)
    weight = 1.0 / mask.sum()  # bnpo: one weight for every token
    exact = (out.coefficients.abs() * mask).sum(dim=1) / weight
    got = torch.tensor(exposure.predicted_after_clip(advantages, mask, ratios, 0.2, 0.2))
    torch.testing.assert_close(got[[0, 1, 3]], exact[[0, 1, 3]].float(), rtol=1e-6, atol=0)
    assert exact[2] == 0 and got[2] > 0  # all clipped: exact 0 here, but predicted only
