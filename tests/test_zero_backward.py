"""A microbatch whose loss coefficients are all exactly zero skips its layers' backward
(NOTE [ A backward of zeros ] in ds_hilore/runtime/elision.py): asserted on the ops the
backward runs, on gradients bitwise equal to the model without HiLoRe, and on an optimizer
step after a step of zeros only."""

from __future__ import annotations

import copy

import pytest
import torch
from models import VOCAB, one_torch_thread, planner_model
from torch.utils._python_dispatch import TorchDispatchMode

import ds_hilore
from ds_hilore.grpo import policy_loss

B, T, PROMPT = 4, 48, 8
SPREAD = torch.tensor([1.0, -1.0, 0.5, -0.5])
ZERO = torch.zeros(B)
MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten._scaled_dot_product")

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func).startswith(MATMULS)
        return func(*args, **(kwargs or {}))


def _microbatch(model, seed: int, advantages: torch.Tensor, entropy: float = 0.0) -> int:
    """Forward, GRPO loss (its coefficients to the runtime of ``model``, if any), backward;
    the matmuls the backward ran."""
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1000 + seed))
    mask = torch.ones(B, T - 1)
    mask[:, :PROMPT] = 0
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    loss = policy_loss(logp, logp.detach(), advantages, mask, model=model).loss
    if entropy:  # a loss term the coefficients do not see
        loss = loss - entropy * -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    counter = _CountMatmuls()
    with counter:
        loss.backward()
    return counter.count


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters() if p.requires_grad]


def _same(got: list, ref: list) -> bool:
    return all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(got, ref))


@pytest.mark.parametrize("plan", ["R", "H"])
def test_a_microbatch_of_zeros_skips_its_layers_backward_and_the_gradients_are_exact(plan):
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": plan, "low_precision": "none"})
    try:
        _microbatch(model, 0, SPREAD)  # discovery
        model.zero_grad(set_to_none=True)
        runtime.end_step()
        matmuls = {}
        for skip in (False, True):
            runtime.zero_backward_skip = skip
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            matmuls[skip] = _microbatch(model, 1, ZERO)  # a step of a zero microbatch, then one with spread
            _microbatch(model, 2, SPREAD)
            runtime.end_step()
            stats = runtime.stats  # the step's
            _microbatch(ref, 1, ZERO)
            _microbatch(ref, 2, SPREAD)
            assert _same(_grads(model), _grads(ref)), skip
            assert stats["backward_skipped"] == int(skip), stats
        # the layers' matmuls, forward and backward, are gone: what is left is the LM head's
        assert matmuls[True] < matmuls[False] / 3, matmuls
    finally:
        runtime.detach()


def test_a_step_of_zeros_steps_the_optimizer_as_without_the_skip():
    """Every microbatch of the step zero: the parameters below still get their zero gradient
    (not None), so AdamW's momentum and weight decay move them as they would have."""
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": "R", "low_precision": "none"})
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (model, ref)]
    try:
        for step, advantages in enumerate((SPREAD, SPREAD, ZERO, ZERO)):
            for m, opt in zip((model, ref), opts):
                opt.zero_grad(set_to_none=True)
                _microbatch(m, step, advantages)
            assert _same(_grads(model), _grads(ref)), step
            for opt in opts:
                opt.step()
            runtime.end_step()
            assert runtime.stats["backward_skipped"] == (step >= 2), step
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.equal(a, b)
    finally:
        runtime.detach()


def test_gradient_from_a_term_the_coefficients_miss_is_not_skipped():
    """An entropy bonus reaches the zero sequences: the read at the top sees it, the layers
    fall back to R, nothing is skipped, gradients exact."""
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    try:
        _microbatch(model, 0, SPREAD)
        runtime.end_step()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        _microbatch(model, 1, ZERO, entropy=0.01)
        runtime.end_step()
        stats = runtime.stats
        _microbatch(ref, 1, ZERO, entropy=0.01)
        assert stats["backward_skipped"] == 0
        assert _same(_grads(model), _grads(ref))
        assert any(g is not None and g.abs().sum() > 0 for g in _grads(model))
    finally:
        runtime.detach()
