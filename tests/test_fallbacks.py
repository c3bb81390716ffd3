"""Fallbacks to recompute: a check read in the backward (NOTE [ One read per microbatch ] in
storage.py) sends a unit to R; the fallback must really recompute every tensor it disowned,
decide the same units on every rank, and be reported as what ran.

Exact paths are compared bitwise against the model without checkpointing, on CPU fp32 (or
under the same bf16 autocast as the reference).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn as nn
from models import batch, loss_and_grads, tiny_model

import ds_hilore
from ds_hilore.plan.allocate import unit_options

T, H = 8, 16


class MaskedGate(nn.Module):
    """A leaf holding a frozen (T, H) parameter shaped like the (T, H) bf16 mask it saves:
    under autocast the mask looks like a cast of the parameter, and is not one."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(T, H), requires_grad=False)
        self.w = nn.Parameter(torch.randn(H, H) * 0.1)

    def forward(self, x):  # (1, T, H)
        m = (x[0].detach() > 0).to(torch.bfloat16)  # (T, H) bf16, saved by the product below
        return (m * (x[0] @ self.w).to(torch.bfloat16)).float()[None] + self.p.sum() * 0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = nn.Linear(H, H), MaskedGate()

    def forward(self, x):
        return x + self.mlp(x + self.attn(x))


class Net(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _grads(model, x, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x.clone().requires_grad_(True))  # (1, T, H)
    (out.float() * torch.linspace(-1, 1, H)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _differing(ref: dict, got: dict) -> list[str]:
    assert ref.keys() == got.keys()
    return [n for n in ref if not torch.equal(ref[n], got[n])]


@pytest.mark.parametrize("plan", ["H", "R"])
def test_a_disproved_weight_cast_is_recomputed_not_read(plan):
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    x = torch.randn(1, T, H)
    ref = _grads(reference, x, autocast=True)
    runtime = ds_hilore.attach(model, {"layer_pattern": "layers.*", "force_plan": plan,
                                       "low_precision": "none"})
    _grads(model, x, autocast=True)  # discovery
    got = _grads(model, x, autocast=True)
    assert _differing(ref, got) == []
    last = runtime.stats["microbatches"][-1]
    assert last["actions"] == {"H": 0 if plan == "R" else 2, "L": 0,
                               "R": 4 if plan == "R" else 2, "E": 0}
    assert [u.action for u in runtime.units] == (["R"] * 4 if plan == "R" else ["H", "R"] * 2)
    assert last["recomputed_units"] == (4 if plan == "R" else 2)


class OtherRank:
    """``runtime.collective`` of a 2-rank run with the other rank simulated: it agrees with
    this rank on every collective, except that its checks failed in the units ``flagged``, in
    the all-reduce that carries the unit flags of failed checks: the elision's at the
    coefficients (``agree``: [a sequence kept, all zero, capture flags if all zero, if not,
    the failed checks, ...], one flag per unit in each) or ``Microbatch.settle``'s (the unit
    flags, then the leak flag; ``units`` None: only there). Only the collective is a
    stand-in."""

    def __init__(self, flagged: set[int], units: int | None = None):
        self.flagged, self.units = flagged, units
        self.calls: list[tuple[str, list]] = []

    @property
    def settle_calls(self) -> list[list[int]]:
        return [values for where, values in self.calls if where == "settle"]

    def all_reduce_max(self, values: list[int]) -> list[int]:
        if sys._getframe(1).f_code.co_name != "settle":
            return list(values)
        self.calls.append(("settle", list(values)))
        return [max(v, int(i in self.flagged)) for i, v in enumerate(values)]

    def all_reduce_max_float(self, values: list[float]) -> list[float]:
        if sys._getframe(1).f_code.co_name != "agree" or self.units is None:
            return list(values)
        failed = 2 + 2 * self.units  # where agree's failed-check flags begin
        self.calls.append(("agree", list(values[failed:failed + self.units])))
        return [max(v, float(i - failed in self.flagged)) for i, v in enumerate(values)]


def test_a_unit_flagged_by_another_rank_is_recomputed_here_too():
    model = tiny_model("llama", layers=2)
    inputs = batch()
    ref_loss, ref = loss_and_grads(model, inputs)
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    loss_and_grads(model, inputs)  # discovery
    flagged = runtime.units[1]  # layer 0's mlp: nothing failed here
    runtime.collective = OtherRank({flagged.index}, len(runtime.units))
    runtime.matched_calls = True  # as attach under several ranks: the checks are every rank's
    loss, grads = loss_and_grads(model, inputs)
    # once per microbatch, at the coefficients (here the gradient at the last hidden state):
    # 4 units, none failed here; no sequence is zero on any rank, so no check at the top of
    # the backward and no second all-reduce there
    assert runtime.collective.calls == [("agree", [0, 0, 0, 0])]
    assert torch.equal(loss, ref_loss)
    assert [n for n in ref if not torch.equal(ref[n], grads[n])] == []
    last = runtime.stats["microbatches"][-1]
    assert last["recomputed_units"] == 1
    assert last["actions"] == {"H": 3, "L": 0, "R": 1, "E": 0}
    assert [u.action for u in runtime.units] == ["H", "R", "H", "H"]


def _sdpa_model(layers: int = 2):
    model = tiny_model("qwen2", layers=layers, hidden=64, intermediate=128, dropout=False)
    model.config._attn_implementation = "sdpa"
    return model


def _padded(batch_size: int = 4, seq: int = 32, seed: int = 0):
    inputs = batch(batch_size, seq, seed)  # row 0 left-padded: SDPA saves an additive -inf mask
    inputs["attention_mask"][2, :5] = 0
    return inputs


FP8 = {"low_precision": "fp8_e4m3"}  # no -inf payload: NOTE [ -inf in int8 ] in codecs.py


def test_sdpa_attention_forced_L_with_padding_falls_back_to_R_and_is_reported_R():
    model = _sdpa_model()
    inputs = _padded()
    ref_loss, ref = loss_and_grads(model, inputs)
    runtime = ds_hilore.attach(model, {"force_plan": {"*.attn": "L", "*.mlp": "H"},
                                       "codec_backend": "eager", "min_pack_numel": 0, **FP8})
    loss_and_grads(model, inputs)  # discovery
    loss, grads = loss_and_grads(model, inputs)
    assert torch.equal(loss, ref_loss)
    assert [n for n in ref if not torch.equal(ref[n], grads[n])] == []  # attn R, mlp H: exact
    last = runtime.stats["microbatches"][-1]
    assert last["nonfinite_slices"] >= 2
    assert last["recomputed_units"] == 2
    assert last["actions"] == {"H": 2, "L": 0, "R": 2, "E": 0}
    assert last["bytes"]["L"] == 0
    assert [u.action for u in runtime.units] == ["R", "H", "R", "H"]
    assert runtime.stats["packed_rel_error_max"] == 0.0  # nothing packed was used


def test_sdpa_attention_forced_L_with_padding_packs_its_minus_inf_mask_in_int8():
    """NOTE [ -inf in int8 ]: the additive mask SDPA saves is packed exactly, the unit stays L."""
    model = _sdpa_model()
    inputs = _padded()
    ref_loss, ref = loss_and_grads(model, inputs)
    runtime = ds_hilore.attach(model, {"force_plan": {"*.attn": "L", "*.mlp": "H"},
                                       "codec_backend": "eager", "min_pack_numel": 0})
    loss_and_grads(model, inputs)  # discovery
    loss, grads = loss_and_grads(model, inputs)
    assert torch.equal(loss, ref_loss)  # the forward is the model's
    last = runtime.stats["microbatches"][-1]
    assert last["nonfinite_slices"] == 0 and last["recomputed_units"] == 0
    assert last["actions"] == {"H": 2, "L": 2, "R": 0, "E": 0}
    assert last["bytes"]["L"] > 0
    assert [u.action for u in runtime.units] == ["L", "H", "L", "H"]
    num = sum((grads[n] - ref[n]).double().square().sum() for n in ref)
    den = sum(ref[n].double().square().sum() for n in ref)
    assert 0 < (num / den).sqrt() < 0.01  # packed, within L's bound, and finite
    assert 0 < runtime.stats["packed_rel_error_max"] < 0.02


def _profile_padded(extra: dict):
    from ds_hilore.grpo import policy_loss

    model = _sdpa_model()
    runtime = ds_hilore.attach(model, {"codec_backend": "eager", "min_pack_numel": 0,
                                       "profile_microbatches": 2, "calibration_microbatches": 0,
                                       "plan_validation_microbatches": 0, "memory_budget": 1.6,
                                       **extra})
    for step in range(3):
        inputs = _padded(seed=step)
        ids = inputs["input_ids"]
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()  # (B, T - 1, V)
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = inputs["attention_mask"][:, 1:].bool()
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        policy_loss(logp, logp.detach(), adv, mask, model=model).loss.backward()
        runtime.end_step()
        model.zero_grad(set_to_none=True)
    profile = runtime.policy.buckets[(4, 32)].profile
    assert profile is not None
    return profile


def test_sdpa_profile_with_padding_excludes_attention_from_L_and_counts_non_finite():
    for cost in _profile_padded(FP8).units:
        assert cost.rel_error == cost.rel_error and cost.rel_error > 0  # finite samples only
        if cost.kind == "attn":  # fp8 cannot pack the additive mask: L is not an option
            assert cost.nonfinite_tensors >= 1
            assert cost.l_bytes == cost.h_bytes
            assert "L" not in unit_options(cost, True, 0.5) and "S" not in unit_options(cost, True, 0.5)
        else:
            assert cost.nonfinite_tensors == 0 and cost.l_bytes < cost.h_bytes


def test_sdpa_profile_with_padding_offers_attention_L_in_int8():
    for cost in _profile_padded({}).units:
        assert cost.nonfinite_tensors == 0 and 0 < cost.rel_error < 0.02
        assert cost.l_bytes < cost.h_bytes and "L" in unit_options(cost, True, 0.5)


class _Recorded:
    """A stand-in for ``runtime.collective`` (the collective only): records what this rank
    sends; with ``other`` (what another rank sent, call by call), returns the element-wise max."""

    def __init__(self, other: list | None = None):
        self.other, self.sent = other, []

    def all_reduce_max_float(self, values: list[float]) -> list[float]:
        self.sent.append(list(values))
        theirs = self.other[len(self.sent) - 1] if self.other is not None else values
        assert len(theirs) == len(values)
        return [max(a, b) for a, b in zip(values, theirs)]


def test_a_unit_excluded_from_L_on_one_rank_stays_excluded_after_the_ranks_agree():
    """Rank A met a non-finite tensor in the unit (no L: its L bytes are its H bytes); rank B
    did not and profiled more H bytes. The max over ranks of L bytes alone would fall below
    the max of H bytes and offer L again on every rank."""
    from ds_hilore.plan.profile import BucketProfile, UnitCost

    model = tiny_model("llama", layers=1)
    runtime = ds_hilore.attach(model, {"low_precision": "none"})

    def profile(h_bytes, l_bytes, nonfinite):
        cost = UnitCost("u", "attn", 0, 0, recompute_s=1.0, h_bytes=h_bytes, l_bytes=l_bytes,
                        rel_error=0.01, nonfinite_tensors=nonfinite)
        return BucketProfile((4, 32), [cost], gc_peak_bytes=1 << 20, baseline_bytes=0,
                             repeats=1, seconds=0.0)

    rank_b = _Recorded()
    runtime.collective = rank_b
    runtime.policy._agree(profile(h_bytes=1200, l_bytes=300, nonfinite=0))
    runtime.collective = _Recorded(other=rank_b.sent)
    agreed = runtime.policy._agree(profile(h_bytes=1000, l_bytes=1000, nonfinite=1)).units[0]
    assert (agreed.h_bytes, agreed.l_bytes, agreed.nonfinite_tensors) == (1200, 1200, 1)
    assert "L" not in unit_options(agreed, True, 0.5) and "S" not in unit_options(agreed, True, 0.5)
    runtime.detach()


def _grpo_grads(model, ids, adv):
    from ds_hilore.grpo import policy_loss

    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # the same dropout masks in every run
    logits = model(input_ids=ids).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss = policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=model).loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_leak_seen_by_another_rank_recomputes_the_elided_layers_here_too():
    """The leak check at the top of the backward rides on the all-reduce of the deferred
    checks (one for both): the other rank's leak flag, appended after the unit flags, sends
    every elided layer of this rank to R -- exact, and recomputed."""
    model = tiny_model("llama", layers=2)
    ids = batch()["input_ids"]
    adv = torch.tensor([1.0, 0.0, -1.0])  # sequence 1 elided
    ref = _grpo_grads(model, ids, adv)
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    _grpo_grads(model, ids, adv)  # discovery
    runtime.collective = OtherRank(set())
    runtime.matched_calls = True  # as attach under several ranks: the checks are every rank's
    _grpo_grads(model, ids, adv)
    assert runtime.stats["microbatches"][-1]["recomputed_units"] == 0  # nobody leaked
    runtime.collective = OtherRank({len(runtime.units)})  # the flag after the units': a leak
    grads = _grpo_grads(model, ids, adv)
    assert runtime.collective.settle_calls == [[0] * (len(runtime.units) + 1)]  # one call
    assert [n for n in ref if not torch.equal(ref[n], grads[n])] == []
    assert runtime.stats["microbatches"][-1]["recomputed_units"] == 4
