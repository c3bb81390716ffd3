"""Derived tensors: pointwise saved tensors that H and L units re-derive instead of keeping.

A gated MLP's activation silu(g) and product silu(g) * u (and, in full fine-tuning, a norm's
x * rsqrt(var)) are re-derived from the tensors the unit keeps: exact byte counts with and
without ``derive_pointwise``, bitwise-equal gradients under exact plans, bounded error under L,
the profile counting the same bytes the runtime keeps, and ``derivation`` refusing what it
cannot prove.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import batch, loss_and_grads, tiny_model, with_lora

import ds_hilore
from ds_hilore.runtime.derived import derivation

HIDDEN, INTER, LAYERS = 32, 64, 2
B, T = 3, 16  # models.batch()


def _bytes_and_grads(model, config, plan="H"):
    """(bytes kept by action, reference loss and grads, loss and grads under ``plan``)."""
    inputs = batch()
    ref_loss, ref = loss_and_grads(model, inputs)
    runtime = ds_hilore.attach(model, dict(config, force_plan=plan))
    try:
        loss, grads = loss_and_grads(model, inputs)
        stats = runtime.stats["bytes"]
    finally:
        runtime.detach()
    return stats, ref_loss, ref, loss, grads


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_derived_tensors_hold_no_bytes_and_stay_bitwise_exact(arch, lora):
    """Per layer, full fine-tuning re-derives silu(g), silu(g) * u (both (N, I)) and the
    post-attention norm's x * rsqrt(var) ((N, H)); with LoRA (dropout before lora_A) only
    silu(g): the product is saved by nobody, its dropped-out copy is not pointwise-derivable."""
    tokens = B * T
    per_layer = 4 * tokens * (2 * INTER + HIDDEN) if not lora else 4 * tokens * INTER
    got = {}
    for derive in (True, False):
        model = tiny_model(arch, layers=LAYERS, hidden=HIDDEN, intermediate=INTER)
        model = with_lora(model) if lora else model
        for plan in ("H", {"*.attn": "R", "*.mlp": "H"}, {"*.attn": "H", "*.mlp": "R"}):
            stats, ref_loss, ref, loss, grads = _bytes_and_grads(
                model, {"low_precision": "none", "derive_pointwise": derive}, plan)
            assert torch.equal(loss, ref_loss), (derive, plan)
            assert [k for k in ref if not torch.equal(ref[k], grads[k])] == [], (derive, plan)
            got[derive, str(plan)] = stats["H"]
    assert got[False, "H"] - got[True, "H"] == LAYERS * per_layer
    # all of it is the MLP unit's (the norm after the attention belongs to it)
    mlp_h = str({"*.attn": "R", "*.mlp": "H"})
    assert got[False, mlp_h] - got[True, mlp_h] == LAYERS * per_layer
    attn_h = str({"*.attn": "H", "*.mlp": "R"})
    assert got[False, attn_h] == got[True, attn_h]


def test_packed_units_derive_from_unpacked_inputs_with_bounded_error():
    """Under L the derived tensors come from the unpacked inputs: fewer packed bytes, and the
    gradient error stays of the codec's size."""
    config = {"low_precision": "int8", "codec_backend": "eager", "min_pack_numel": 0}
    errors, packed = {}, {}
    for derive in (True, False):
        model = tiny_model("llama", layers=LAYERS, hidden=HIDDEN, intermediate=INTER, dropout=False)
        stats, _, ref, _, grads = _bytes_and_grads(model, dict(config, derive_pointwise=derive), "L")
        num = sum((grads[k] - ref[k]).double().pow(2).sum() for k in ref)
        den = sum(ref[k].double().pow(2).sum() for k in ref)
        errors[derive] = float((num / den).sqrt())
        packed[derive] = stats["L"]
    # measured 0.0017 either way (int8 on every unit): ~3x room
    assert 0 < errors[True] < 0.005 and 0 < errors[False] < 0.005, errors
    # int8, one fp32 scale per token and the run's (2,) fp64 error sums, for each of the
    # (N, I) tensors silu(g), silu(g) * u and the (N, H) x * rsqrt(var), no longer packed
    n = B * T
    assert packed[False] - packed[True] == LAYERS * (2 * (n * INTER + 4 * n + 16) + n * HIDDEN + 4 * n + 16)


def test_profile_counts_the_bytes_the_runtime_keeps():
    """The profiler (all-R microbatches, counting what the re-run saves) and the runtime
    (all-H, what the forward keeps) agree on the H bytes, derived tensors re-derived or kept
    (the policy keeps them when its plan stores everything and they fit: ``derives``)."""
    model = tiny_model("qwen2", layers=LAYERS, hidden=HIDDEN, intermediate=INTER, dropout=False)
    inputs = batch()
    runtime = ds_hilore.attach(model, {"low_precision": "none", "profile_microbatches": 2,
                                       "calibration_microbatches": 0,
                                       "plan_validation_microbatches": 0})
    try:
        for _ in range(2):
            loss_and_grads(model, inputs)
        bucket = next(iter(runtime.policy.buckets.values()))
        profile = bucket.profiler.result()
        assert any(u.derive_s > 0 for u in profile.units)
        assert all(u.derived_bytes > 0 for u in profile.units if u.kind == "mlp")
        runtime.config.force_plan = "H"
        loss_and_grads(model, inputs)
        kept = runtime.stats["bytes"]["H"]
        derives = runtime.policy.derives(bucket)  # what this microbatch was told
    finally:
        runtime.detach()
    derived = 0 if derives else sum(u.derived_bytes for u in profile.units)
    assert sum(u.h_bytes for u in profile.units) + derived == kept


def _saved(fn, *tensors):
    """The tensors autograd saves while ``fn`` runs, in order."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*tensors)
    return out, saved


def _sources(*tensors):
    return {(t.grad_fn, t.output_nr): (None, (t.size(), t.stride(), t.storage_offset()), t.dtype)
            for t in tensors}


def test_derivation_accepts_only_proven_pointwise_outputs():
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    g, u = x @ w1, x @ w2
    a = F.silu(g)
    h = a * u
    assert derivation(a, _sources(g)) is not None
    assert derivation(h, _sources(a, u)) is not None
    assert derivation(h.view(-1), _sources(a, u)) is not None  # a view: its base is derived
    assert derivation(a, {}) is None  # the input was not saved by the unit
    assert derivation(h, _sources(a)) is None  # one input missing
    assert derivation(g, _sources(x)) is None  # a matmul is what R is for
    gelu = F.gelu(g, approximate="tanh")
    op, _ = derivation(gelu, _sources(g))
    assert torch.equal(op(g.detach()), gelu.detach())  # the approximation is carried over
    assert derivation(a.t() * u.t(), _sources(a.t(), u.t())) is None  # not laid out densely
    m = x * torch.ones(6, 8)  # an input without gradient: no edge to match
    assert derivation(m, _sources(x)) is None
    v = torch.randn(6, 16, requires_grad=True)
    b = a * u
    before = _sources(b, v)
    b.mul_(v)  # a MulBackward0 whose inputs are known, but b was changed in place: refused
    assert type(b.grad_fn).__name__ == "MulBackward0" and b._version == 1
    assert derivation(b, before) is None


def test_derived_tensors_are_kept_only_where_they_fit_at_the_bucket_s_longest():
    """A plan priced for the bucket's longest microbatch (bytes x ``byte_scale``) keeps the
    derived tensors only if they fit the headroom at that length too: 2 x 10 MiB derived where
    the profile was measured, 2 x 20 MiB at twice the length, against 30 MiB of room."""
    from ds_hilore.plan.allocate import Plan
    from ds_hilore.plan.buckets import Bucket
    from ds_hilore.plan.profile import BucketProfile, Profiler, UnitCost

    mib = 2**20
    runtime = ds_hilore.attach(tiny_model("qwen2", layers=2), {"low_precision": "none"})
    try:
        units = [UnitCost(name=f"l{i}.mlp", kind="mlp", layer=i, pos=0, h_bytes=20 * mib,
                          derived_bytes=10 * mib) for i in range(2)]
        profile = BucketProfile((4, 128), units, gc_peak_bytes=1000 * mib,
                                baseline_bytes=800 * mib, repeats=2, seconds=0.1)
        plan = Plan({u.name: "H" for u in units}, 80 * mib, 1.0, 0.0, 110 * mib, 0.0)
        bucket = Bucket(profile.key, Profiler(profile.key, 0), profile, plan=plan)
        assert not runtime.policy.derives(bucket)  # measured length: 80 + 20 <= 110 MiB
        bucket.byte_scale = {"mlp": 2.0}
        assert runtime.policy.derives(bucket)  # the longest: 80 + 40 > 110 MiB
    finally:
        runtime.detach()
