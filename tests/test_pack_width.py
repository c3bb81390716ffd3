"""Which saved tensors an L unit packs (NOTE [ Worth a codec call ] in runtime/storage.py): a
tensor narrower per token than 1/8 of the layer's hidden width (LoRA's rank-r intermediates)
stays whole, the wide ones are packed; the bytes the unit reports are exactly that split."""

from __future__ import annotations

import pytest
import torch
from models import batch, loss_and_grads, tiny_model, with_lora

import ds_hilore
from ds_hilore.runtime import bundle
from ds_hilore.runtime.storage import MIN_PACK_WIDTH_DIVISOR

HIDDEN, T = 256, 16


def _forward_l(rank: int):
    """A one-layer LoRA Llama forward under all-L: its frame, runtime and logits."""
    model = with_lora(tiny_model("llama", layers=1, hidden=HIDDEN, heads=4, intermediate=512,
                                 dropout=False), r=rank)
    runtime = ds_hilore.attach(model, {"codec_backend": "eager", "min_pack_numel": 0,
                                       "force_plan": "L"})
    logits = model(**batch(3, T)).logits
    return runtime._mb.frame(0), runtime, logits


def _packable_by_width(frame) -> list[tuple[int, bool]]:
    """(elements per token, packed) of every storage the frame's units keep, in order; checks
    that each is held as its flag says (all rows L, or whole in H)."""
    out = []
    for unit in frame.units:
        for stored in unit.stored:
            assert set(stored.row_states()) == ({"L"} if stored.packable else {"H"})
            out.append((stored.spans[0][1] // T, stored.packable))
    return out


def _held(frame) -> dict[str, int]:
    """Bytes the frame's units hold, by the action of the rows holding them."""
    held = {"H": 0, "L": 0}
    for unit in frame.units:
        for stored in unit.stored:
            for k, v in stored.bytes_by_action().items():
                held[k] += v
    return held


@pytest.mark.parametrize("rank", [16, 32])
def test_an_l_unit_keeps_tensors_narrower_than_an_eighth_of_the_hidden_width_whole(rank,
                                                                                   monkeypatch):
    frame, runtime, logits = _forward_l(rank)
    assert frame.min_pack_width == HIDDEN // MIN_PACK_WIDTH_DIVISOR == 32
    kept, held = _packable_by_width(frame), _held(frame)
    logits.float().sum().backward()
    runtime.end_step()
    assert runtime.stats["actions"]["L"] == 2 and runtime.stats["nonfinite_slices"] == 0
    runtime.detach()

    monkeypatch.setattr(bundle, "MIN_PACK_WIDTH_DIVISOR", HIDDEN + 1)  # the rule off
    frame, runtime, logits = _forward_l(rank)
    without, held_without = _packable_by_width(frame), _held(frame)
    runtime.detach()

    assert [w for w, _ in kept] == [w for w, _ in without]  # the same storages
    changed = [w for (w, a), (_, b) in zip(kept, without) if a != b]
    narrow = [w for w, packed in without if packed and w < 32]
    assert sorted(changed) == sorted(narrow)  # exactly the narrow packable ones stay whole
    rank_tensors = sum(w == rank for w, _ in kept)
    assert rank_tensors == 7  # LoRA's (B*T, r) of q, k, v, o, gate, up, down
    if rank < 32:
        assert changed == [rank] * 7
        # each stays whole: its fp32 bytes move from L (int8 payload + a scale per token) to H
        whole = 3 * T * rank * 4
        assert held["H"] - held_without["H"] == 7 * whole
    else:
        assert changed == [] and held == held_without


def test_the_rule_leaves_gradients_as_close_as_before():
    """Keeping narrow tensors whole only removes quantisation: L's gradient error stays bounded."""
    def grads(plan):
        model = with_lora(tiny_model("llama", layers=1, hidden=HIDDEN, heads=4, intermediate=512,
                                     dropout=False), r=16)
        runtime = ds_hilore.attach(model, {"codec_backend": "eager", "min_pack_numel": 0,
                                           "force_plan": plan})
        _, g = loss_and_grads(model, batch(3, T))
        runtime.detach()
        return g
    exact, packed = grads("H"), grads("L")
    num = sum((packed[k] - exact[k]).float().square().sum() for k in exact)
    den = sum(exact[k].float().square().sum() for k in exact)
    assert 0 < (num / den).sqrt() < 0.02
