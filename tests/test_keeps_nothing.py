"""A layer whose every unit is R runs under ``torch.utils.checkpoint`` instead of its frame
(NOTE [ A layer that keeps nothing ] in ds_hilore/runtime/calling.py), also where the gate
may skip a backward of zeros, while skips are rare and sequences are not elided one by one:
asserted on the pack hooks its frame would have run, on gradients bitwise equal to the model
without HiLoRe, and on the recompute a skipped backward runs or does not."""

from __future__ import annotations

import copy

import pytest
import torch
from models import VOCAB, CountOps, one_torch_thread, tiny_model, with_lora

import ds_hilore
from ds_hilore.grpo import policy_loss
from ds_hilore.runtime import bundle, calling

B, T, PROMPT, LAYERS = 4, 24, 6, 3
SPREAD = torch.tensor([1.0, -1.0, 0.5, -0.5])
ZERO = torch.zeros(B)
ALL_R = {"force_plan": "R", "low_precision": "none", "elide_zero_rows": "whole"}

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def _frames_by_layer(monkeypatch) -> dict:
    """Counts the frames' pack-hook calls, per layer index."""
    counted: dict[int, int] = {}
    pack = bundle.LayerFrame._pack

    def counting(frame, t):
        counted[frame.layer.index] = counted.get(frame.layer.index, 0) + 1
        return pack(frame, t)
    monkeypatch.setattr(bundle.LayerFrame, "_pack", counting)
    return counted


def _step(model, seed: int, advantages: torch.Tensor) -> int:
    """A GRPO microbatch, forward and backward; the backward's matrix products."""
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(500 + seed))
    mask = torch.ones(B, T - 1)
    mask[:, :PROMPT] = 0
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    loss = policy_loss(logp, logp.detach(), advantages, mask, model=model).loss
    with CountOps(("aten.mm.", "aten.addmm.", "aten.bmm.")) as count:
        loss.backward()
    return count.count


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _bitwise(ref: dict, got: dict) -> bool:
    return ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.parametrize("lora, elide", [(False, "whole"), (True, "whole"), (False, False),
                                         (False, True)], ids=["full", "lora", "no-elision",
                                                              "rows-elided"])
def test_all_r_layers_are_checkpointed_under_the_gate_bitwise(lora, elide, monkeypatch):
    """Under the gate (one process: a backward of zeros may be skipped), the layers below the
    last run checkpointed, not through their frames, with the gradients of the model without
    HiLoRe, bitwise -- except where sequences are elided one by one (their frames leave the
    zero ones out of the re-run)."""
    model = tiny_model("qwen2", layers=LAYERS, hidden=64, intermediate=128, dropout=False)
    if lora:
        model = with_lora(model)
        for m in model.modules():  # GRPO actors train without dropout
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, dict(ALL_R, elide_zero_rows=elide))
    packs = _frames_by_layer(monkeypatch)
    try:
        assert runtime.zero_backward_skip
        _step(model, 0, SPREAD)  # discovery
        runtime.end_step()
        for seed in (1, 2):
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            packs.clear()
            _step(model, seed, SPREAD)
            _step(ref, seed, SPREAD)
            assert _bitwise(_grads(ref), _grads(model)), seed
            below = [] if elide is True else list(range(LAYERS - 1))
            assert sorted(runtime._mb.checkpointed) == below, runtime._mb.checkpointed
            assert sorted(packs) == [i for i in range(LAYERS) if i not in below], packs
            runtime.end_step()
            assert runtime.stats["actions"]["R"] == 2 * LAYERS
    finally:
        runtime.detach()


def test_after_a_skipped_backward_all_r_layers_keep_their_frames_for_a_while(monkeypatch):
    """A skipped backward with checkpointed layers below the gate still recomputes them (the
    gradients stay exact); from then on, for ``_SKIP_MEMORY`` microbatches, those layers keep
    their frames, whose recompute a skip leaves out; then they are checkpointed again."""
    monkeypatch.setattr(calling, "_SKIP_MEMORY", 2)
    model = tiny_model("qwen2", layers=LAYERS, hidden=64, intermediate=128, dropout=False)
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, dict(ALL_R))
    try:
        _step(model, 0, SPREAD)  # discovery
        runtime.end_step()
        checkpointed, matmuls = [], []
        for seed, adv in enumerate((ZERO, ZERO, SPREAD, SPREAD, SPREAD), start=1):  # 1-5
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            matmuls.append(_step(model, seed, adv))
            checkpointed.append(sorted(runtime._mb.checkpointed))
            runtime.end_step()
            assert runtime.stats["backward_skipped"] == int(adv is ZERO), seed
            _step(ref, seed, adv)
            assert _bitwise(_grads(ref), _grads(model)), seed
        below = list(range(LAYERS - 1))
        # framed while a skip is among the last two microbatches (the second skip renews it)
        assert checkpointed == [below, [], [], [], below], checkpointed
        # the first skip recomputed the checkpointed layers' matmuls; the second, framed, none
        assert matmuls[0] > matmuls[1], matmuls
    finally:
        runtime.detach()
