"""The profile's bytes are what the runtime holds (NOTE [ Profiling ] in plan/profile.py): an H
or L unit's with the token norms of its input (exposure's token weights, held while a codec is
on) and, under L, its input kept whole as the forward keeps it; a fast-forward's with the RNG
state it keeps. Each is counted against what a forward under that plan leaves alive, to the
byte."""

from __future__ import annotations

import torch
from models import batch, loss_and_grads, tiny_model

import ds_hilore
from ds_hilore.runtime.memory import LiveStorages

HIDDEN, INTER, LAYERS = 32, 64, 2
B, T = 3, 16  # models.batch()
CONFIG = {"low_precision": "int8", "codec_backend": "eager", "min_pack_numel": 0,
          "derive_pointwise": False, "profile_microbatches": 2, "calibration_microbatches": 0,
          "plan_validation_microbatches": 0}
ATTN_H = {"*.attn": "H", "*.mlp": "R"}


def _profiled(model, inputs):
    """The runtime attached to ``model`` and the profile of ``inputs``' bucket."""
    runtime = ds_hilore.attach(model, CONFIG)
    for _ in range(4):
        loss_and_grads(model, inputs)
        runtime.end_step()
        bucket = next(iter(runtime.policy.buckets.values()), None)
        if bucket is not None and bucket.profiler.done:
            return runtime, {c.name: c for c in bucket.profiler.result().units}
    raise AssertionError("the bucket was not profiled")


def _held(model, runtime, inputs, plan):
    """Storage bytes a forward under ``plan`` leaves alive, each unit's bytes as the runtime
    reports them, and per unit the bytes of the RNG states its fast-forwards took beyond the
    layer's own (which every action keeps): host tensors the runtime does not report, and not
    an aten op's, so ``LiveStorages`` does not see them either."""
    runtime.config.force_plan = plan
    embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
    torch.manual_seed(123)
    with LiveStorages() as tracker:
        logits = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits
    live = tracker.live_bytes()
    units = {u.name: u.nbytes for u in runtime.units}
    rng = dict.fromkeys(units, 0)
    for layer in runtime._layers:
        frame, seen = runtime._mb.frame(layer.index), set()
        if frame is None:  # all R, run checkpointed: no fast-forward (NOTE [ A layer that keeps nothing ])
            assert layer.index in runtime._mb.checkpointed
            continue
        for call, ff in frame.ff.items():
            if ff.rng is not None and ff.rng is not frame.rng and id(ff.rng) not in seen:
                seen.add(id(ff.rng))
                unit = layer.units[layer.split.unit_of_call(call)].name
                rng[unit] += ff.rng.cpu.untyped_storage().nbytes()
    logits.float().sum().backward()
    runtime.end_step()
    model.zero_grad(set_to_none=True)
    return live, units, rng


def test_profiled_H_and_L_bytes_hold_the_token_norms():
    """All-H and all-L hold, per unit, what the profile says: (B, T) fp32 token norms included,
    and under L the MLP's input (the residual, a storage entering the unit) whole -- in the
    profile's re-run a storage of its own, not one the forward's entries name."""
    model = tiny_model("llama", layers=LAYERS, hidden=HIDDEN, intermediate=INTER)
    inputs = batch()
    runtime, costs = _profiled(model, inputs)
    try:
        gc_live, _, _ = _held(model, runtime, inputs, "R")
        for plan, field in (("H", "h_bytes"), ("L", "l_bytes")):
            live, units, _ = _held(model, runtime, inputs, plan)
            assert units == {name: getattr(c, field) for name, c in costs.items()}, plan
            assert live - gc_live == sum(units.values()), plan
        assert all(c.h_bytes > c.l_bytes > B * T * 4 for c in costs.values())
    finally:
        runtime.detach()


def test_profiled_fast_forward_bytes_hold_the_rng_state_it_keeps():
    """attn H before mlp R: the attention unit holds its H bytes and its fast-forward's -- the
    attention's output and the RNG state after its dropout drew."""
    model = tiny_model("llama", layers=LAYERS, hidden=HIDDEN, intermediate=INTER)  # dropout on
    inputs = batch()
    runtime, costs = _profiled(model, inputs)
    try:
        gc_live, _, _ = _held(model, runtime, inputs, "R")
        live, units, rng = _held(model, runtime, inputs, ATTN_H)
    finally:
        runtime.detach()
    held = {name: units[name] + rng[name] for name in units}
    assert held == {name: (c.h_bytes + c.ff_bytes if c.kind == "attn" else 0) for name, c in costs.items()}
    assert live - gc_live == sum(units.values())
    state = torch.get_rng_state().untyped_storage().nbytes()  # one per layer: after self_attn
    assert rng == {name: (state if c.kind == "attn" else 0) for name, c in costs.items()}


def test_downgrade_to_R_frees_the_token_norms():
    """A unit sent to R after the forward frees all it held, its token norms too."""
    model = tiny_model("llama", layers=LAYERS, hidden=HIDDEN, intermediate=INTER)
    inputs = batch()
    runtime = ds_hilore.attach(model, dict(CONFIG, force_plan="H"))
    try:
        embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
        with LiveStorages() as tracker:
            logits = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits
        before = tracker.live_bytes()
        held = sum(runtime.stats["microbatches"][-1]["bytes"].values())
        for unit in runtime.units:
            runtime.downgrade(unit.name, "R")
        assert before - tracker.live_bytes() == held > 0
        logits.float().sum().backward()
    finally:
        runtime.detach()
