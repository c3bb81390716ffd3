"""Worker for tests/test_rank_agreement.py: decisions about elided sequences that one rank's data
would take alone, under a real DeepSpeed engine on 2 CPU ranks (NOTE [ Collective elision ] in
ds_hilore/runtime/agreement.py). Run by tests.launch.run_distributed; each ``--case``:

* ``late_leak``: ZeRO-2, H everywhere, every zero sequence elided (``elide_zero_rows`` true).
  On rank 0 only, a backward turns the stand-ins of its two zero sequences into gradient (the
  stand-ins are NaN there, as a kernel that mishandles them would make them); rank 1 has no
  zero sequence. The gradients both ranks would step on are wrong once ZeRO reduced them, so
  ``engine.step()`` must raise on both, before the optimizer steps.
* ``packed_skip``: ZeRO-0, H everywhere, ``elide_zero_rows`` "whole", transformers recording
  hidden states (every layer's check is then a collective). Rank 0's microbatch is one packed
  row of three sequences, rank 1's one plain row; the second step's coefficients are zero on
  both ranks, so both skip their layers' backward (NOTE [ A backward of zeros ]) -- whether a
  row is packed is one rank's fact, and the decision to skip may not depend on it.

* ``stopped_short``: ZeRO-3, H everywhere, ``elide_zero_rows`` true, every forward stopping
  after the first of two layers (an early exit) with an entropy bonus: rank 0 elides two
  sequences, rank 1 none. With no check at the top, what was elided is recomputed -- on both
  ranks, or rank 0 alone would gather parameters rank 1 never gathers (a hang).

* ``late_leak_two_engines``: ``late_leak``'s actor next to a critic, both HiLoRe engines
  (ZeRO-2), as DeepSpeed-Chat trains them: each step runs the actor's backward, then the
  critic's, then ``critic.step()``, then ``actor.step()``. The critic's optimizer step is the
  first to read the actor's late flags (the process-wide optimizer pre-hook), so it must raise
  on both ranks -- rank 1, which elided nothing, too -- or rank 0 would stop alone while rank
  1 walks into the critic step's next collective.

* ``top_frame_on_one_rank``: ZeRO-2, H everywhere, nothing re-derived or elided (every layer
  keeps what autograd keeps, the last one through a frame that keeps nothing once its shape is
  known: NOTE [ A layer that keeps everything ]), and a loss that hands no coefficients
  (``exposure_source`` "analytic"), so the checks left are read and agreed on at the top of the
  backward, one all-reduce. The ranks meet the shapes in another order, so at steps 1 and 2
  one rank's last layer runs through its full frame (the shape's first call) and the other's
  keeps nothing: both must make that all-reduce at the same point.

* ``local_buckets``, ``local_plans``, ``local_predictions``, ``local_mixed``: steady steps (NOTE
  [ A steady step agrees nothing before its forwards ]), each rank on the bucket of its own
  shape: every bucket run as GC, then every bucket run by its plan, with sequences found zero on
  one rank only, then with predictions whose zero rows differ by rank, then a bucket run as GC
  beside one run by its plan (their docstrings).

Each rank reports, per case, what ``engine.step()`` raised (or null) at each step, HiLoRe's
``backward_skipped`` count, and the SHA-256 of the parameters at the end.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.launch import case_arguments, run_cases

SEED, VOCAB, T = 1234, 128, 24
SEGMENTS = ((0, 8), (8, 18), (18, 24))  # rank 0's packed row in packed_skip
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def _engine(port: int, stage: int, micro_batch: int, block: dict):
    import ds_hilore.integrations.engine

    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        attn_implementation="eager", use_cache=False))
    model.train()
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": OPTIMIZER, "zero_optimization": {"stage": stage},
              "steps_per_print": 10**6, "hilore": dict(block, low_precision="none")}
    engine, *_ = ds_hilore.integrations.engine.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config, distributed_port=port)
    return engine


def _loss(engine, ids, advantages, position_ids=None, hidden_states=False):
    from ds_hilore.grpo import policy_loss

    out = engine(input_ids=ids, position_ids=position_ids, output_hidden_states=hidden_states)
    logp = out.logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.ones_like(logp, dtype=torch.bool)
    return policy_loss(logp, logp.detach(), advantages, mask, model=engine.module).loss


def _step(engine, loss) -> str | None:
    """backward and step; the first line of what the step raised, or None."""
    from ds_hilore import HiLoReError

    engine.backward(loss)
    try:
        engine.step()
    except HiLoReError as error:
        return str(error).splitlines()[0]
    return None


def _digest(engine) -> str:
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def late_leak(port: int) -> dict:
    from ds_hilore.runtime import bundle, storage

    engine = _engine(port, 2, 4, {"force_plan": "H", "elide_zero_rows": True})
    rank = dist.get_rank()  # once DeepSpeed initialised
    raised, stand_ins = [], (storage.stand_in_value, bundle.stand_in_value)
    try:  # the cases after this one run in the same processes
        for step, advantages in enumerate(([1.0, -1.0, 0.5, -0.5], [1.0, 0.0, -0.5, 0.0])):
            if step == 1 and rank == 0:
                def nan(dtype):
                    return float("nan") if dtype.is_floating_point else 0
                storage.stand_in_value = bundle.stand_in_value = nan
            ids = torch.randint(3, VOCAB, (4, T),
                                generator=torch.Generator().manual_seed(10 * step + rank))
            adv = torch.tensor(advantages if rank == 0 else [1.0, -1.0, 0.5, -0.5])
            raised.append(_step(engine, _loss(engine, ids, adv)))
    finally:
        storage.stand_in_value, bundle.stand_in_value = stand_ins
    return {"raised": raised, "global_steps": engine.global_steps,
            "elided": sum(m.get("exact_zero_sequences", 0)
                          for m in engine.hilore.stats.get("microbatches", []))}


def late_leak_two_engines(port: int) -> dict:
    from ds_hilore import HiLoReError
    from ds_hilore.runtime import bundle, storage

    actor = _engine(port, 2, 4, {"force_plan": "H", "elide_zero_rows": True})
    critic = _engine(port, 2, 4, {"force_plan": "H"})
    rank = dist.get_rank()
    raised, stand_ins = [], (storage.stand_in_value, bundle.stand_in_value)
    try:
        for step, advantages in enumerate(([1.0, -1.0, 0.5, -0.5], [1.0, 0.0, -0.5, 0.0])):
            if step == 1 and rank == 0:
                def nan(dtype):
                    return float("nan") if dtype.is_floating_point else 0
                storage.stand_in_value = bundle.stand_in_value = nan
            ids = torch.randint(3, VOCAB, (4, T), generator=torch.Generator().manual_seed(10 * step + rank))
            adv = torch.tensor(advantages if rank == 0 else [1.0, -1.0, 0.5, -0.5])
            actor.backward(_loss(actor, ids, adv))
            critic.backward(critic(input_ids=ids).logits.float().square().mean())
            try:
                critic.step()
                actor.step()
            except HiLoReError as error:
                raised.append(str(error).splitlines()[0])
                break
            raised.append(None)
    finally:
        storage.stand_in_value, bundle.stand_in_value = stand_ins
    return {"raised": raised, "critic_steps": critic.global_steps}


def packed_skip(port: int) -> dict:
    engine = _engine(port, 0, 1, {"force_plan": "H", "elide_zero_rows": "whole"})
    rank = dist.get_rank()
    position_ids = torch.cat([torch.arange(e - s) for s, e in SEGMENTS])[None] if rank == 0 \
        else torch.arange(T)[None]
    raised, skipped = [], []
    for step, advantage in enumerate((1.0, 0.0)):
        ids = torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = _loss(engine, ids, torch.tensor([advantage]), position_ids, hidden_states=True)
        raised.append(_step(engine, loss))
        skipped.append(int(engine.hilore.stats.get("backward_skipped", 0)))
    return {"raised": raised, "backward_skipped": skipped, "params": _digest(engine)}


def stopped_short(port: int) -> dict:
    engine = _engine(port, 3, 4, {"force_plan": "H", "elide_zero_rows": True})
    rank = dist.get_rank()
    config = engine.module.config
    raised = []
    for step in range(2):
        ids = torch.randint(3, VOCAB, (4, T), generator=torch.Generator().manual_seed(10 * step + rank))
        adv = torch.tensor([1.0, 0.0, -0.5, 0.0] if rank == 0 else [1.0, -1.0, 0.5, -0.5])
        config.num_hidden_layers = 1  # an early exit: the forward stops below the last layer
        try:
            out = engine(input_ids=ids)
        finally:
            config.num_hidden_layers = 2
        logits = out.logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        from ds_hilore.grpo import policy_loss

        loss = policy_loss(logp, logp.detach(), adv, torch.ones_like(logp, dtype=torch.bool),
                           model=engine.module).loss
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        raised.append(_step(engine, loss - 0.1 * entropy))  # the entropy reaches every sequence
    return {"raised": raised, "global_steps": engine.global_steps}


def top_frame_on_one_rank(port: int) -> dict:
    engine = _engine(port, 2, 4, {"force_plan": "H", "derive_pointwise": False,
                                  "elide_zero_rows": False, "exposure_source": "analytic"})
    rank = dist.get_rank()
    lengths = ((T, 16), (T, T), (16, 16), (T, T))  # (rank 0's, rank 1's) per step
    raised, whole = [], []
    for step, both in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (4, both[rank]),
                            generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(input_ids=ids).logits.float().square().mean()
        whole.append(sorted(engine.hilore._mb.whole))
        raised.append(_step(engine, loss))
    return {"raised": raised, "whole": whole, "global_steps": engine.global_steps,
            "params": _digest(engine)}


def _with_and_without(port: int, budget: float, steps, record_step) -> dict:
    """``steps`` (one per optimizer step: ``record_step(engine, rank, step, item, record)``
    runs it and appends to ``record``'s lists) with HiLoRe (``budget`` x GC's peak, planned
    after one profiled microbatch, H or R only) and with HiLoRe off (the reference): each run's
    record and the SHA-256 of its final parameters."""
    got = {}
    for mode in ("hilore", "off"):
        block = {"memory_budget": budget, "profile_microbatches": 1,
                 "calibration_microbatches": 0, "plan_validation_microbatches": 0} \
            if mode == "hilore" else {"enabled": False}
        engine = _engine(port, 2, 4, block)
        record: dict[str, list] = {}
        for step, item in enumerate(steps):
            record_step(engine, dist.get_rank(), step, item, record)
        got[mode] = dict(record, params=_digest(engine))
        engine.destroy()
    return got


def _append(record: dict, **values) -> None:
    for key, value in values.items():
        record.setdefault(key, []).append(value)


def _ids(step: int, rank: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (4, length),
                         generator=torch.Generator().manual_seed(10 * step + rank))


# (rank 0's length, rank 1's) per step of ``local_buckets``: the first steps settle 4x32, then
# rank 1 meets a shape 4x32 holds (16: no bucket of its own), then one no bucket holds (48)
LOCAL_LENGTHS = ((T, T), (T, T), (T, T), (T, 16), (T, T), (T, 48), (T, 48), (T, 48), (T, 48),
                 (T, 48))


def local_buckets(port: int) -> dict:
    """Steady steps (NOTE [ A steady step agrees nothing before its forwards ]): every bucket
    runs as GC, so each rank runs its microbatch with no collective before the forward; a rank
    1 shape held by the bucket, then one that no bucket holds, then agreed in the steps after.
    Also run with HiLoRe off (the reference: GC is exact)."""
    def one(engine, rank, step, lengths, record):
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        _append(record, raised=_step(engine, _loss(engine, _ids(step, rank, lengths[rank]), adv)))
        if engine.hilore is not None:
            stats = engine.hilore.stats
            _append(record, steady=stats["steady"], as_gc=engine.hilore._mb.as_gc,
                    unplanned=stats["warm_up"].get("unplanned", 0), buckets=sorted(stats["plans"]))

    # memory_budget 1.0: no headroom over GC's peak, every plan keeps nothing (runs as GC)
    return _with_and_without(port, 1.0, LOCAL_LENGTHS, one)


# (rank 0's length, rank 1's, the rank whose sequences 1 and 3 have A = 0, or None) per step
# of ``local_plans``: 4x32 settles; steady steps with zero sequences on one rank, rank 1's 16
# (held by 4x32), its 48 (no bucket holds it: all R while rank 0 runs 4x32's plan), then
# 4x64 agreed, and steady again with each rank on its own bucket
LOCAL_PLANS = ((T, T, None), (T, T, None), (T, T, None), (T, T, 0), (T, 16, 1), (T, 48, 0),
               (T, 48, 1), (T, 48, None), (T, 48, None), (T, 48, None), (T, 48, 0), (T, 48, 1),
               (T, 16, 0))


def local_plans(port: int) -> dict:
    """Steady steps whose buckets run their plans (NOTE [ A steady step agrees nothing before
    its forwards ]): each rank takes the bucket of its own shape, so the ranks' plans differ
    (one may keep units while the other recomputes all), with sequences found zero on one rank
    only; the checks that follow a plan are each rank's own. Also run with HiLoRe off (the
    reference: H and R are exact, and so is the elision of zero sequences on a CPU)."""
    def one(engine, rank, step, item, record):
        *lengths, zero_rank = item
        adv = torch.tensor([1.0, 0.0, -0.5, 0.0] if zero_rank == rank else [1.0, -1.0, 0.5, -0.5])
        _append(record, raised=_step(engine, _loss(engine, _ids(step, rank, lengths[rank]), adv)))
        if engine.hilore is not None:
            stats = engine.hilore.stats
            _append(record, steady=stats["steady"], local=engine.hilore._mb.local_checks,
                    kept=stats["actions"]["H"],
                    buckets={k: v and "".join(sorted(set(v["actions"].values())))
                             for k, v in stats["plans"].items()})

    # budget 4x GC's: plans keep what they can; H or R only (low_precision "none")
    return _with_and_without(port, 4.0, LOCAL_PLANS, one)


# (rank 0's advantages, rank 1's, whether each hands them over before the forward) per step of
# ``local_predictions``: four steps settle 4x16, then predictions whose zero rows differ by rank
# (rank 1's whole microbatch zero, then rank 0 with none)
_NONE, _TWO, _ALL = [1.0, -1.0, 0.5, -0.5], [1.0, 0.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0]
LOCAL_PREDICTIONS = ((_NONE, _NONE, False),) * 4 + ((_TWO, _ALL, True), (_NONE, _TWO, True)) * 3


def local_predictions(port: int) -> dict:
    """Predictions handed to ``expect`` in steady steps (NOTE [ Freed memory is spent ] in
    ds_hilore/plan/prediction.py): each rank's rows and plan come from its own prediction, so
    one rank runs two rows of four, or skips the layers' backward of a microbatch predicted
    zero, while the other runs its whole microbatch, with nothing agreed. Also run with HiLoRe
    off (the reference)."""
    def one(engine, rank, step, item, record):
        *advantages, predict = item
        if predict and engine.hilore is not None:
            engine.hilore.expect([abs(a) for a in advantages[rank]])
        ids = _ids(step, rank, 16)  # rows apart are bitwise the batch's here
        _append(record, raised=_step(engine, _loss(engine, ids, torch.tensor(advantages[rank]))))
        if engine.hilore is not None:
            last = engine.hilore.stats["microbatches"][-1]
            _append(record, steady=engine.hilore.stats["steady"],
                    local=engine.hilore._mb.local_checks, kept=last["kept_rows"],
                    skipped=last["backward_skipped"])

    return _with_and_without(port, 4.0, LOCAL_PREDICTIONS, one)


# (rank 0's length, rank 1's) per step of ``local_mixed``: 4x16 and 4x32 settle, then steady
# steps with one rank on each
LOCAL_MIXED = ((16, 16),) * 3 + ((32, 32),) * 3 + ((32, 16), (16, 32)) * 2


def local_mixed(port: int) -> dict:
    """Steady steps with one rank on a bucket that runs as GC (4x32, its verdict fixed here) and
    the other on one that runs its plan (4x16): the first runs all R through HiLoRe's frames,
    not as GC, so that both fire their gradient hooks in one order (NOTE [ One order of
    gradient hooks on every rank ] in ds_hilore/plan/steady.py). Also run with HiLoRe off."""
    from ds_hilore.plan.scheduler import Scheduler

    def one(engine, rank, step, lengths, record):
        adv = torch.tensor(_NONE)
        _append(record, raised=_step(engine, _loss(engine, _ids(step, rank, lengths[rank]), adv)))
        if engine.hilore is not None:
            _append(record, steady=engine.hilore.stats["steady"], as_gc=engine.hilore._mb.as_gc)

    runs_as_gc = Scheduler._runs_as_gc
    Scheduler._runs_as_gc = lambda self, bucket, unpredicted=False: (
        bucket.key == (4, 32) or runs_as_gc(self, bucket, unpredicted))
    try:
        return _with_and_without(port, 4.0, LOCAL_MIXED, one)
    finally:
        Scheduler._runs_as_gc = runs_as_gc


# (length, whether a forward is dropped before it) per step of ``dropped_forward``: 4x16 and
# 4x32 settle, then steady steps of 4x16, each after a dropped forward
DROPPED = ((16, False),) * 3 + ((32, False),) * 3 + ((16, True),) * 8


def dropped_forward(port: int) -> dict:
    """A forward dropped without a backward on every rank (a retry after running out of
    memory), with the collector off as some trainers run, then the step's own microbatch: its
    loss's coefficients go to its own forward, not to the dropped one, whose last layer output's
    node address the new graph may reuse (NOTE [ The last layer's output, marked ] in
    ds_hilore/runtime/registry.py). Also run with HiLoRe off."""
    import gc

    def one(engine, rank, step, item, record):
        length, drop = item
        adv = torch.tensor(_TWO)
        if drop:
            dropped = _loss(engine, _ids(step + 50, rank, 16), adv)
            del dropped
        _append(record, raised=_step(engine, _loss(engine, _ids(step, rank, length), adv)))

    gc.disable()
    try:
        return _with_and_without(port, 4.0, DROPPED, one)
    finally:
        gc.enable()


CASES = {"late_leak": late_leak, "late_leak_two_engines": late_leak_two_engines,
         "packed_skip": packed_skip, "stopped_short": stopped_short,
         "top_frame_on_one_rank": top_frame_on_one_rank, "local_buckets": local_buckets,
         "local_plans": local_plans, "local_predictions": local_predictions,
         "local_mixed": local_mixed, "dropped_forward": dropped_forward}


def main() -> None:
    args = case_arguments(CASES)
    run_cases("rank_agreement_worker", args.case, lambda case: CASES[case](args.master_port),
              args.result_dir)


if __name__ == "__main__":
    main()
