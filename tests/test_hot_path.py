"""The per-microbatch path reads the device a fixed number of times, whatever the layer count.

A read of a device value (``item``, ``tolist``, ``bool(t)``, ``torch.equal`` ...) stalls a GPU's
queue; the forward and backward of HiLoRe's layers must not do one per saved tensor or per
layer: a planned microbatch reads twice, at its coefficients and at the top of its backward
(NOTE [ Two reads per microbatch ] in runtime/reads.py). Counted here with the read methods
wrapped, over every call made from ds_hilore's code but the loss's own, on a LoRA model under
bf16 autocast (weight casts), with packed units (codec statistics) and elided sequences (the
elision checks, and the late flags the previous backward left).
"""

from __future__ import annotations

import logging

import sys
from pathlib import Path

import pytest
import torch
from models import batch, loss_and_grads, tiny_model, with_lora

import ds_hilore
from ds_hilore import HiLoReError
from ds_hilore.grpo import policy_loss
from ds_hilore.plan.metering import MAX_PARTIAL
from ds_hilore.plan.prediction import KEPT

PACKAGE = str(Path(ds_hilore.__file__).parent)
LOSS = str(Path(ds_hilore.__file__).parent / "grpo" / "policy.py")  # its input checks, metrics
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "equal", "cpu",
         "numpy", "is_nonzero")


class DeviceReads:
    """Counts reads of tensor values made by ds_hilore's code but the loss's own (its input
    checks and metrics, one read each: the loss's, not the runtime's), forward and backward
    (the methods are wrapped on the class: modes do not reach the autograd engine's hooks).
    RNG states are host-side and not counted."""

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
            where = caller.f_code.co_filename
            if self.active and where.startswith(PACKAGE) and where != LOSS:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if not all(t.dtype == torch.uint8 and t.dim() == 1 for t in tensors):
                    self.count += 1
                    self.where.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return method(*args, **kwargs)
        return wrapper


class CountedCollective:
    """A stand-in for ``runtime.collective`` (the collective only) of ranks that all agree:
    records the function that called it, each call a sync of the host with the device on NCCL."""

    def __init__(self):
        self.calls: list[str] = []

    def _record(self, values):
        caller = sys._getframe(2)
        self.calls.append(caller.f_code.co_name)
        return list(values)

    def all_reduce_max(self, values):
        return self._record(values)

    def all_reduce_max_float(self, values):
        return self._record(values)

    def all_reduce_sum(self, values):
        return self._record(values)

    def broadcast_object(self, obj):
        return obj


PLANNED = {"force_plan": {"*.attn": "L", "*.mlp": "H"}, "codec_backend": "eager",
           "min_pack_numel": 0, "profile_microbatches": 1, "calibration_microbatches": 0,
           "plan_validation_microbatches": 0}


def _reads_per_microbatch(layers: int, monkeypatch, collective=None,
                          zero: bool = True) -> tuple[list[str], list[str]]:
    """(reads, collective calls) of one planned microbatch (its bucket profiled first), after
    another planned one whose backward left late flags (two of the four sequences are elided;
    ``zero`` false: none is zero, nothing elided)."""
    model = with_lora(tiny_model("llama", layers=layers, hidden=64, intermediate=128))
    runtime = ds_hilore.attach(model, PLANNED)
    runtime.collective = collective
    inputs = batch(batch_size=4, seq=16)
    ids = inputs["input_ids"]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**inputs).logits.float()  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        adv = torch.tensor([1.0, 0.0, -0.5, 0.0] if zero else [1.0, 0.5, -0.5, -1.0])
        mask = torch.ones_like(logp, dtype=torch.bool)
        policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=model).loss.backward()

    step()  # profiled
    step()  # warm: first-use work (codec tables, the first plan) is not per microbatch
    for _ in range(MAX_PARTIAL):  # nor the plan's check (repeated: two sequences are elided)
        if not runtime.policy.metering.awaits_check(runtime.policy.buckets[(4, 16)]):
            break
        step()
    assert not runtime.policy.metering.awaits_check(runtime.policy.buckets[(4, 16)])
    counter = DeviceReads(monkeypatch)
    counter.active = True
    if collective is not None:
        collective.calls.clear()
    step()
    counter.active = False
    monkeypatch.undo()
    calls = list(collective.calls) if collective is not None else []
    last = runtime.stats["microbatches"][-1]
    assert last["actions"]["L"] == layers and last["exact_zero_sequences"] == 2 * zero
    assert runtime.policy.buckets[(4, 16)].plan is not None  # a planned microbatch
    assert runtime.policy.step_stats["grad_error_est"]  # its risk was fitted from exposure
    runtime.end_step()  # reads the late flags the last backward left (none set)
    return counter.where, calls


def test_device_reads_do_not_grow_with_the_layer_count(monkeypatch):
    (two, _), (four, _) = _reads_per_microbatch(2, monkeypatch), _reads_per_microbatch(4, monkeypatch)
    print("device reads per microbatch:", two)
    assert two == four, (two, four)
    # at the coefficients: ω's masses (zero rows), exposure, the forward's deferred checks and
    # the previous backward's late flags; at the top of the backward: the elision check
    assert len(four) <= 2, four


def test_the_coefficients_and_the_top_of_the_backward_are_one_all_reduce_each(monkeypatch):
    reads, calls = _reads_per_microbatch(2, monkeypatch, CountedCollective())
    # the policy's at the microbatch's start (its shape and its prediction's rows); at the
    # coefficients the elision's decision (with the deferred checks, the late flags and the
    # policy's risk of every unit); at the top of the backward the leak check of the elided
    # sequences
    assert calls == ["_bucket_key", "agree", "settle"], calls
    assert len(reads) <= 2, reads


def test_without_a_zero_sequence_on_any_rank_the_top_of_the_backward_is_no_sync(monkeypatch):
    """No rank elides a sequence (the elision's all-reduce says so): nothing is checked at the
    top of the backward, so neither its read nor its all-reduce is made there."""
    reads, calls = _reads_per_microbatch(2, monkeypatch, CountedCollective(), zero=False)
    assert calls == ["_bucket_key", "agree"], calls
    assert len(reads) <= 1, reads


# a plan that keeps nothing (no headroom over GC's peak): every bucket runs as GC
AS_GC = {"memory_budget": 1.0, "codec_backend": "eager", "profile_microbatches": 1,
         "calibration_microbatches": 0, "plan_validation_microbatches": 0}


def _steady_run(collective: "CountedCollective", config: dict = AS_GC,
                reads: DeviceReads | None = None, steps: int = 4, model=None):
    """A LoRA model (or ``model``) whose runtime agrees over ``collective`` (ranks that all agree), stepped
    with ``end_step`` until its steps are steady (NOTE [ A steady step agrees nothing before
    its forwards ] in ds_hilore/plan/steady.py), at most ``steps``. Returns (runtime, step(seq)):
    one microbatch of ``seq`` positions, forward and backward, and the collective calls made
    before its first layer's forward and in all (``reads``, counting while active: the reads
    before that forward in ``reads.before``)."""
    model = model or with_lora(tiny_model("llama", layers=2, hidden=64, intermediate=128))
    runtime = ds_hilore.attach(model, config)
    runtime.collective = collective  # after attach: ZeRO 0-2's, whose module calls are their own
    before_first: list[int] = []

    def first_layer(*_):
        before_first.append(len(collective.calls))
        if reads is not None:
            reads.before = list(reads.where)

    runtime._layers[0].module.register_forward_pre_hook(first_layer)

    def step(seq: int = 16, adv=(1.0, 0.5, -0.5, -1.0)) -> tuple[list[str], list[str]]:
        inputs = batch(batch_size=4, seq=seq)
        ids = inputs["input_ids"]
        collective.calls.clear()
        before_first.clear()
        logits = model(**inputs).logits.float()  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = torch.ones_like(logp, dtype=torch.bool)
        policy_loss(logp, logp.detach(), torch.tensor(adv), mask, loss_type="grpo",
                    model=model).loss.backward()
        return collective.calls[:before_first[0]], list(collective.calls)

    step.model = model
    for _ in range(steps):
        assert "_bucket_key" in step()[0]  # an agreed step
        runtime.end_step()
        if runtime.policy.steady:
            break
    return runtime, step


def test_a_steady_step_makes_no_collective_before_the_first_layers_forward(monkeypatch):
    """Every bucket met runs as GC (its plan keeps nothing), nothing is due: the step is
    steady, and its microbatch runs as GC with no collective and no device read at all -- the
    step before it agreed the bucket in the forward's pre-hook. The step that ends agrees
    whether the next one is steady, in the all-reduce it makes anyway (the step's exposure);
    ``hold_out``, on every rank at the same point, ends the steady step there."""
    reads = DeviceReads(monkeypatch)
    runtime, step = _steady_run(CountedCollective(), reads=reads)
    assert runtime.policy.steady
    reads.active = True
    before, calls = step()
    reads.active = False
    assert before == [] and calls == [], calls
    assert reads.before == [] and reads.where == [], reads.where
    assert runtime._mb.as_gc  # gradient checkpointing itself
    runtime.end_step()
    assert runtime.policy.steady and runtime.stats["steady"] and not runtime.stats["warm_up"]
    runtime.policy.hold_out()
    assert step()[0] == ["_bucket_key"] and not runtime.policy.steady


def test_a_hold_out_without_a_codec_is_said_and_leaves_steady_steps_steady(caplog):
    """With ``"low_precision": "none"`` nothing is packed, so a ranking check has nothing to
    rank and no pass would ever take the hold-out: it is said, not left pending -- pending, it
    ended every later step's steadiness at its first forward, for the rest of the run."""
    runtime, step = _steady_run(CountedCollective(), {**AS_GC, "low_precision": "none"})
    assert runtime.policy.steady
    with caplog.at_level(logging.WARNING, logger="ds_hilore"):
        runtime.policy.hold_out()
    for _ in range(2):
        assert step() == ([], [])  # steady: no collective at all
        runtime.end_step()
        assert runtime.policy.steady and runtime.stats["steady"]
    assert "no ranking check" in caplog.text


def test_a_planned_bucket_runs_its_plan_in_a_steady_step_with_its_own_checks(monkeypatch):
    """Every bucket planned, its plan keeping something (pinned here), nothing due: the step is
    steady, and a microbatch takes the bucket of its own shape and runs its plan with no
    collective and no device read before its first layer's forward. Two ranks may then run
    different plans, so what follows the plan is this rank's own: at the coefficients and at
    the top of the backward the microbatch reads but agrees nothing (NOTE [ A microbatch of
    its own ] in ds_hilore/runtime/agreement.py), and the late flags are read and agreed once,
    before the step ends, on every rank."""
    reads = DeviceReads(monkeypatch)
    collective = CountedCollective()
    runtime, step = _steady_run(collective, PLANNED, reads=reads, steps=8)
    assert runtime.policy.steady and not runtime.policy.steady_as_gc
    reads.active = True
    before, calls = step(adv=(1.0, 0.0, -0.5, 0.0))
    reads.active = False
    assert before == [] and reads.before == [], (before, reads.before)
    assert calls == [], calls
    assert len(reads.where) <= 2, reads.where  # at the coefficients, at the top of the backward
    assert runtime._mb.local_checks and not runtime._mb.as_gc
    assert step() == ([], [])  # nothing elided: nothing checked at the top
    collective.calls.clear()
    runtime.check_late()  # before the optimizer step: the late flags of both, on every rank
    assert collective.calls == ["flush"], collective.calls
    runtime.end_step()
    last = runtime.stats["microbatches"][-2]
    assert last["actions"] == {"H": 2, "L": 2, "R": 0, "E": 0} and last["exact_zero_sequences"] == 2
    assert runtime.policy.steady and runtime.stats["steady"]


class RiskierElsewhere(CountedCollective):
    """Ranks that agree on everything but the risk of every unit, which another rank's plan
    (packing every unit) puts far over any budget: the max over ranks at the coefficients."""

    def all_reduce_max_float(self, values):
        values = self._record(values)
        if self.calls[-1] == "agree" and self.units:
            values[-self.units:] = [10.0] * self.units
        return values

    units = 0


@pytest.mark.parametrize("refresh", [1, 2])
def test_a_steady_microbatch_fits_its_risk_from_its_own_plan(refresh):
    """In a steady step the ranks' plans may differ, so the risk fit after the coefficients
    weighs this rank's own units (ZeRO 0-2: a unit sent to R on one rank issues no
    collective): another rank's riskier plan sends nothing of this one's to R. In a step that
    agrees, the plan is every rank's, and the max over ranks decides -- a fit due on every rank
    whatever each counted in the steady step (``refresh_interval``)."""
    collective = RiskierElsewhere()
    runtime, step = _steady_run(collective, {**PLANNED, "refresh_interval": refresh}, steps=8)
    collective.units = len(runtime.units)
    assert runtime.policy.steady
    step()
    runtime.end_step()
    assert runtime.stats["microbatches"][-1]["actions"] == {"H": 2, "L": 2, "R": 0, "E": 0}
    runtime.policy.hold_out()  # ends the steady step: the next forward agrees
    assert step()[0] == ["_bucket_key"]
    runtime.end_step()
    assert runtime.stats["microbatches"][-1]["actions"]["R"] > 0


def _forward(model, seq: int = 16, adv=(1.0, 0.5, -0.5, -1.0)):
    """A microbatch's forward and loss (its coefficients handed over): the loss, to backward."""
    inputs = batch(batch_size=4, seq=seq)
    ids = inputs["input_ids"]
    logits = model(**inputs).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.ones_like(logp, dtype=torch.bool)
    return policy_loss(logp, logp.detach(), torch.tensor(adv), mask, loss_type="grpo",
                       model=model).loss


def test_the_late_read_stays_due_on_every_rank_whatever_took_the_flag_meanwhile():
    """A microbatch of its own holds a late flag on every rank (NOTE [ A microbatch of its own ]
    in ds_hilore/runtime/agreement.py): the next read is one all-reduce on every rank even where
    an agreed microbatch's coefficients took the flag before its backward ran (two forwards
    alive), or a read came between its forward and its backward -- what that backward leaves
    is this rank's alone, so the read must not depend on it."""
    collective = CountedCollective()
    runtime, step = _steady_run(collective, PLANNED, steps=8)
    assert runtime.policy.steady
    first = _forward(step.model)  # its own
    runtime.policy.hold_out()
    second = _forward(step.model)  # agreed: its coefficients read the flags
    assert "agree" in collective.calls
    first.backward()
    second.backward()
    collective.calls.clear()
    runtime.check_late()
    assert collective.calls == ["flush"], collective.calls
    runtime.end_step()
    assert runtime.policy.steady
    loss = _forward(step.model)  # its own
    runtime.check_late()  # another optimizer's step, between its forward and its backward
    loss.backward()  # nothing zero: its backward leaves no flag of its own
    collective.calls.clear()
    runtime.check_late()
    assert collective.calls == ["flush"], collective.calls


def test_a_length_no_planned_bucket_holds_runs_all_r_and_the_next_steps_agree():
    """In a steady step whose buckets run their plans, a length longer than every bucket's:
    no plan is priced for it, so it keeps what GC keeps (its unpinned units R), and the next
    steps agree until it comes again and gets its own bucket."""
    config = {**PLANNED, "force_plan": {"*.mlp": "H"}, "low_precision": "none"}
    runtime, step = _steady_run(CountedCollective(), config, steps=8)
    assert runtime.policy.steady and not runtime.policy.steady_as_gc
    assert step(seq=32) == ([], [])
    assert runtime.policy.step_stats["warm_up"] == {"unplanned": 1}
    runtime.end_step()
    assert runtime.stats["microbatches"][-1]["actions"] == {"H": 2, "L": 0, "R": 2, "E": 0}
    assert not runtime.policy.steady
    assert step(seq=32)[0] == ["_bucket_key"] and (4, 32) in runtime.policy.buckets


def test_a_steady_step_runs_a_bucket_as_gc_beside_one_that_runs_its_plan(monkeypatch):
    """One bucket timed no faster than GC (leave-one-out's verdict, fixed here), another running
    its plan: the steps are steady all the same, each microbatch run as its own bucket says --
    all R through HiLoRe's frames (not as GC: every rank fires the gradient hooks in one order,
    NOTE [ One order of gradient hooks on every rank ] in ds_hilore/plan/steady.py), or by its
    plan -- and neither agrees anything (NOTE [ A microbatch of its own ] in
    ds_hilore/runtime/agreement.py)."""
    from ds_hilore.plan.scheduler import Scheduler

    runs_as_gc = Scheduler._runs_as_gc
    monkeypatch.setattr(Scheduler, "_runs_as_gc", lambda self, bucket, unpredicted=False:
                        bucket.key == (4, 32) or runs_as_gc(self, bucket, unpredicted))
    runtime, step = _steady_run(CountedCollective(), PLANNED, steps=8)
    for _ in range(12):  # the second shape gets its bucket in steps that agree
        step(seq=32)
        step()
        runtime.end_step()
        if runtime.policy.steady:
            break
    assert runtime.policy.steady and not runtime.policy.steady_as_gc
    assert set(runtime.policy.buckets) == {(4, 16), (4, 32)}
    assert step(seq=32) == ([], []) and not runtime._mb.as_gc and runtime._mb.local_checks
    assert step() == ([], []) and not runtime._mb.as_gc and runtime._mb.local_checks
    runtime.end_step()
    assert runtime.policy.steady and not runtime.stats["warm_up"]
    assert runtime.stats["microbatches"][-1]["actions"] == {"H": 2, "L": 2, "R": 0, "E": 0}


def test_a_new_shape_in_a_steady_step_runs_as_gc_and_the_next_steps_agree_until_it_comes():
    """A shape longer than every bucket, met in a steady step: that rank cannot ask the others
    before its forward; it runs as GC as every bucket does, and the step's end makes the next
    steps agree until the shape comes again and gets its own bucket (it may be one HiLoRe
    wins on)."""
    runtime, step = _steady_run(CountedCollective())
    assert step(seq=32) == ([], [])
    assert runtime._mb.as_gc and runtime.policy.step_stats["warm_up"] == {"unplanned": 1}
    assert (4, 32) not in runtime.policy.buckets  # a bucket is made only where ranks agree
    runtime.end_step()
    assert not runtime.policy.steady
    assert step()[0] == ["_bucket_key"]  # the old shape: agreed while no bucket holds 32
    runtime.end_step()
    assert not runtime.policy.steady
    assert step(seq=32)[0] == ["_bucket_key"]
    assert (4, 32) in runtime.policy.buckets  # profiled now, on every rank at once


def test_a_shorter_shape_in_a_steady_step_makes_the_next_step_agree():
    """A shape with no bucket of its own, held by a longer one: run as GC, and the next step
    agrees, to give the shape its own bucket."""
    runtime, step = _steady_run(CountedCollective())
    assert step(seq=8) == ([], []) and not runtime.policy.step_stats.get("warm_up")
    runtime.end_step()
    assert not runtime.policy.steady
    assert step(seq=8)[0] == ["_bucket_key"]


def test_a_prediction_in_a_steady_step_is_this_ranks_own_and_the_steps_stay_steady(monkeypatch):
    """``expect`` before a steady step's forward: the microbatch's rows and plan come from this
    rank's prediction alone (ZeRO 0-2: each rank's plan is its own; NOTE [ Freed memory is
    spent ] in ds_hilore/plan/prediction.py) -- its rows predicted zero run apart, without
    autograd (NOTE [ Kept rows only ] in ds_hilore/runtime/rows.py) -- nothing is agreed or
    read before its first layer's forward, nor agreed in it, and the steps stay steady while
    predictions come. A wrong one (a row predicted zero has coefficients) is raised on every
    rank before the optimizer step."""
    reads = DeviceReads(monkeypatch)
    collective = CountedCollective()
    model = tiny_model("llama", layers=2, hidden=64, intermediate=128, dropout=False)
    runtime, step = _steady_run(collective, PLANNED, reads=reads, steps=8, model=model)
    assert runtime.policy.steady and not runtime.policy.steady_as_gc
    for _ in range(2):
        runtime.expect([1.0, 0.0, 1.0, 0.0])
        reads.where.clear()
        reads.active = True
        assert step(adv=(1.0, 0.0, -0.5, 0.0)) == ([], [])
        reads.active = False
        assert reads.before == [], reads.before
        assert runtime._mb.local_checks and runtime._mb.split.kept == [0, 2]
        assert runtime.policy.step_stats["predicted_microbatches"] == 1
        collective.calls.clear()
        runtime.check_late()
        assert collective.calls == ["flush"], collective.calls
        runtime.end_step()
        assert runtime.policy.steady and runtime.stats["steady"]
        assert runtime.stats["microbatches"][-1]["kept_rows"] == [0, 2]
    runtime.expect([1.0, 0.0, 1.0, 1.0])  # row 1 has coefficients
    assert step() == ([], [])
    with pytest.raises(HiLoReError, match="predicted"):
        runtime.check_late()


def test_where_every_bucket_runs_as_gc_a_prediction_makes_the_next_step_agree():
    """Every bucket runs as GC: a steady step's microbatch runs as GC on every rank, a
    prediction's too (a rank that split its rows would fire the gradient hooks in another order
    than the ranks run as GC: NOTE [ One order of gradient hooks on every rank ] in
    ds_hilore/plan/steady.py); the next step agrees, and uses the predictions."""
    runtime, step = _steady_run(CountedCollective())
    runtime.expect([1.0, 0.0, 1.0, 1.0])
    assert step()[0] == [] and runtime._mb.as_gc
    assert runtime.policy.step_stats.get("predicted_microbatches", 0) == 0
    for _ in range(2):
        runtime.end_step()
        assert not runtime.policy.steady
        runtime.expect([1.0, 0.0, 1.0, 1.0])
        assert step()[0] == ["_bucket_key"]
        assert runtime.policy.step_stats["predicted_microbatches"] == 1


class UnpredictedElsewhere(CountedCollective):
    """Ranks that agree on everything, but another rank hands no prediction over: the max over
    ranks of the prediction's ``missing`` flag, in the all-reduce before the forward."""

    def all_reduce_max_float(self, values):
        values = self._record(values)
        if self.calls[-1] == "_bucket_key":
            values[3] = 1.0  # [batch, length, -length, missing, ...]
        return values


def test_whether_a_bucket_runs_as_gc_is_decided_from_agreed_values_only():
    """A step that agrees, a bucket whose plan keeps nothing, a prediction here and none on
    another rank: every rank runs the microbatch as GC, this one too -- one that ran it through
    frames beside ranks run as GC would fire the gradient hooks in another order (NOTE [ One
    order of gradient hooks on every rank ] in ds_hilore/plan/steady.py) and make the
    coefficients' all-reduce the others never make."""
    collective = UnpredictedElsewhere()
    runtime, step = _steady_run(collective)
    runtime.policy.hold_out()  # the next forward agrees
    runtime.expect([1.0, 0.0, 1.0, 1.0])
    before, calls = step()
    assert before == ["_bucket_key"] and runtime._mb.as_gc, calls
    assert "agree" not in calls


def test_one_read_returns_every_part_exactly(monkeypatch):
    from ds_hilore.runtime.reads import read_once

    parts = [torch.tensor([0.1, 3.0e-39, 7.0]), None, torch.tensor([True, False]),
             torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
             torch.tensor([1 / 3], dtype=torch.float64), torch.zeros(0), torch.tensor(True)]
    expected = [[] if p is None else p.reshape(-1).tolist() for p in parts]
    counter = DeviceReads(monkeypatch)
    counter.active = True
    got = read_once(parts)
    nothing = read_once([None, torch.zeros(0)])
    counter.active = False
    assert got == expected  # the fp32 values read as fp64 are the same Python floats
    assert nothing == [[], []]
    assert counter.count == 1, counter.where  # and none when there is nothing to read


def _grpo_loss_and_grads(model, ids, adv):
    """A GRPO loss (its coefficients handed to the runtime) under bf16 autocast, and the
    gradients of every trainable parameter (the same dropout masks in every run)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss = policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=model).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("loss", ["plain", "grpo"])
def test_a_cast_that_is_not_one_sends_its_unit_to_recompute(monkeypatch, loss):
    # the deferred proof fails (forced here): the unit is recomputed, so gradients stay exact.
    # The disproved reference is poisoned (NaN): had the slot still been read, gradients break.
    # A plain loss hands no coefficients: the proofs are read at the first unpack; a GRPO loss
    # does: they are read with its coefficients (NOTE [ Two reads per microbatch ]).
    model = with_lora(tiny_model("llama", layers=2))
    inputs = batch()
    adv = torch.tensor([1.0, -0.5, 0.25])

    def run():
        if loss == "plain":
            return loss_and_grads(model, inputs, autocast=torch.bfloat16)
        return _grpo_loss_and_grads(model, inputs["input_ids"], adv)

    ref_loss, ref = run()
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
    got_loss, grads = run()
    assert torch.equal(got_loss, ref_loss)
    assert [n for n in ref if not torch.equal(ref[n], grads[n])] == []
    assert runtime.stats["recomputed_units"] == 4  # every unit fell back
    assert runtime.stats["actions"] == {"H": 0, "L": 0, "R": 4, "E": 0}


def _grpo_with_intermediate_loss(model, ids, keep):
    logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    adv = torch.tensor([1.0, 0.0, -1.0])  # sequence 1 elided
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss = policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=model).loss
    return loss + 0.1 * keep["h"].square().mean()  # reaches sequence 1 below the top layer


def _leaking_model():
    model = tiny_model("llama", layers=3)
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    keep = {}
    handle = model.model.layers[0].register_forward_hook(lambda m, a, out: keep.update(h=out))
    return model, runtime, keep, handle


def test_loss_on_an_unrecorded_intermediate_hidden_state_is_an_error_before_any_step():
    # the per-layer flags are read after the backward, not at its end (NOTE [ Two reads per
    # microbatch ]): the optimizer's step raises before it changes anything
    model, runtime, keep, _ = _leaking_model()
    ids = batch()["input_ids"]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _grpo_with_intermediate_loss(model, ids, keep).backward()
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        optimizer.step()
    assert [n for n, p in model.named_parameters() if not torch.equal(before[n], p)] == []
    optimizer.step()  # read once: the next step is not refused again
    # without an optimizer, ``end_step`` raises
    _grpo_with_intermediate_loss(model, ids, keep).backward()
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        runtime.end_step()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_gradient_reaching_an_elided_sequence_is_a_leak_too(value):
    # NaN compares false with anything: a check ``amax() > 0`` let it pass into the parameters'
    # gradients. Seen on CUDA, where stand-in rows met a fused attention kernel's backward.
    model, runtime, keep, _ = _leaking_model()
    ids = batch()["input_ids"]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss = policy_loss(logp, logp.detach(), torch.tensor([1.0, 0.0, -1.0]), mask,
                       loss_type="grpo", model=model).loss
    poison = torch.zeros_like(keep["h"])
    poison[1] = value  # only the elided sequence's gradient, below the top layer
    (loss + (keep["h"] * poison).sum()).backward()
    assert not torch.isfinite(model.model.layers[0].mlp.down_proj.weight.grad).all()
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        optimizer.step()
    assert [n for n, p in model.named_parameters() if not torch.equal(before[n], p)] == []


def test_without_elision_an_intermediate_loss_is_exact_and_no_backward_is_skipped():
    # "elide_zero_rows": false keeps every sequence (for kernels whose backward does not map
    # zeros to zeros on stand-ins): the loss that leaks past elision is then simply exact
    model = tiny_model("llama", layers=3)
    ids = batch()["input_ids"]
    keep = {}
    model.model.layers[0].register_forward_hook(lambda m, a, out: keep.update(h=out))

    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        _grpo_with_intermediate_loss(model, ids, keep).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_zero = grads(), _grpo_loss_and_grads(model, ids, torch.zeros(3))[1]
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H",
                                       "elide_zero_rows": False})
    grads()  # the discovery call
    got = grads()
    runtime.end_step()  # nothing elided, so nothing leaked
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []
    assert runtime.stats["actions"]["E"] == 0
    zero = _grpo_loss_and_grads(model, ids, torch.zeros(3))[1]  # every sequence zero
    assert [n for n in ref_zero if not torch.equal(ref_zero[n], zero[n])] == []
    assert runtime.stats["actions"]["E"] == 0 and not runtime.stats.get("backward_skipped")


@pytest.mark.parametrize("setting, cpu, accelerator", [
    ("auto", True, "whole"), (True, True, True), ("whole", "whole", "whole"),
    (False, False, False)])
def test_elision_auto_elides_rows_on_cpu_and_whole_microbatches_on_accelerators(
        setting, cpu, accelerator, caplog):
    # NOTE [ Stand-ins on accelerators ]: auto elides rows where stand-ins are shown exact
    caplog.set_level(logging.INFO, logger="ds_hilore")
    runtime = ds_hilore.attach(tiny_model("llama", layers=2), {"elide_zero_rows": setting})
    assert runtime.elision_mode(torch.device("cpu")) == cpu
    for _ in range(2):
        assert runtime.elision_mode(torch.device("cuda", 0)) == accelerator
    said = [r for r in caplog.records if "on cuda only microbatches" in r.getMessage()]
    assert len(said) == (setting == "auto")  # said once, and only when auto decided


class LateOnOtherRank:
    """``runtime.collective`` of two ranks whose other rank's last backward leaked: the late
    flag it sends with the elision's decision (the vector ``agree`` all-reduces in agreement.py
    ends with it, whether this microbatch leaves one, whether a row predicted zero has
    coefficients and whether its rows were split; no policy here, so no risks follow)."""

    def all_reduce_max_float(self, values):
        if sys._getframe(1).f_code.co_name == "agree":
            return [*values[:-4], 1.0, *values[-3:]]
        return list(values)

    def all_reduce_max(self, values):
        if sys._getframe(1).f_code.co_name == "flush":  # the late read of a microbatch of its
            return [1, *values[1:]]  # own: the leak flag, then the disproved one
        return list(values)


def test_a_leak_is_read_with_the_next_coefficients_and_raised_on_every_rank():
    model, runtime, keep, handle = _leaking_model()
    ids = batch()["input_ids"]
    adv = torch.tensor([1.0, 0.0, -1.0])
    _grpo_with_intermediate_loss(model, ids, keep).backward()  # leaked: nothing read yet
    handle.remove()
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        _grpo_loss_and_grads(model, ids, adv)  # the next microbatch's coefficients read it
    _grpo_loss_and_grads(model, ids, adv)  # a clean backward after it: nothing to raise
    runtime.end_step()
    runtime.collective = LateOnOtherRank()  # this rank is clean, the other one leaked
    runtime.matched_calls = True  # as attach under several ranks sets it: every microbatch agrees
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        _grpo_loss_and_grads(model, ids, adv)


def test_a_leak_in_a_microbatch_of_its_own_is_raised_on_every_rank_before_the_step():
    """Under ZeRO 0-2 with a plan set by hand, a microbatch agrees nothing (NOTE [ A microbatch
    of its own ] in ds_hilore/runtime/agreement.py): a leak, this rank's or another's, is read
    and agreed once, before the optimizer step, and raised on every rank there."""
    model, runtime, keep, handle = _leaking_model()
    ids = batch()["input_ids"]
    adv = torch.tensor([1.0, 0.0, -1.0])
    runtime.collective = ranks = CountedCollective()  # after attach: ZeRO 0-2's
    _grpo_with_intermediate_loss(model, ids, keep).backward()  # leaked: nothing read yet
    handle.remove()
    _grpo_loss_and_grads(model, ids, adv)  # its own: nothing agreed, the flag left pending
    assert ranks.calls == [] and runtime._mb.local_checks
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        runtime.check_late()
    assert ranks.calls == ["flush"]
    _grpo_loss_and_grads(model, ids, adv)  # clean here; the other rank leaked
    runtime.collective = LateOnOtherRank()
    with pytest.raises(HiLoReError, match="intermediate layer's hidden state"):
        runtime.end_step()


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


def test_per_saved_tensor_work_is_looked_up_on_a_steady_microbatch(monkeypatch):
    """NOTE [ The meta run, once per shape ] (derived.py) and NOTE [ Aliases, by address ]
    (weights.py): on a steady microbatch no derived tensor's op runs on meta tensors, and a
    parameter's storage is read once per layer (the address map), not once per saved tensor."""
    from ds_hilore.runtime import derived

    model = with_lora(tiny_model("llama", layers=3, hidden=64, intermediate=128))
    runtime = ds_hilore.attach(model, {"force_plan": "H", "low_precision": "none"})
    inputs = batch(batch_size=4, seq=16)
    ids = inputs["input_ids"]

    def microbatch():
        logits = model(**inputs).logits.float()  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = torch.ones_like(logp, dtype=torch.bool)
        policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0, 0.5, -0.5]), mask,
                    model=model).loss.backward()
        runtime.end_step()

    microbatch()  # the first: shapes met once
    meta_runs, storage_reads = [], []
    result = derived._meta_result
    monkeypatch.setattr(derived, "_meta_result", lambda key, op: meta_runs.append(key)
                        if key not in derived._META else None or result(key, op))
    params = {id(p) for layer in runtime._layers for p in layer.module.parameters()}
    storage = torch.nn.Parameter.untyped_storage
    monkeypatch.setattr(torch.nn.Parameter, "untyped_storage", lambda self: storage_reads.append(
        id(self)) or storage(self))
    microbatch()
    monkeypatch.undo()
    assert meta_runs == []
    reads_of_layer_params = [p for p in storage_reads if p in params]
    assert 0 < len(reads_of_layer_params) <= len(params)  # one address map per layer


# ---- NOTE [ Leaf hooks, when a cast needs them ] (runtime/install.py) ----------------------
def _hooked_leaves(model) -> int:
    return sum(1 for m in model.modules() if m._forward_pre_hooks or m._forward_hooks
               if next(m.children(), None) is None)


def test_leaf_hooks_only_where_a_layer_may_save_a_cast_of_a_frozen_weight():
    """An fp32 LoRA model run without autocast saves no cast of a frozen weight: no leaf module
    is hooked, and its calls stay on torch's fast path; the first step under bf16 autocast hooks
    them before its layers run, so its casts are matched through the leaf (a proof each),
    and gradients are autograd's."""
    model = with_lora(tiny_model("llama", layers=2))
    inputs = batch()
    ref_loss, ref = loss_and_grads(model, inputs)
    ref_cast_loss, ref_cast = loss_and_grads(model, inputs, autocast=torch.bfloat16)
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    loss, grads = loss_and_grads(model, inputs)
    assert _hooked_leaves(model) == 0 and runtime._weights.wants_leaf is not None
    assert torch.equal(loss, ref_loss) and all(torch.equal(ref[n], grads[n]) for n in ref)
    proofs = []
    recognize = runtime._weights._frozen_cast

    def counted(t, base, params):
        found = recognize(t, base, params)
        if found is not None:
            proofs.append(found.proof is not None)
        return found

    runtime._weights._frozen_cast = counted
    loss, grads = loss_and_grads(model, inputs, autocast=torch.bfloat16)
    leaves = [m for layer in runtime._layers for m in layer.module.modules()
              if next(m.children(), None) is None and next(m.parameters(False), None) is not None]
    assert _hooked_leaves(model) == len(leaves) > 0 and runtime._weights.wants_leaf is None
    assert proofs and all(proofs)  # every cast named by its leaf, none by a full comparison
    assert torch.equal(loss, ref_cast_loss) and all(torch.equal(ref_cast[n], grads[n]) for n in ref_cast)
    runtime.detach()
    assert _hooked_leaves(model) == 0


def test_a_cast_seen_without_leaf_hooks_hooks_the_leaves():
    """A cast of a frozen weight the layer makes in its own code, in an fp32 model without
    autocast, is matched by the full comparison and hooks the leaves for the casts after it."""
    model = with_lora(tiny_model("llama", layers=2))
    runtime = ds_hilore.attach(model, {"low_precision": "none", "force_plan": "H"})
    layer = runtime._layers[0].module
    weight = next(p for p in layer.parameters() if not p.requires_grad and p.dim() == 2)
    cast = weight.detach().to(torch.bfloat16)
    assert _hooked_leaves(model) == 0
    found = runtime._weights(cast, layer)
    assert found is not None and found.param is weight and found.proof is None
    assert _hooked_leaves(model) > 0 and runtime._weights.wants_leaf is None
    runtime.detach()
