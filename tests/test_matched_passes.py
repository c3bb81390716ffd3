"""Matched passes (ds_hilore/plan/calibrate.py): what they hold, and under ZeRO-3.

* Pieces (NOTE [ What a pass holds ]): passes run layer by layer measure what one pass over
  every layer measures (calibration, validation, ranking), and with a budget that leaves room
  for one layer's gradients only, the passes' peak stays under the budget -- where one pass
  over every layer would not.
* ZeRO-3 (NOTE [ Matched passes under ZeRO-3 ]), on 2 CPU ranks, one launch
  (tests/workers/matched_passes_worker.py): calibration and validation measure what ZeRO-2
  measures on the same data and plan, in pieces too, and leave training bitwise and DeepSpeed's
  ZeRO-3 state (trace, parameter status and owners, module counters) as a run without passes.
"""

from __future__ import annotations

import os

import pytest
import torch
from models import VOCAB, equal_utilities, one_torch_thread, tiny_model, with_lora

import ds_hilore
from ds_hilore.grpo import group_advantages, policy_loss
from ds_hilore.runtime.memory import PeakMeter, in_use_bytes
from tests.launch import run_distributed
from tests.workers import matched_passes_worker as worker

B, T = 4, 32
KEY = (B, T)
CONFIG = {"codec_backend": "eager", "min_pack_numel": 256, "profile_microbatches": 2,
          "plan_validation_microbatches": 0, "grad_error_tolerance": 0.9, "memory_budget": 4.0}

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def _microbatch(model, step: int) -> None:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    advantages = group_advantages(torch.rand(B, generator=g), group_size=2)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    policy_loss(logp, logp.detach(), advantages, torch.ones_like(logp), model=model).loss.backward()


def _attach(model, **config):
    """HiLoRe with every unit's plan L once the bucket is profiled (the knapsack's prices kept)."""
    import dataclasses

    runtime = ds_hilore.attach(model, dict(CONFIG, **config))
    scheduler = runtime.policy
    plan_bucket = scheduler._plan_bucket

    def planned(bucket, profiled=True):
        plan_bucket(bucket, profiled)
        bucket.plan = dataclasses.replace(bucket.plan, actions={n: "L" for n in bucket.plan.actions})

    scheduler._plan_bucket = planned
    return runtime


def _step(runtime, model, step: int) -> None:
    _microbatch(model, step)
    runtime.end_step()
    model.zero_grad(set_to_none=True)


# ---- pieces ---------------------------------------------------------------------------------
def _measured(layer_by_layer: bool) -> dict:
    model = tiny_model("qwen2", layers=4, hidden=64, intermediate=128, dropout=False)
    runtime = _attach(model, calibration_microbatches=1, validation_interval=1)
    if layer_by_layer:  # nothing left by the budget: every pass runs one layer at a time
        runtime.policy.passes._spare_bytes = lambda job: 0
    try:
        got = {}
        for step in range(5):  # 0, 1 profiled; 2 calibrated; 3 validated; 4 held out, ranked
            if step == 4:
                runtime.policy.hold_out()
            _step(runtime, model, step)
            if step == 3:
                got["validated"] = runtime.stats["grad_error_measured"]
                got["per_microbatch"] = runtime.stats["grad_error_measured_microbatch"]
        stats = runtime.stats
        got["samples"] = [x for v in stats["calibration"]["susceptibility"].values() for x in v]
        got["ranking"] = [x["measured"] for x in stats["ranking"]["slices"]]
        got["pieces"] = stats["calibration"]["pieces"]
        return got
    finally:
        runtime.detach()


def test_passes_layer_by_layer_measure_what_one_pass_measures(monkeypatch):
    equal_utilities(monkeypatch)  # the two runs' plans re-solved alike, whatever the load
    whole, pieces = _measured(False), _measured(True)
    assert (whole["pieces"], pieces["pieces"]) == (1, 4)
    assert len(whole["samples"]) == 1 and whole["validated"] > 0 and len(whole["ranking"]) >= 8
    assert pieces["samples"] == pytest.approx(whole["samples"], rel=1e-12)
    assert pieces["validated"] == pytest.approx(whole["validated"], rel=1e-12)
    assert pieces["per_microbatch"] == pytest.approx(whole["per_microbatch"], rel=1e-12)
    assert pieces["ranking"] == pytest.approx(whole["ranking"], rel=1e-12)


def test_a_pass_runs_its_plan_whatever_the_last_forward_ran_as(monkeypatch):
    """The matched passes run at ``end_step``, after the step's last forward; where that one ran
    as GC (its bucket timed no faster than GC: NOTE [ Never slower than GC ]) the runtime is left
    running forwards as GC, and the passes must still run their plans through frames: the
    validated error is the plan's, as after a forward that ran its plan (as GC both passes would
    measure GC against itself: an error of 0, the risk never tightened)."""
    equal_utilities(monkeypatch)

    def validated(gc_last: bool) -> float:
        model = tiny_model("qwen2", layers=4, hidden=64, intermediate=128, dropout=False)
        runtime = _attach(model, calibration_microbatches=1, validation_interval=1)
        try:
            for step in range(4):  # 0, 1 profiled; 2 calibrated; 3 validated
                _microbatch(model, step)
                if step == 3:
                    runtime.gc_forward = gc_last
                runtime.end_step()
                model.zero_grad(set_to_none=True)
            assert runtime.gc_forward is gc_last  # left as the last forward set it
            return runtime.stats["grad_error_measured"]
        finally:
            runtime.detach()

    plain = validated(False)
    assert plain > 0 and validated(True) == pytest.approx(plain, rel=1e-12)


def _validation_peak(budget_room: int | None) -> tuple[PeakMeter, int | None, dict]:
    """The peak of a validated step's passes: with ``budget_room``, the budget leaves that many
    bytes beyond what is in use and the pass's activations (NOTE [ What a pass holds ])."""
    model = tiny_model("qwen2", layers=4, hidden=256, heads=4, intermediate=1024, dropout=False)
    runtime = _attach(model, calibration_microbatches=0, validation_interval=1)
    try:
        for step in range(2):  # profiled
            _step(runtime, model, step)
        _microbatch(model, 2)  # planned and validated
        model.zero_grad(set_to_none=True)
        bucket = runtime.policy.buckets[KEY]
        budget = None
        if budget_room is not None:
            profile = bucket.profile
            activations = profile.gc_peak_bytes - profile.baseline_bytes + bucket.plan.peak_over_gc_bytes
            budget = bucket.budget_bytes = in_use_bytes("cpu") + activations + budget_room
        with PeakMeter("cpu") as meter:
            runtime.end_step()
        stats = runtime.stats
        assert stats["grad_error_measured"] > 0
        return meter, budget, stats["calibration"]
    finally:
        runtime.detach()


def test_passes_in_pieces_stay_under_the_budget_one_pass_over_every_layer_would_not():
    layer = sum(p.numel() for p in tiny_model("qwen2", layers=1, hidden=256, heads=4,
                                              intermediate=1024).model.layers[0].parameters())
    room = int(1.5 * layer * (4 + 4 + 4))  # one layer's exact gradient, D and G (fp32), and some
    whole, _, whole_stats = _validation_peak(None)
    pieces, budget, stats = _validation_peak(room)
    assert whole_stats["pieces"] == 1 and stats["pieces"] == 4
    assert pieces.peak_bytes <= budget and stats["pass_peak_bytes"] <= budget
    # one pass over every layer needs more than that budget leaves above what was in use
    assert whole.peak_delta > budget - pieces.start_bytes
    assert whole_stats["pass_peak_bytes"] - whole.start_bytes > budget - pieces.start_bytes


# ---- the exact gradient from training (NOTE [ The exact gradient from training ]) -----------
def _lora_model():
    return with_lora(tiny_model("qwen2", layers=2, hidden=64, intermediate=128, dropout=True))


def _layer_grads(model) -> dict[str, torch.Tensor]:
    """name -> the gradient of every trainable parameter of the decoder layers (fp32)."""
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if p.requires_grad and ".layers." in n and p.grad is not None}


def _seeded_microbatch(model, step: int) -> None:
    torch.manual_seed(900 + step)  # the dropout masks: the same for both models
    _microbatch(model, step)


def test_calibration_takes_the_exact_gradient_from_the_training_backward(monkeypatch):
    """A calibration microbatch runs exact, its training gradient is the exact one, bitwise the
    model's without HiLoRe (LoRA and dropout: the RNG of the pass is the microbatch's), and one
    pass -- stopped at the last layer, no LM head -- measures the packed variant against it."""
    model, reference = _lora_model(), _lora_model()
    runtime = _attach(model, calibration_microbatches=1)
    passes = runtime.policy.passes
    seen: dict = {}
    against = passes._against_captured

    def recorded(job, actions):
        seen["exact"] = {i: g.clone() for i, g in job.exact.items()}
        heads, forwards = [], []
        hooks = [model.get_output_embeddings().register_forward_hook(lambda *a: heads.append(1)),
                 model.register_forward_pre_hook(lambda *a: forwards.append(1))]
        try:
            return against(job, actions)
        finally:
            for h in hooks:
                h.remove()
            seen.update(actions=actions, heads=len(heads), forwards=len(forwards))

    monkeypatch.setattr(passes, "_against_captured", recorded)
    try:
        for step in range(3):  # 0, 1 profiled (all R); 2 planned all L and calibrated
            for m in (model, reference):
                m.zero_grad(set_to_none=True)
                _seeded_microbatch(m, step)
            if step == 2:
                microbatch = runtime._mb.summary
                expected = _layer_grads(reference)
            runtime.end_step()
        stats = runtime.stats
    finally:
        runtime.detach()
    assert microbatch["actions"]["L"] == 0 and microbatch["actions"]["H"] == 0  # every L ran R
    params = [n for n, p in model.named_parameters() if p.requires_grad and ".layers." in n]
    assert sorted(seen["exact"]) == list(range(len(params)))
    for i, name in enumerate(params):
        assert torch.equal(seen["exact"][i], expected[name]), name
    assert "L" in seen["actions"].values() and set(seen["actions"].values()) <= {"L", "R"}
    assert (seen["forwards"], seen["heads"]) == (1, 0)  # one pass, no logits
    calibration = stats["calibration"]
    assert calibration["microbatches"] == 1 and calibration["pieces"] == 1
    assert len([x for v in calibration["susceptibility"].values() for x in v]) == 1


@pytest.mark.parametrize("lora, predicted", [(True, False), (False, False), (True, True)],
                         ids=["lora", "full", "lora-predicted"])
def test_the_exact_gradient_is_captured_where_no_layer_outgrows_its_input(lora, predicted,
                                                                          monkeypatch):
    """NOTE [ When the exact gradient is captured ]: with GC's activations read as nothing (the
    rule of 1/16 of them alone never captures), LoRA layers -- each layer's gradients under its
    input, the largest under the packed bytes -- still capture, one pass at the step; full
    fine-tuning at this length (a layer's gradients several times its input) runs the two-pass
    form, and so does a microbatch whose prediction may re-solve the plan. Either way one
    calibration sample is measured."""
    import dataclasses

    model = _lora_model() if lora else tiny_model("qwen2", layers=2, hidden=64, intermediate=128,
                                                  dropout=True)
    runtime = _attach(model, calibration_microbatches=1)
    scheduler, passes = runtime.policy, runtime.policy.passes
    plan_bucket = scheduler._plan_bucket

    def no_activations(bucket, profiled=True):
        plan_bucket(bucket, profiled)
        profile = bucket.profile
        bucket.profile = dataclasses.replace(profile, gc_peak_bytes=profile.baseline_bytes)

    monkeypatch.setattr(scheduler, "_plan_bucket", no_activations)
    captured, one_pass = [], []
    capture, against = passes._capture, passes._against_captured
    monkeypatch.setattr(passes, "_capture",
                        lambda job, mb: (captured.append(1), capture(job, mb))[1])
    monkeypatch.setattr(passes, "_against_captured",
                        lambda job, actions: (one_pass.append(1), against(job, actions))[1])
    try:
        for step in range(3):  # 0, 1 profiled (all R); 2 planned all L and calibrated
            if predicted and step == 2:
                runtime.expect([1.0] * B)  # every sequence exposed: nothing elided
            _step(runtime, model, step)
        stats = runtime.stats
        groups = passes._layer_params()
    finally:
        runtime.detach()
    layer_bytes = max(sum(p.numel() * p.element_size() for p in g) for g in groups)
    input_bytes = B * T * passes.token_bytes
    assert passes.token_bytes == 64 * 4
    assert (layer_bytes <= input_bytes) == lora, (layer_bytes, input_bytes)  # the premise
    assert (len(captured), len(one_pass)) == ((1, 1) if lora and not predicted else (0, 0))
    assert stats["calibration"]["microbatches"] == 1
    assert len([x for v in stats["calibration"]["susceptibility"].values() for x in v]) == 1


def test_a_ranking_check_runs_as_many_passes_on_a_short_rank_as_on_the_others(monkeypatch):
    """NOTE [ Uneven batches ]: a rank whose microbatch has one sequence runs the same passes
    (the same agreed errors, in the same order) as a rank with the bucket's four."""
    counts = {}
    for rows in (B, 1):
        model = tiny_model("qwen2", layers=2, hidden=64, intermediate=128, dropout=False)
        runtime = _attach(model, calibration_microbatches=0)
        passes = runtime.policy.passes
        try:
            for step in range(2):
                _step(runtime, model, step)
            runtime.policy.hold_out()
            _microbatch(model, 2)
            job = passes.job
            if rows < B:  # this rank's share of the bucket: one sequence
                job.grad = job.grad[:rows]
                job.args = tuple(a[:rows] if torch.is_tensor(a) else a for a in job.args)
                job.kwargs = {k: v[:rows] if torch.is_tensor(v) else v for k, v in job.kwargs.items()}
                job.mass = job.mass[:rows]
                job.exposure = {k: v[:rows] for k, v in job.exposure.items()}
                job.executed = {k: (a, s[:rows] if s else s) for k, (a, s) in job.executed.items()}
            calls = []
            monkeypatch.setattr(passes, "_agree", lambda error, calls=calls: calls.append(1) or error)
            passes._rank_slices(job)
            counts[rows] = len(calls)
        finally:
            runtime.detach()
    assert counts[1] == counts[B] > 0


# ---- ZeRO-3 on 2 ranks ----------------------------------------------------------------------
CASES = ("zero3:on", "zero3:off", "zero3:pieces", "zero2:on", "zero2:spread", "zero3:spread")


@pytest.fixture(scope="module")
def launched():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load()  # built once here, not concurrently in two ranks
    ranks = run_distributed(worker.__file__, [a for c in CASES for a in ("--case", c)], timeout=420)
    for rank in ranks:
        for case in CASES:
            if "error" in rank["cases"][case]:
                pytest.fail(f"rank {rank['rank']}, case {case} raised:\n{rank['cases'][case]['error']}",
                            pytrace=False)
    return ranks


def _steps(rank: dict, case: str) -> list[dict]:
    return rank["cases"][case]["steps"]


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_passes_calibrate_and_validate_as_zero2_does(launched):
    for rank in launched:
        zero3, zero2 = _steps(rank, "zero3:on"), _steps(rank, "zero2:on")
        calibrated = zero3[1]["calibration"]  # step 2
        assert calibrated["microbatches"] == 1 and calibrated["pieces"] == 1
        samples, theirs = calibrated["susceptibility"], zero2[1]["calibration"]["susceptibility"]
        assert samples and sorted(samples) == sorted(theirs)
        for group, values in samples.items():
            # on the same weights (NOTE [ The same weights at calibration ] in the worker) the
            # sample of ZeRO-2 (the exact gradient captured from its training backward: NOTE
            # [ The exact gradient from training ] in calibrate.py) and of ZeRO-3 (an exact
            # pass) differ only by the stages' own rounding (ZeRO-3 gathers parameters and runs
            # its hooks around every module): seen 1e-7 to 4e-7
            assert values == pytest.approx(theirs[group], rel=2e-6)
        # steps 3, 4: validated; step 4's after an update, on weights that differ in their last
        # bits between the stages (NOTE [ The same weights at calibration ] in the worker)
        for mine, theirs, rel in zip(zero3[2:], zero2[2:], (1e-5, 2e-3), strict=True):
            assert mine["measured"] is not None and mine["measured"] > 0
            assert mine["measured"] == pytest.approx(theirs["measured"], rel=rel)
            assert mine["measured_microbatch"] == pytest.approx(theirs["measured_microbatch"], rel=rel)
    # the step's error is over both ranks: the same number on each
    assert [s["measured"] for s in _steps(launched[0], "zero3:on")] == \
        [s["measured"] for s in _steps(launched[1], "zero3:on")]


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_passes_leave_training_and_deepspeeds_state_as_they_found_them(launched):
    for rank in launched:
        on, off = rank["cases"]["zero3:on"], rank["cases"]["zero3:off"]
        assert on["losses"] == off["losses"]
        assert on["param_sha"] == off["param_sha"]  # every parameter after 4 steps, bitwise
        assert all(s["measured"] is None for s in off["steps"])
        # after every micro-step: the trace, each parameter's status and owners, each
        # module's backward counters
        for k, (mine, theirs) in enumerate(zip(on["zero3"], off["zero3"], strict=True)):
            assert mine == theirs, f"micro-step {k}"
        # not vacuous: persistent parameters stay gathered, and the trace completes
        assert any(status == "AVAILABLE" for status, _, _ in on["zero3"][-1]["params"])
        assert on["zero3"][-1]["mode"] == "COMPLETE"


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_passes_in_pieces_measure_what_one_pass_measures(launched):
    for rank in launched:
        whole, pieces = _steps(rank, "zero3:on"), _steps(rank, "zero3:pieces")
        assert pieces[-1]["calibration"]["pieces"] == 2  # the tiny model's two layers
        samples = pieces[1]["calibration"]["susceptibility"]
        theirs = whole[1]["calibration"]["susceptibility"]
        assert samples and sorted(samples) == sorted(theirs)
        for group, values in samples.items():
            assert values == pytest.approx(theirs[group], rel=1e-12)
        for mine, theirs in zip(pieces[2:], whole[2:], strict=True):
            assert mine["measured"] == pytest.approx(theirs["measured"], rel=1e-12)
        assert rank["cases"]["zero3:pieces"]["param_sha"] == rank["cases"]["zero3:off"]["param_sha"]


@pytest.mark.distributed
@pytest.mark.slow
def test_zero2_ranks_calibrate_a_group_each_and_zero3_ranks_the_same_one(launched):
    """NOTE [ Calibration spread over ranks ]: two samples due on 2 ranks. Under ZeRO-2 both
    are taken in step 2, one per rank, of two groups (each rank's own microbatch); under
    ZeRO-3 (a rank's pass must gather what the others gather) one per step, the same group
    on both ranks. Every rank holds the same samples; training is the same as without passes."""
    for stage, counts in (("zero2", [0, 2, 2, 2]), ("zero3", [0, 1, 2, 2])):
        steps = [_steps(rank, f"{stage}:spread") for rank in launched]
        assert [s["calibration"]["microbatches"] for s in steps[0]] == counts, stage
        samples = [s[1]["calibration"]["susceptibility"] for s in steps]
        assert samples[0] == samples[1], (stage, samples)
        assert len(samples[0]) == (2 if stage == "zero2" else 1), (stage, samples)
        assert all(len(v) == 1 for v in samples[0].values()), (stage, samples)
        assert steps[0][2]["calibration"]["susceptibility"] == steps[1][2]["calibration"]["susceptibility"]
    for rank in launched:
        assert rank["cases"]["zero2:spread"]["param_sha"] == rank["cases"]["zero2:on"]["param_sha"]


def test_a_forward_that_records_hidden_states_is_not_run_exact_for_a_capture_again(monkeypatch):
    """NOTE [ The exact gradient from training ]: where the forward records every layer's output
    (``output_hidden_states``), a loss may reach the layers from any of them, so the training
    gradient is not the pass's exact one and the two-pass form runs. Found at the first
    calibration microbatch's backward, after it ran its packed units recomputed for the capture;
    the later calibration microbatches run their plan (their packed units packed)."""
    model = _lora_model()
    runtime = _attach(model, calibration_microbatches=2)
    passes = runtime.policy.passes
    decided, packed = [], []
    fits = passes._capture_fits
    monkeypatch.setattr(passes, "_capture_fits",
                        lambda bucket: (decided.append(fits(bucket)), decided[-1])[1])
    forward = model.forward
    monkeypatch.setattr(model, "forward",
                        lambda *a, **k: forward(*a, **dict(k, output_hidden_states=True)))
    try:
        for step in range(4):  # 0, 1 profiled (all R); 2, 3 planned all L and calibrated
            _step(runtime, model, step)
            if step >= 2:
                packed.append(runtime.stats["actions"]["L"])
        stats = runtime.stats
    finally:
        runtime.detach()
    assert decided == [True, False]  # the rule said yes; the recorded hidden states, no
    assert packed[0] == 0 and packed[1] > 0  # the first ran exact for nothing; the second packed
    assert stats["calibration"]["microbatches"] == 2
