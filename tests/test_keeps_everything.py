"""A layer whose every unit is H, in a microbatch that keeps what autograd keeps, runs without
its frame -- the last one with a frame that keeps nothing, for the microbatch's checks (NOTE
[ A layer that keeps everything ] in ds_hilore/runtime/calling.py): asserted on the pack hooks
its frame would have run, on gradients bitwise equal to the model without HiLoRe, on the bytes
reported (its frame's, at the same shapes) and kept (the same storages), and on where it still
runs through its frame."""

from __future__ import annotations

import copy

import pytest
import torch
from models import (VOCAB, batch, equal_utilities, loss_and_grads, one_torch_thread, planner_model,
                    tiny_model, with_lora)

import ds_hilore
from ds_hilore.grpo import policy_loss
from ds_hilore.plan.validate import LeaveOneOut
from ds_hilore.runtime import bundle
from ds_hilore.runtime.memory import LiveStorages

WHOLE = {"force_plan": "H", "low_precision": "none", "derive_pointwise": False,
         "elide_zero_rows": False}
LAYERS = 3

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


class _Packs:
    """Counts the frames' pack-hook calls, per layer index."""

    def __init__(self, monkeypatch):
        self.by_layer: dict[int, int] = {}
        pack = bundle.LayerFrame._pack

        def counted(frame, t):
            self.by_layer[frame.layer.index] = self.by_layer.get(frame.layer.index, 0) + 1
            return pack(frame, t)
        monkeypatch.setattr(bundle.LayerFrame, "_pack", counted)

    def take(self) -> dict[int, int]:
        out, self.by_layer = self.by_layer, {}
        return out


def _bitwise(ref: dict, got: dict) -> bool:
    return ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def _discovered(model, monkeypatch):
    """(a copy of ``model`` without HiLoRe, the runtime storing every unit whole, the pack-hook
    counter), after a first step that finds the units."""
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, dict(WHOLE))
    packs = _Packs(monkeypatch)
    loss_and_grads(model, batch(seq=8))  # discovery
    runtime.end_step()
    packs.take()
    return ref, runtime, packs


def _live_after_forward(model, inputs) -> int:
    """Bytes of the storages the forward made and kept (autograd's and the runtime's)."""
    with LiveStorages() as tracker:
        logits = model(**inputs).logits
    kept = tracker.live_bytes()
    logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return kept


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_layer_that_keeps_everything_runs_without_its_frame_bitwise(lora, monkeypatch):
    """The first microbatch of a shape runs through the frames (its bytes are learnt), the next
    ones without them: no pack hook anywhere (the last layer's frame, held until the top of
    its backward, keeps nothing), the same gradients bitwise as the model without HiLoRe, the
    same bytes reported; a new shape is learnt again."""
    model = tiny_model("qwen2", layers=LAYERS, dropout=False)
    model = with_lora(model) if lora else model
    ref, runtime, packs = _discovered(model, monkeypatch)
    try:
        for seq, framed in ((16, True), (16, False), (16, False), (24, True), (24, False)):
            inputs = batch(seq=seq, seed=seq)
            _, want = loss_and_grads(ref, inputs)
            _, got = loss_and_grads(model, inputs)
            assert _bitwise(want, got), (seq, framed)
            mb = runtime._mb
            counted = packs.take()
            if framed:
                assert mb.whole == {} and sorted(counted) == list(range(LAYERS)), (seq, counted)
            else:  # the last layer's frame carries the microbatch's checks, keeping nothing
                assert sorted(mb.whole) == list(range(LAYERS)), seq
                assert counted == {} and mb.top_frame is None, counted
            runtime.end_step()
            stats = runtime.stats
            assert stats["actions"] == {"H": 2 * LAYERS, "L": 0, "R": 0, "E": 0}
            if framed:
                learnt = stats["bytes"]["H"]
            assert stats["bytes"]["H"] == learnt > 0, (seq, framed)
    finally:
        runtime.detach()


def test_the_bytes_of_shapes_not_met_lately_are_forgotten_and_learnt_again(monkeypatch):
    """Lengths that change every step would each leave their learnt bytes for good: a layer
    keeps those of the most recent shapes only (``_MAX_WHOLE_SHAPES``), a shape used again
    stays, and a forgotten one comes back through the frames, bitwise as before."""
    from ds_hilore.runtime import units

    monkeypatch.setattr(units, "_MAX_WHOLE_SHAPES", 3)
    model = tiny_model("qwen2", layers=2, dropout=False)
    ref, runtime, packs = _discovered(model, monkeypatch)
    try:
        # 10 learnt, then kept by its use; 14 forgotten after three newer shapes
        for seq, framed in ((10, True), (12, True), (14, True), (10, False), (16, True),
                            (18, True), (10, False), (14, True), (14, False)):
            packs.take()
            inputs = batch(seq=seq, seed=seq)
            _, want = loss_and_grads(ref, inputs)
            _, got = loss_and_grads(model, inputs)
            assert _bitwise(want, got), seq
            assert bool(packs.take()) == framed, seq
            runtime.end_step()
            assert all(len(layer.whole_bytes) <= 3 for layer in runtime._layers)
        assert [key[0][0][1] for key in runtime._layers[0].whole_bytes] == [18, 10, 14]
    finally:
        runtime.detach()


def test_a_forward_summarised_after_its_shape_was_forgotten_reports_its_bytes(monkeypatch):
    """Forwards of new shapes run before an earlier forward's loss (every forward first, then
    the losses) make the layers forget that forward's shape: its summary at the loss reports
    the bytes taken when it ran, and its gradients are the model's without HiLoRe."""
    from ds_hilore.runtime import units

    monkeypatch.setattr(units, "_MAX_WHOLE_SHAPES", 2)
    model = tiny_model("qwen2", layers=2, dropout=False)
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, dict(WHOLE))
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0])

    def logp_of(net, ids):
        logits = net(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]

    def loss_of(net, logp):
        return policy_loss(logp, logp.detach(), advantages, torch.ones_like(logp),
                           model=net).loss
    ids = [torch.randint(3, VOCAB, (4, seq), generator=torch.Generator().manual_seed(seq))
           for seq in (10, 12, 14, 16)]
    try:
        loss_and_grads(model, batch(seq=8))  # discovery
        runtime.end_step()
        for _ in range(2):  # 10 learnt through the frames, then run without them
            loss_of(model, logp_of(model, ids[0])).backward()
            runtime.end_step()
        learnt = runtime.stats["bytes"]["H"]
        assert sorted(runtime._mb.whole) == [0, 1] and learnt > 0
        model.zero_grad(set_to_none=True)
        logps = [logp_of(model, x) for x in ids]  # 10 without frames, then three new shapes
        assert all(10 not in [key[0][0][1] for key in layer.whole_bytes] for layer in runtime._layers)
        for logp in logps:  # the first one's summary read at its loss, after the others ran
            loss_of(model, logp).backward()
        want = torch.autograd.grad(sum(loss_of(ref, logp_of(ref, x)) for x in ids),
                                   [p for p in ref.parameters() if p.requires_grad])
        got = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(want, got))
        runtime.end_step()
        assert runtime.stats["microbatches"][0]["bytes"]["H"] == learnt
    finally:
        runtime.detach()


def test_without_a_frame_it_keeps_the_storages_autograd_keeps():
    """What the forward leaves alive without frames is, byte for byte, what the model without
    HiLoRe leaves; through the frames, that and no more than the last layer's inputs, which its
    frame holds for a re-run (its frame keeping nothing holds none)."""
    model = tiny_model("llama", layers=LAYERS, dropout=False)
    plain = _live_after_forward(copy.deepcopy(model), batch(seq=16))
    runtime = ds_hilore.attach(model, dict(WHOLE))
    inputs = batch(seq=32)
    try:
        loss_and_grads(model, inputs)  # discovery
        runtime.end_step()
        framed = _live_after_forward(model, batch(seq=16))
        assert runtime._mb.whole == {}
        runtime.end_step()
        without = _live_after_forward(model, batch(seq=16))
        assert sorted(runtime._mb.whole) == list(range(LAYERS))
        runtime.end_step()
        assert without == plain > 0 and framed >= without, (plain, framed, without)
    finally:
        runtime.detach()


MIXED = {"*": "H", "model.layers.1.mlp": "R"}


@pytest.mark.parametrize("config, plan, whole", [
    ({}, None, [0, 1, 2]),
    # the defaults: pointwise tensors re-derived, zero sequences elided
    ({"derive_pointwise": True, "elide_zero_rows": "auto"}, None, []),
    ({"derive_pointwise": True}, None, []),  # re-derived: the frame keeps less than autograd
    ({"elide_zero_rows": True}, None, []),  # a zero sequence's bytes would be taken out
    ({"elide_zero_rows": "whole"}, None, [0, 1, 2]),  # only a microbatch all zero: else whole
    ({"force_plan": None}, MIXED, [0, 2]),  # layer 1 keeps less (its MLP recomputed)
])
def test_a_layer_keeps_its_frame_where_the_frame_keeps_less(config, plan, whole):
    model = tiny_model("qwen2", layers=LAYERS, dropout=False)
    runtime = ds_hilore.attach(model, {**WHOLE, **config})
    inputs = batch(seq=16)
    try:
        for _ in range(3):
            loss_and_grads(model, inputs)
            runtime.end_step()
            if plan is not None:
                runtime.set_plan(plan)
        assert sorted(runtime._mb.whole) == whole
    finally:
        runtime.detach()


B, T, PROMPT = 4, 48, 8


def _grpo_microbatch(model, seed: int, advantages: torch.Tensor) -> None:
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1000 + seed))
    mask = torch.ones(B, T - 1)
    mask[:, :PROMPT] = 0
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    policy_loss(logp, logp.detach(), advantages, mask, model=model).loss.backward()


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_below_a_gate_that_skips_the_backward_it_computes_nothing_and_stays_exact():
    """A microbatch whose coefficients are all zero skips its layers' backward (NOTE [ A
    backward of zeros ]) with its layers run without frames (the last one's frame keeping
    nothing): the step's gradients are bitwise those of the model without HiLoRe."""
    model = planner_model()
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, {**WHOLE, "elide_zero_rows": "whole"})
    spread, zero = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.zeros(B)
    try:
        for step in range(3):
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                _grpo_microbatch(m, 2 * step, zero)
                whole = sorted(runtime._mb.whole) if m is model else whole
                _grpo_microbatch(m, 2 * step + 1, spread)
            stats = runtime.stats
            runtime.end_step()
            assert all((a is None) == (b is None) and (a is None or torch.equal(a, b))
                       for a, b in zip(_grads(model), _grads(ref))), step
            if step:
                assert whole == [0, 1] and stats["backward_skipped"] == 1, (whole, stats)
    finally:
        runtime.detach()


def test_a_bucket_planned_to_store_everything_runs_its_layers_without_frames(monkeypatch):
    """The allocator's plan for a budget that every unit fits stores every unit whole: nothing
    is re-derived and zero sequences stay in whole storages (``Scheduler.keeps_whole``), so
    after its warm-up the layers run without frames (the last one's keeping nothing), a zero sequence in the
    microbatch or not. The measured times are fixed (H pays for every unit, every layer pays
    and GC is slower under leave-one-out): the plan is all H on any machine."""
    equal_utilities(monkeypatch)
    monkeypatch.setattr(LeaveOneOut, "gc_not_slower", lambda self: False)
    monkeypatch.setattr(LeaveOneOut, "dropped", lambda self: set())
    model = planner_model()
    runtime = ds_hilore.attach(model, {"memory_budget": 10.0, "low_precision": "none"})
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0])
    try:
        seen = []
        for step in range(16):
            _grpo_microbatch(model, step, advantages)
            mb = runtime._mb
            stats = runtime.stats
            model.zero_grad(set_to_none=True)
            runtime.end_step()
            if not stats.get("warm_up") and stats["actions"]["H"] == 4:
                seen.append(sorted(mb.whole))
        assert seen and all(w == [0, 1] for w in seen), seen
    finally:
        runtime.detach()


def _learn_shape(model, runtime, inputs) -> None:
    """Two microbatches of ``inputs``: units found, then the bytes at their shape learnt."""
    for _ in range(2):
        loss_and_grads(model, inputs)
        runtime.end_step()


def test_a_unit_of_a_layer_run_without_its_frame_says_why_it_cannot_be_downgraded():
    model = tiny_model("qwen2", layers=LAYERS, dropout=False)
    runtime = ds_hilore.attach(model, dict(WHOLE))
    inputs = batch(seq=16)
    try:
        _learn_shape(model, runtime, inputs)
        out = model(**inputs)  # the forward only: its microbatch is alive while out is
        assert sorted(runtime._mb.whole) == list(range(LAYERS))
        for layer in (0, LAYERS - 1):  # the last one's frame keeps nothing either
            with pytest.raises(ds_hilore.HiLoReError, match="ran without a frame.*derive_pointwise"):
                runtime.downgrade(f"model.layers.{layer}.mlp", "R")
        del out
    finally:
        runtime.detach()


def test_the_bytes_reported_without_a_frame_leave_out_the_frames_token_norms():
    """With a codec the frames of H units also keep their exposure's token norms ((B, T) fp32
    each), which a layer run without its frame never computes: its reported bytes are the
    frame's less those, and what stays alive is what the model without HiLoRe keeps."""
    model = tiny_model("qwen2", layers=LAYERS, dropout=False)
    inputs = batch(seq=16)
    plain = _live_after_forward(copy.deepcopy(model), inputs)
    runtime = ds_hilore.attach(model, {**WHOLE, "low_precision": "int8", "codec_backend": "eager"})
    try:
        framed_live = _live_after_forward(model, inputs)  # the shape's first call: framed
        assert runtime._mb.whole == {}
        runtime.end_step()
        framed = runtime.stats["bytes"]["H"]
        without_live = _live_after_forward(model, inputs)
        assert sorted(runtime._mb.whole) == list(range(LAYERS))
        runtime.end_step()
        without = runtime.stats["bytes"]["H"]
        norms = 2 * LAYERS * inputs["input_ids"].numel() * 4  # two units a layer
        # through the frames, the last one's inputs too (held for a re-run)
        assert framed - without == norms <= framed_live - without_live
        assert without_live == plain
    finally:
        runtime.detach()


def test_a_unit_flagged_on_another_rank_stays_as_autograd_kept_it():
    """A check that failed on another rank sends its units to R on every rank (NOTE
    [ Collective fallback ]); where every layer keeps what autograd keeps, the last one's frame
    included, there is nothing to recompute: the units stay H in the stats, the gradients those
    of the model without HiLoRe, bitwise."""
    model = tiny_model("qwen2", layers=LAYERS, dropout=False)
    ref = copy.deepcopy(model)
    runtime = ds_hilore.attach(model, dict(WHOLE))
    inputs = batch(seq=16)
    try:
        _learn_shape(model, runtime, inputs)
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        mb = runtime._mb
        assert sorted(mb.whole) == list(range(LAYERS)) and mb.top_frame is not None
        mb.fall_back([], [1] * len(runtime.units))  # every unit, as another rank's flags say
        assert mb.summary["actions"] == {"H": 2 * LAYERS, "L": 0, "R": 0, "E": 0}
        out.logits.float().sum().backward()
        runtime.end_step()
        assert runtime.stats["actions"] == {"H": 2 * LAYERS, "L": 0, "R": 0, "E": 0}
        ref(**inputs).logits.float().sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    finally:
        runtime.detach()
