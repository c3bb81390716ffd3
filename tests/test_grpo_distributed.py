"""NOTE [ Normalisation under DeepSpeed ] (ds_hilore/grpo.py), checked on 2 CPU ranks with GAS 2.

One launch of tests/workers/grpo_ds_worker.py reports the engine's accumulated gradient for
grpo and dapo; here it is compared with the single-process gradient of TRL's formula over all
4 micro-batches (2 ranks x 2 micro-steps) concatenated into one batch of 16 sequences.

Not bitwise: the engine sums the micro-steps' gradients and the ranks' gradients (all-reduce)
in a different order than one backward over 16 rows, scales by 1/G and 1/W separately, and
the micro-batch forwards run with B = 4 instead of 16 (other GEMM/reduction blocking). All of
that is fp32 rounding, ~1e-7 relative per operation; the tolerance below is 1e-5 of the
tensor's largest entry. A normaliser off by G·W = 4 would miss by 75 %.
"""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_distributed
from tests.workers import grpo_ds_worker as worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def formula_loss(logp, old, adv, mask, loss_type, eps_low=0.2, eps_high=0.28):
    """TRL's grpo / dapo loss over one batch (the whole optimizer step), written out."""
    m = mask.float()
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    if loss_type == "grpo":  # mean over every sequence of the step of its token mean
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    return (per_token * m).sum() / m.sum()  # dapo: mean over every active token of the step


def single_process_gradient(loss_type: str) -> dict[str, torch.Tensor]:
    model = worker.build_model()
    data = [worker.micro_data(r, k) for r in range(worker.WORLD) for k in range(worker.GAS)]
    batch = {key: torch.cat([d[key] for d in data]) for key in data[0]}  # 16 sequences
    logp = worker.logprobs(model, batch["ids"])
    loss = formula_loss(logp, logp.detach() + batch["noise"], batch["adv"], batch["mask"], loss_type)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(worker.__file__, [], nprocs=2, timeout=600)


def _as_tensors(grads: dict, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(v, dtype=torch.float32).view_as(like[n]) for n, v in grads.items()}


def test_launch_ran_two_ranks_with_accumulation(ranks):
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["gas"] == 2 for r in ranks)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_engine_gradient_equals_single_process_formula(ranks, loss_type):
    expected = single_process_gradient(loss_type)
    per_rank = [_as_tensors(r["grads"][loss_type], expected) for r in ranks]
    for name in expected:  # after the all-reduce both ranks hold the same gradient
        assert torch.equal(per_rank[0][name], per_rank[1][name]), name
    assert sum(g.abs().sum() for g in expected.values()) > 0
    for name, want in expected.items():
        torch.testing.assert_close(per_rank[0][name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=lambda m: f"{loss_type} {name}: {m}")


def test_trl_token_count_is_off_by_gas_times_world(ranks):
    """Passing TRL's num_items_in_batch (N, not N / (G·W)) to a plain engine.backward scales
    the gradient by 1 / (G·W): the factor the NOTE documents."""
    expected = single_process_gradient("dapo")
    got = _as_tensors(ranks[0]["grads"]["dapo_trl_n"], expected)
    factor = 1.0 / (worker.GAS * worker.WORLD)
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want * factor, rtol=1e-5, atol=1e-5 * want.abs().max().item())
