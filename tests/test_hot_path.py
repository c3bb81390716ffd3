"""The per-microbatch path reads the device a fixed number of times, whatever the layer count.

A read of a device value (``item``, ``tolist``, ``bool(t)``, ``torch.equal`` ...) stalls a GPU's
queue; the forward and backward of HiLoRe's layers must not do one per saved tensor or per
layer (NOTE [ One read per microbatch ] in storage.py, NOTE [ Checked elision ]). Counted here
with a ``TorchFunctionMode`` over every call made from ds_hilore's own code, on a LoRA model
under bf16 autocast (weight casts), with packed units (codec statistics) and elided sequences
(the elision check).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from models import batch, loss_and_grads, tiny_model, with_lora

import ds_hilore
from ds_hilore import HiLoReError
from ds_hilore.grpo import policy_loss

PACKAGE = str(Path(ds_hilore.__file__).parent)
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "equal", "cpu",
         "numpy", "is_nonzero")


class DeviceReads:
    """Counts reads of tensor values made by ds_hilore's code, forward and backward (the
    methods are wrapped on the class: modes do not reach the autograd engine's hooks). RNG
    states are host-side and not counted."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.where: list[str] = []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "equal", self._counted(torch.equal))
        self.active = False

    def _counted(self, method):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1)
            if self.active and caller.f_code.co_filename.startswith(PACKAGE):
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if not all(t.dtype == torch.uint8 and t.dim() == 1 for t in tensors):
                    self.count += 1
                    self.where.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return method(*args, **kwargs)
        return wrapper


class CountedCollective:
    """A stand-in for ``runtime.collective`` (the collective only) of ranks that all agree:
    counts the calls, each one a sync of the host with the device on NCCL."""

    def __init__(self):
        self.calls: list[str] = []

    def all_reduce_max(self, values):
        self.calls.append(sys._getframe(1).f_code.co_name)
        return list(values)

    def all_reduce_max_float(self, values):
        return self.all_reduce_max(values)

    def all_reduce_sum(self, values):
        return self.all_reduce_max(values)

    def broadcast_object(self, obj):
        return obj


def _reads_per_microbatch(layers: int, monkeypatch, collective=None) -> int:
    model = with_lora(tiny_model("llama", layers=layers, hidden=64, intermediate=128))
    runtime = ds_hilore.attach(model, {"force_plan": {"*.attn": "L", "*.mlp": "H"},
                                       "codec_backend": "eager", "min_pack_numel": 0})
    runtime.collective = collective
    inputs = batch(batch_size=4, seq=16)
    ids = inputs["input_ids"]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**inputs).logits.float()  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        adv = torch.tensor([1.0, 0.0, -0.5, 0.0])  # two sequences elided
        mask = torch.ones_like(logp, dtype=torch.bool)
        policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=model).loss.backward()

    step()  # warm: first-use work (codec tables, probe) is not per microbatch
    counter = DeviceReads(monkeypatch)
    counter.active = True
    if collective is not None:
        collective.calls.clear()
    step()
    counter.active = False
    monkeypatch.undo()
    last = runtime.stats["microbatches"][-1]
    assert last["actions"]["L"] == layers and last["exact_zero_sequences"] == 2
    return counter.where


def test_device_reads_do_not_grow_with_the_layer_count(monkeypatch):
    two, four = _reads_per_microbatch(2, monkeypatch), _reads_per_microbatch(4, monkeypatch)
    print("device reads per microbatch:", two)
    assert two == four, (two, four)
    # the loss: input checks, metrics; the runtime: zero rows of ω, the elision check at the
    # top layer with the deferred checks in the same read, the late per-layer flags
    assert len(four) <= 5, four


def test_the_top_of_the_backward_is_one_read_and_one_all_reduce_under_several_ranks(monkeypatch):
    collective = CountedCollective()
    reads = _reads_per_microbatch(2, monkeypatch, collective)
    # the microbatch's shape at its start, the elision's decision at the coefficients, then
    # the leak check at the top of the backward carrying the forward's deferred checks (settle)
    assert collective.calls == ["_bucket_key", "_agree", "settle"], collective.calls
    assert len(reads) <= 5, reads


def test_a_cast_that_is_not_one_sends_its_unit_to_recompute(monkeypatch):
    # the deferred proof fails (forced here): the unit is recomputed, so gradients stay exact.
    # The disproved reference is poisoned (NaN): had the slot still been read, gradients break.
    model = with_lora(tiny_model("llama", layers=2))
    inputs = batch()
    ref_loss, ref = loss_and_grads(model, inputs, autocast=torch.bfloat16)
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    recognize = runtime._weights._frozen_cast

    def disproved(t, base, params):
        ref = recognize(t, base, params)
        if ref is not None and ref.proof is not None:
            ref.proof = torch.zeros((), dtype=torch.bool)
            ref.param = torch.nn.Parameter(torch.full_like(ref.param, float("nan")),
                                           requires_grad=False)
        return ref

    monkeypatch.setattr(runtime._weights, "_frozen_cast", disproved)
    loss, grads = loss_and_grads(model, inputs, autocast=torch.bfloat16)
    assert torch.equal(loss, ref_loss)
    assert [n for n in ref if not torch.equal(ref[n], grads[n])] == []
    assert runtime.stats["recomputed_units"] == 4  # every unit fell back


def _grpo_with_intermediate_loss(model, ids, keep):
    logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    adv = torch.tensor([1.0, 0.0, -1.0])  # sequence 1 elided
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss = policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=model).loss
    return loss + 0.1 * keep["h"].square().mean()  # reaches sequence 1 below the top layer


def test_loss_on_an_unrecorded_intermediate_hidden_state_is_an_error_not_a_wrong_gradient():
    model = tiny_model("llama", layers=3)
    ids = batch()["input_ids"]
    ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    keep = {}
    model.model.layers[0].register_forward_hook(lambda m, a, out: keep.update(h=out))
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        _grpo_with_intermediate_loss(model, ids, keep).backward()


def test_loss_on_recorded_hidden_states_is_checked_at_every_layer_and_exact():
    model = tiny_model("llama", layers=3)
    ids = batch()["input_ids"]

    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = model(input_ids=ids, output_hidden_states=True)
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        adv = torch.tensor([1.0, 0.0, -1.0])
        mask = torch.ones_like(logp, dtype=torch.bool)
        loss = policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=model).loss
        (loss + 0.1 * out.hidden_states[1].square().mean()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads()
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    got = grads()
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []
    assert runtime.stats["recomputed_units"] == 2  # layer 0 fell back to R; 1 and 2 kept theirs
