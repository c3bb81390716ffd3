"""Which intervals the profile charges to which action (NOTE [ Timed the same way ] in
plan/profile.py), with the profile's clock replaced by one that moves only inside the steps
under test: no timing of this machine enters any assertion."""

from __future__ import annotations

import collections
import sys

import torch
from models import batch, tiny_model, with_lora

import ds_hilore
from ds_hilore.grpo import policy_loss
from ds_hilore.plan import profile as profiling
from ds_hilore.runtime.bundle import LayerFrame
from ds_hilore.runtime.weights import WeightRecognizer

RECOGNIZE, CHECK, NORMS = 3.0, 7.0, 5.0  # fake seconds of each step


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_bookkeeping_of_H_and_L_is_charged_to_them_and_weight_recognition_not_to_R(monkeypatch):
    clock = FakeClock()
    checks = collections.Counter()  # unit -> derivable checks the profile timed
    monkeypatch.setattr(profiling._Sample, "clock", staticmethod(clock))
    recognize, derivable, norms = WeightRecognizer.__call__, LayerFrame._derivable, profiling.input_norms

    def recognizing(self, t, module):
        clock.t += RECOGNIZE
        return recognize(self, t, module)

    def checking(self, pos, t):
        if sys._getframe(1).f_code.co_filename == profiling.__file__:
            clock.t += CHECK
            checks[self.layer.units[pos].name] += 1
        return derivable(self, pos, t)

    def norming(hidden):
        clock.t += NORMS
        return norms(hidden)

    monkeypatch.setattr(WeightRecognizer, "__call__", recognizing)
    monkeypatch.setattr(LayerFrame, "_derivable", checking)
    monkeypatch.setattr(profiling, "input_norms", norming)
    model = with_lora(tiny_model("llama", layers=2, hidden=64, intermediate=128))
    runtime = ds_hilore.attach(model, {"codec_backend": "eager", "min_pack_numel": 0,
                                       "profile_microbatches": 2, "calibration_microbatches": 0,
                                       "plan_validation_microbatches": 0})
    inputs = batch(batch_size=4, seq=32)
    ids = inputs["input_ids"]
    for _ in range(3):  # discovery, then the two profiled microbatches
        with torch.autocast("cpu", dtype=torch.bfloat16):  # LoRA's frozen weights are cast
            logits = model(**inputs, use_cache=False).logits.float()  # (B, T, V)
        logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = inputs["attention_mask"][:, 1:].bool()
        policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0, 0.5, -0.5]), mask,
                    model=model).loss.backward()
        runtime.end_step()
        model.zero_grad(set_to_none=True)
    profile = runtime.policy.buckets[(4, 32)].profile
    assert profile is not None and len(profile.units) == 4
    for cost in profile.units:
        assert checks[cost.name] % 2 == 0 and checks[cost.name] > 0  # the same each microbatch
        # per saved tensor the derivable check, once per unit the token norms: what H and L
        # do in the forward and R does not, charged to both; nothing else moved the clock
        bookkeeping = CHECK * checks[cost.name] / 2 + NORMS
        assert (cost.capture_s, cost.pack_s, cost.unpack_s, cost.derive_s) == (bookkeeping, bookkeeping,
                                                                              0.0, 0.0), cost
        # the forward's weight recognition (every action does it, R's re-run does not) is not
        # part of what R re-runs
        assert cost.recompute_s == 0.0, cost
        assert cost.utility_h == cost.utility_l == -bookkeeping
    runtime.detach()
