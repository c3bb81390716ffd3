"""Training scripts that use a forward in ways beyond forward -> loss -> backward: a forward that
stops below the last layer, two losses handing coefficients for one forward, ``autograd.grad``
on a microbatch of zeros, a forward with grad between a microbatch and its backward, and a
runtime detached from a model that is then dropped. Gradients are asserted bitwise against the
same model without HiLoRe (fp32, CPU)."""

from __future__ import annotations

import copy
import gc
import logging
import weakref

import pytest
import torch
from models import VOCAB, one_torch_thread, tiny_model

import ds_hilore
from ds_hilore.grpo import policy_loss

B, T, PROMPT, LAYERS = 4, 24, 4, 3
SPREAD = torch.tensor([1.0, -1.0, 0.5, -0.5])
PART = torch.tensor([1.0, 0.0, -0.5, 0.0])  # sequences 1 and 3: zero coefficients
ZERO = torch.zeros(B)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def _ids(seed: int, length: int = T) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, length), generator=torch.Generator().manual_seed(1000 + seed))


def _logits(model, ids, layers: int | None = None) -> torch.Tensor:
    """(B, T-1, V) fp32; ``layers``: the forward runs only the first ``layers`` decoder layers
    (an early exit: transformers' decoders loop over ``config.num_hidden_layers``)."""
    full = model.config.num_hidden_layers
    model.config.num_hidden_layers = layers or full
    try:
        return model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    finally:
        model.config.num_hidden_layers = full


def _grpo(model, logits, ids, advantages) -> torch.Tensor:
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    mask = torch.ones_like(logp)
    mask[:, :PROMPT] = 0
    return policy_loss(logp, logp.detach(), advantages, mask, model=model).loss


def _entropy(logits) -> torch.Tensor:  # a loss term the coefficients do not see
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def _pair(config: dict):
    model = tiny_model("qwen2", layers=LAYERS, hidden=64, intermediate=128, dropout=False)
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, dict({"low_precision": "none"}, **config))
    ids = _ids(99)
    _grpo(model, _logits(model, ids), ids, SPREAD).backward()  # discovery
    model.zero_grad(set_to_none=True)
    runtime.end_step()
    return model, ref, runtime


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(got: list, ref: list) -> bool:
    return all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(got, ref))


@pytest.mark.parametrize("mode", [True, "whole"])
@pytest.mark.parametrize("advantages", [PART, ZERO], ids=["part", "zero"])
def test_a_forward_that_stops_below_the_last_layer_recomputes_what_it_elided(mode, advantages):
    """No check runs at the top of such a forward, so nothing it elided is verified: its units
    recompute, and an entropy bonus reaching the zero-coefficient sequences stays exact."""
    model, ref, runtime = _pair({"force_plan": "H", "elide_zero_rows": mode})
    try:
        ids = _ids(1)
        for m in (model, ref):
            logits = _logits(m, ids, layers=LAYERS - 1)
            (_grpo(m, logits, ids, advantages) - 0.1 * _entropy(logits)).backward()
        assert _same(_grads(model), _grads(ref))
        runtime.end_step()
    finally:
        runtime.detach()


def test_rows_elided_at_capture_under_a_forward_that_stops_short_are_recomputed():
    """A plan eliding sequences at capture (a prediction of zero, here wrong), a forward to the
    middle layer and a loss that hands no coefficients: its units recompute, exact."""
    model, ref, runtime = _pair({})
    try:
        runtime.set_plan("H", rows={u.name: ("H", "E", "H", "E") for u in runtime.units})
        ids = _ids(2)
        weights = torch.tensor([1.0, 0.3, -0.5, 0.2])[:, None]  # every sequence weighted
        for m in (model, ref):
            logits = _logits(m, ids, layers=LAYERS - 1)
            logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (logp * weights).mean().backward()
        assert _same(_grads(model), _grads(ref))
        runtime.end_step()
    finally:
        runtime.detach()


@pytest.mark.parametrize("mode", [True, "whole"])
@pytest.mark.parametrize("first, second", [(PART, SPREAD), (ZERO, SPREAD), (ZERO, PART)],
                         ids=["part-spread", "zero-spread", "zero-part"])
def test_coefficients_handed_twice_elide_only_what_both_show_zero(mode, first, second, caplog):
    """Two GRPO losses on one forward's log-probs (the first one's coefficients elide sequences
    the second, backpropagated, reaches): those are recomputed, and it is said once."""
    model, ref, runtime = _pair({"force_plan": "H", "elide_zero_rows": mode})
    try:
        ids = _ids(3)
        with caplog.at_level(logging.WARNING, logger="ds_hilore"):
            for m in (model, ref):
                logits = _logits(m, ids)
                _grpo(m, logits, ids, first)
                _grpo(m, logits, ids, second).backward()
        assert _same(_grads(model), _grads(ref))
        said = [r for r in caplog.records if "handed twice" in r.getMessage()]
        assert len(said) == 1
        runtime.end_step()
    finally:
        runtime.detach()


@pytest.mark.parametrize("plan", ["H", "R"])
def test_autograd_grad_on_a_microbatch_of_zeros_returns_autograds_zeros(plan):
    """``torch.autograd.grad`` writes no ``.grad``: a microbatch whose coefficients are all zero
    does not skip its layers' backward then, and returns what the plain model returns."""
    model, ref, runtime = _pair({"force_plan": plan})
    try:
        ids = _ids(4)
        out = {}
        for name, m in (("hilore", model), ("plain", ref)):
            embeds = m.get_input_embeddings()(ids).detach().requires_grad_()
            logits = m(inputs_embeds=embeds, use_cache=False).logits[:, :-1].float()
            table = m.get_input_embeddings().weight  # not in this graph: inputs_embeds are
            params = [p for p in m.parameters() if p.requires_grad and p is not table]
            out[name] = torch.autograd.grad(_grpo(m, logits, ids, ZERO), [embeds, *params])
            assert all(p.grad is None for p in params)
        assert all(torch.equal(a, b) for a, b in zip(out["hilore"], out["plain"]))
        assert runtime.stats.get("backward_skipped", 0) == 0
        runtime.end_step()
    finally:
        runtime.detach()


def test_a_forward_with_grad_between_a_microbatch_and_its_backward_keeps_its_matched_pass(monkeypatch):
    """A reference forward without ``torch.no_grad`` (another length, the same shape bucket)
    between the training forward and its backward: calibration pairs the training
    microbatch's gradient with its own inputs, and runs to its count (every calibration run:
    NOTE [ Calibration that cannot change a plan ] would stop it after one here)."""
    from ds_hilore.plan.calibrate import MatchedPasses

    monkeypatch.setattr(MatchedPasses, "SETTLE", None)
    model, ref, runtime = _pair({"memory_budget": 1.5, "profile_microbatches": 2,
                                 "plan_validation_microbatches": 0, "calibration_microbatches": 3,
                                 "force_plan": {"*.mlp": "L"}, "low_precision": "int8",
                                 "codec_backend": "eager"})
    try:
        for step in range(7):
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                ids = _ids(10 + step)
                logits = _logits(m, ids)
                m(input_ids=_ids(50 + step, T - 4), use_cache=False)  # grad on, never backpropagated
                _grpo(m, logits, ids, SPREAD).backward()
            runtime.end_step()
        assert runtime.policy.calibrated == 3
    finally:
        runtime.detach()


def test_a_detached_model_is_freed():
    """Nothing of the runtime keeps the model alive once detached (discovery's trace once did,
    through the probe graph's saved-tensor hook)."""
    model = tiny_model("qwen2", layers=2, hidden=64, intermediate=128, dropout=False)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    runtime.detach()
    alive = weakref.ref(model)
    del model, runtime
    gc.collect()
    assert alive() is None


def test_a_forward_that_raises_ends_and_the_next_backbone_forward_begins_its_own():
    """An exception before the first layer (in the embedding) and one inside a layer of a
    profiled microbatch: the model's forward still ends (its op-level memory window closed), and
    a backbone-only forward after it begins its own microbatch, with exact gradients."""
    model, ref, runtime = _pair({"profile_microbatches": 3})
    begun = []
    begin = runtime.policy.begin_forward
    runtime.policy.begin_forward = lambda *a, **k: (begun.append(k.get("replayable", True)),
                                                    begin(*a, **k))[1]
    try:
        ids = _ids(5)
        for where in (model.model.layers[1].mlp, model.get_input_embeddings()):
            hook = where.register_forward_hook(lambda *_: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                model(input_ids=ids, use_cache=False)
            hook.remove()
            assert runtime.policy.metering.tracker is None  # no window left reading every op
        begun.clear()
        for m in (model, ref):
            hidden = m.model(input_ids=ids).last_hidden_state
            logits = m.lm_head(hidden)[:, :-1].float()
            _grpo(m, logits, ids, SPREAD).backward()
        assert begun == [False]  # begun at its first layer, not left to the failed forward
        assert _same(_grads(model), _grads(ref))
    finally:
        runtime.detach()


def test_forwards_that_always_stop_short_are_named_when_nothing_gets_planned(caplog):
    """Profiling measures a microbatch from the last layer's output gradient, which such
    forwards never produce: the warning after many unplanned microbatches says so (31 of the 32:
    the first, discovery's, ran every layer)."""
    model, _, runtime = _pair({"profile_microbatches": 2})
    try:
        with caplog.at_level(logging.WARNING, logger="ds_hilore"):
            for seed in range(33):
                ids = _ids(seed)
                _grpo(model, _logits(model, ids, layers=LAYERS - 1), ids, SPREAD).backward()
                model.zero_grad(set_to_none=True)
                runtime.end_step()
        said = [r.getMessage() for r in caplog.records if "no shape has been planned" in r.getMessage()]
        assert len(said) == 1 and "31 of their forwards stopped below the last HiLoRe layer " \
            "(model.layers.2)" in said[0] and "layer_pattern" in said[0]
    finally:
        runtime.detach()
