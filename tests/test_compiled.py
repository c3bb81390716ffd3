"""torch.compile'd decoder layers under HiLoRe (NOTE [ Compiled layers ] in runtime/units.py).

Compiled -- ``layer.compile()``, ``torch.compile(layer)`` or a compiled backbone -- every layer
call must do exactly what it does uncompiled: the same gradients, bit for bit, for every action
(L included: the same values are packed), the same units stored, packed and recomputed, and the
runtime says once that the layers' forwards run eagerly.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn

import ds_hilore
from models import batch, beyond_gc, gc_loss_and_grads, loss_and_grads, tiny_model

PLANS = ("H", "R", {"*.attn": "H", "*.mlp": "R"}, "L")
TOLD = "run under torch.compile"


def _build():
    return tiny_model("llama", layers=2, hidden=32, heads=4, intermediate=64, dropout=False)


def _config(plan) -> dict:
    config = {"codec_backend": "eager", "min_pack_numel": 0}
    if plan is not None:
        config["force_plan"] = plan
    return config


def _run(plan, compile_layers, steps: int = 2):
    """Gradients of the last of ``steps`` microbatches and the runtime's stats."""
    torch._dynamo.reset()
    model = _build()
    runtime = ds_hilore.attach(model, _config(plan))
    compile_layers(model)
    try:
        for _ in range(steps):
            _, grads = loss_and_grads(model, batch(3, 16))
        stats = runtime.stats
        return grads, {k: stats[k] for k in ("actions", "bytes", "recomputed_units")}
    finally:
        runtime.detach()


@functools.cache
def _inductor_unavailable() -> str | None:
    """Why inductor cannot compile here (the C++ toolchain it needs), or None."""
    try:
        torch.compile(lambda x: x + 1, backend="inductor", fullgraph=True)(torch.ones(3))
    except Exception as exc:  # noqa: BLE001 -- no C++ compiler, or inductor cannot run here
        return f"inductor cannot compile on this machine ({type(exc).__name__}: {exc})"
    finally:
        torch._dynamo.reset()
    return None


def _layer_compile(backend: str):
    def compile_layers(model):
        for layer in model.model.layers:
            layer.compile(backend=backend)
    return compile_layers


def _assert_same(compiled, eager, plan):
    (got, got_stats), (want, want_stats) = compiled, eager
    assert got_stats == want_stats, plan
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (plan, name)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    _inductor_unavailable() is not None, reason=str(_inductor_unavailable())))])
def test_compiled_layers_train_exactly_as_uncompiled_and_say_so_once(backend, caplog):
    caplog.set_level(logging.WARNING, logger="ds_hilore")
    ref = loss_and_grads(_build(), batch(3, 16))[1]
    gc = gc_loss_and_grads(_build(), batch(3, 16))[1]
    for plan in PLANS:
        caplog.clear()
        eager = _run(plan, lambda model: None)
        assert not [r for r in caplog.records if TOLD in r.getMessage()]
        compiled = _run(plan, _layer_compile(backend))
        _assert_same(compiled, eager, plan)
        if plan != "L":  # H and R are exact recoveries
            assert beyond_gc(ref, gc, compiled[0]) == [], plan
        told = [r for r in caplog.records if TOLD in r.getMessage()]
        assert len(told) == 1, [r.getMessage() for r in caplog.records]
    # two microbatches of 4 units: L really packs, R really recomputes
    assert compiled[1]["actions"]["L"] == 8 and compiled[1]["bytes"]["L"] > 0
    assert _run("R", _layer_compile(backend))[1]["recomputed_units"] == 8


@pytest.mark.parametrize("part", ["backbone", "whole model"])
def test_a_compiled_backbone_or_model_trains_exactly_as_uncompiled(part):
    plan = {"*.attn": "L", "*.mlp": "R"}
    eager = _run(plan, lambda model: None)
    compiled = _run(plan, lambda model: (model.model if part == "backbone" else model).compile(
        backend="aot_eager"))
    _assert_same(compiled, eager, part)


@pytest.mark.parametrize("how", ["torch.compile(layer)", "layer.compile()"])
def test_layers_compiled_before_attach_are_discovered_and_keep_their_names(how):
    torch._dynamo.reset()
    model = _build()
    layers = model.model.layers
    for i in range(len(layers)):
        if how == "layer.compile()":
            layers[i].compile(backend="aot_eager")
        else:
            layers[i] = torch.compile(layers[i], backend="aot_eager")
    runtime = ds_hilore.attach(model, _config({"model.layers.0.*": "H", "model.layers.1.*": "R"}))
    try:
        assert [u.name for u in runtime.units] == [
            "model.layers.0.attn", "model.layers.0.mlp", "model.layers.1.attn", "model.layers.1.mlp"]
        grads = loss_and_grads(model, batch(3, 16))[1]
        got = {name.replace("._orig_mod", ""): g for name, g in grads.items()}  # the wrapper's prefix
        assert [u.action for u in runtime.units] == ["H", "H", "R", "R"]
    finally:
        runtime.detach()
    ref = loss_and_grads(_build(), batch(3, 16))[1]
    assert beyond_gc(ref, gc_loss_and_grads(_build(), batch(3, 16))[1], got) == []


def test_scheduler_runs_compiled_layers_from_the_first_microbatch():
    """The allocator's defaults on compiled layers: the first microbatch is profiled all-R."""
    got, stats = _run(None, _layer_compile("aot_eager"), steps=1)
    eager_got, eager_stats = _run(None, lambda model: None, steps=1)
    assert stats["actions"]["R"] == 4 and stats["recomputed_units"] == 4 and stats == eager_stats
    assert all(torch.equal(got[k], eager_got[k]) for k in eager_got)


def _checkpointing_call(self, *args, **kwargs):
    """``GradientCheckpointingLayer.__call__`` of transformers 5.17 (caches aside): the layer's
    whole ``nn.Module.__call__`` goes to the checkpoint function, where 5.25 hands it
    ``forward``."""
    if self.gradient_checkpointing and self.training:
        return self._gradient_checkpointing_func(
            functools.partial(nn.Module.__call__.__get__(self), **kwargs), *args)
    return nn.Module.__call__(self, *args, **kwargs)


@pytest.mark.parametrize("plan", ["H", "R"])
def test_a_compiled_layer_call_handed_to_the_checkpoint_function_runs_eagerly(
        plan, monkeypatch, caplog):
    # transformers that checkpoint __call__ reach the runtime outside the graph under
    # layer.compile(), with a call that runs the compiled graph: stored bytes and recompute
    # followed the graph's saved tensors (H stored more, R refused the layer)
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if "__call__" not in vars(GradientCheckpointingLayer):  # a release that wraps forward
        monkeypatch.setattr(LlamaDecoderLayer, "forward", LlamaDecoderLayer.forward.__wrapped__)
        monkeypatch.setattr(LlamaDecoderLayer, "__call__", _checkpointing_call, raising=False)
    caplog.set_level(logging.WARNING, logger="ds_hilore")
    eager = _run(plan, lambda model: None)
    assert not [r for r in caplog.records if TOLD in r.getMessage()]
    compiled = _run(plan, _layer_compile("aot_eager"))
    _assert_same(compiled, eager, plan)
    assert len([r for r in caplog.records if TOLD in r.getMessage()]) == 1
