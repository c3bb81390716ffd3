"""Which intervals the profile charges to which action (NOTE [ Timed the same way ] in
plan/profile.py), with the profile's clock replaced by one that moves only inside the steps
under test: no timing of this machine enters any assertion."""

from __future__ import annotations

import collections
import json
import os
import sys
import types
from pathlib import Path

import torch
from models import batch, tiny_model, with_lora

import ds_hilore
from ds_hilore.grpo import policy_loss
from ds_hilore.plan import profile as profiling
from ds_hilore.runtime import memory
from ds_hilore.runtime.bundle import LayerFrame
from ds_hilore.runtime.replay import RngState
from ds_hilore.runtime.weights import WeightRecognizer

RECOGNIZE, CHECK, NORMS, SNAPSHOT = 3.0, 7.0, 5.0, 11.0  # fake seconds of each step
FETCH, COMPUTE = 1000.0, 2.0  # ZeRO-3: fake seconds of a parameter fetch, of a unit's block
CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"


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
    snapshot = RngState.__init__

    def recognizing(self, t, module, epoch=None):
        clock.t += RECOGNIZE
        return recognize(self, t, module, epoch)

    def checking(self, pos, t):
        if sys._getframe(1).f_code.co_filename == profiling.__file__:
            clock.t += CHECK
            checks[self.layer.units[pos].name] += 1
        return derivable(self, pos, t)

    def norming(hidden):
        clock.t += NORMS
        return norms(hidden)

    def snapshotting(self, where):  # every RNG snapshot, wherever it is taken
        clock.t += SNAPSHOT
        snapshot(self, where)

    monkeypatch.setattr(WeightRecognizer, "__call__", recognizing)
    monkeypatch.setattr(LayerFrame, "_derivable", checking)
    monkeypatch.setattr(profiling, "input_norms", norming)
    monkeypatch.setattr(RngState, "__init__", snapshotting)
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
    split = runtime._layers[0].split
    calls = collections.Counter(split.unit_of_call(c) for c in range(len(split.calls)))
    assert calls == {0: 2, 1: 2}  # (input_layernorm, self_attn), (post_attention_layernorm, mlp)
    for cost in profile.units:
        assert checks[cost.name] % 2 == 0 and checks[cost.name] > 0  # the same each microbatch
        # per saved tensor the derivable check, once per unit the token norms, and at each call
        # of a unit a later one follows the RNG snapshot of a fast-forward: what H and L do in
        # the forward and R does not, charged to both; nothing else moved the clock
        bookkeeping = CHECK * checks[cost.name] / 2 + NORMS + (SNAPSHOT * calls[0] if cost.pos == 0 else 0)
        assert (cost.capture_s, cost.pack_s, cost.unpack_s, cost.derive_s) == (bookkeeping, bookkeeping,
                                                                              0.0, 0.0), cost
        # the forward's weight recognition (every action does it, R's re-run does not) is not
        # part of what R re-runs
        assert cost.recompute_s == 0.0, cost
        assert cost.utility_h == cost.utility_l == -bookkeeping
    runtime.detach()


def test_zero3_fetches_in_a_profiled_forward_are_not_recompute_time(monkeypatch):
    """Under ZeRO-3 every action pays a unit's parameter gathers once in the backward (R's
    re-run gathers what the backward then uses), so the fetches of the profiled forward are no
    part of what R re-runs: a 1-rank ZeRO-3 engine whose every fetch takes FETCH fake seconds
    and whose attention and MLP blocks take COMPUTE each profiles COMPUTE per unit."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    import ds_hilore.integrations.engine as engine_mod
    from tests.launch import free_port
    from tests.workers import ds_engine_worker as worker

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    clock = FakeClock()
    monkeypatch.setattr(profiling._Sample, "clock", staticmethod(clock))
    monkeypatch.setattr(memory, "time", types.SimpleNamespace(perf_counter=clock))  # readings: 0 s
    fetch, run = PartitionedParameterCoordinator.fetch_sub_module, LayerFrame.run
    frames = []  # whether each layer forward running now is profiled
    profiled = collections.Counter()  # fetches inside a profiled layer forward, by module class

    def fetching(self, module, forward):
        clock.t += FETCH
        if frames and frames[-1]:
            profiled[type(module).__name__] += 1
        return fetch(self, module, forward)

    def running(frame):
        frames.append(frame.ctx.profile is not None)
        try:
            return run(frame)
        finally:
            frames.pop()

    def computing(module, args, output):
        clock.t += COMPUTE

    monkeypatch.setattr(PartitionedParameterCoordinator, "fetch_sub_module", fetching)
    monkeypatch.setattr(LayerFrame, "run", running)
    config = json.loads((CONFIGS / "zero3_hilore.json").read_text())
    # left to this process's later tests: DeepSpeed's default buckets (5e8 elements) would keep
    # ~2 GB of its memory, its memory-efficient linear would replace F.linear for good
    config["zero_optimization"].update(reduce_bucket_size=100_000, stage3_prefetch_bucket_size=100_000,
                                       memory_efficient_linear=False)
    config["hilore"].update(profile_microbatches=2, calibration_microbatches=0,
                            plan_validation_microbatches=0)
    linear = torch.nn.functional.linear
    model = worker.build_model("full", gc=False)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(computing)
        layer.mlp.register_forward_hook(computing)
    engine, *_ = engine_mod.initialize(model=model, config=config,
                                       model_parameters=[p for p in model.parameters() if p.requires_grad])
    for micro in range(3):  # discovery, then the two profiled microbatches
        ids = worker.micro_batch(0, micro, 0)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    profile = next(iter(engine.hilore.policy.buckets.values())).profile
    assert profile is not None and len(profile.units) == 4
    assert profiled["Qwen2Attention"] > 0 and profiled["Qwen2MLP"] > 0  # the fetches were there
    assert [cost.recompute_s for cost in profile.units] == [COMPUTE] * 4
    assert torch.nn.functional.linear is linear  # left as it was for this process's later tests
