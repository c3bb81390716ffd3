"""Worker for tests/test_warm_up.py: a bucket that runs as gradient checkpointing on 2 CPU ranks
(NOTE [ Never slower than GC ] in ds_hilore/plan/validate.py).

Run by tests.launch.run_distributed. Each ``--case`` is ``<stage>:<mode>``: ZeRO ``zero2`` or
``zero3``; ``gc`` (transformers' gradient checkpointing, the reference) or ``hilore`` (HiLoRe
with H and R only, leave-one-out with GC timed against the plan) or ``predict`` (the same, with
the prediction handed from step ``PREDICTED_FROM`` on). Leave-one-out's clock is fixed
per rank, and every H pays in the profile: rank 0 times GC faster than the plan, rank 1 the plan faster than GC; over ranks (the
max) GC is faster, so every rank must run the bucket as GC, rank 1 too.

Reports per micro-step the loss (float.hex) and whether the microbatch ran as GC; the bucket's
verdict; the SHA-256 of every final parameter.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
import torch.distributed as dist

from tests.launch import run_cases
from tests.workers.ds_engine_worker import build_model, digest

SEED = 8642
VOCAB, BATCH, SEQ = 128, 4, 16
# step 1 profiled; steps 2-4 leave-one-out (warm-up, plan, GC, layers; then the plan and GC once
# more: GC's verdict confirmed, NOTE [ GC's verdict, confirmed ]); then GC
GAS, STEPS = 2, 7
# from step 6 rank 0's first sequence has A = 0; ``predict`` hands the prediction then, so the
# ranks agree to split rows while rank 1 has none to split
PREDICTED_FROM = 6
# seconds per variant, per rank: the max over ranks has GC (1.5) faster than the plan (2.0)
TIMES = {0: {"plan": 2.0, "gc": 1.0, "layer": 2.5}, 1: {"plan": 1.0, "gc": 1.5, "layer": 2.5}}


def ds_config(stage: str, mode: str) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0} if stage == "zero3" else {"stage": 2}
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "gradient_clipping": 1.0, "steps_per_print": 10**6, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True}
    if mode in ("hilore", "predict"):
        config["hilore"] = {"enabled": True, "memory_budget": 4.0, "low_precision": "none",
                            "profile_microbatches": GAS, "calibration_microbatches": 0,
                            "plan_validation_microbatches": 1}
    return config


def fixed_clock(rank: int) -> None:
    """Leave-one-out records this rank's fixed seconds per variant, whatever the clock said."""
    from ds_hilore.plan.validate import LeaveOneOut

    record = getattr(LeaveOneOut, "_measured_record", LeaveOneOut.record)
    LeaveOneOut._measured_record = record

    def fixed(self, variant, seconds, tokens=None):
        kind = "plan" if variant is None else "gc" if variant == LeaveOneOut.GC else "layer"
        return record(self, variant, TIMES[rank][kind] if variant != LeaveOneOut.WARM_UP else seconds)

    LeaveOneOut.record = fixed

    # every H pays in the profile, whatever the clock said: the plan keeps something on every
    # machine, so leave-one-out runs and has GC to time against it
    from ds_hilore.plan.profile import Profiler

    result = getattr(Profiler, "_measured_result", Profiler.result)
    Profiler._measured_result = result

    def paying(self, *args, **kwargs):
        profile = result(self, *args, **kwargs)
        for cost in profile.units:
            cost.recompute_s, cost.capture_s, cost.derive_s = 1.0, 0.0, 0.0
        return profile

    Profiler.result = paying


def grpo_loss(engine, ids: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    from ds_hilore.grpo import policy_loss

    logits = engine(input_ids=ids).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    mask = torch.ones_like(logp, dtype=torch.bool)  # (B, T-1)
    return policy_loss(logp, None, advantages, mask, loss_type="grpo", model=engine.module).loss


def run_case(case: str, args) -> dict:
    import ds_hilore.integrations.engine

    stage, mode = case.split(":")
    model = build_model("full", gc=mode == "gc")
    for module in model.modules():  # dropout off, as GRPO actors train: rows can be split
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.0
    engine, *_ = ds_hilore.integrations.engine.initialize(
        model=model, model_parameters=list(model.parameters()), config=ds_config(stage, mode),
        distributed_port=args.master_port)
    rank, runtime = dist.get_rank(), engine.hilore
    fixed_clock(rank)
    record = {"losses": [], "as_gc": [], "steady": []}
    for step in range(1, STEPS + 1):
        for micro in range(GAS):
            gen = torch.Generator().manual_seed(SEED + 1000 * step + 10 * micro + rank)
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)  # (B, T)
            advantages = torch.randn(BATCH, generator=gen)  # (B,)
            if step >= PREDICTED_FROM and rank == 0:
                advantages[0] = 0.0  # a zero row on rank 0 only
            if mode == "predict" and step >= PREDICTED_FROM:  # rows split on rank 0 alone
                from ds_hilore.grpo import exposure

                runtime.expect(exposure.predicted(advantages, torch.ones(BATCH, SEQ - 1)))
            torch.manual_seed(SEED + step + rank)  # dropout masks
            loss = grpo_loss(engine, ids, advantages)
            engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item().hex())
            record["as_gc"].append(bool(runtime is not None and runtime._mb.as_gc))
        if runtime is not None:  # NOTE [ A steady step agrees nothing before its forwards ]
            record["steady"].append(runtime.stats["steady"])
    if runtime is not None:
        bucket = runtime.policy.buckets[(BATCH, SEQ)]
        record["gc_faster"] = bucket.gc_faster
        record["kept"] = [a for a in bucket.plan.actions.values() if a != "R"]
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        record["param_sha"] = {name: digest(p.detach().clone()) for name, p in named}
    engine.destroy()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True)
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed runner passes it
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_cases("gc_fallback_worker", args.case, lambda case: run_case(case, args), args.result_dir)


if __name__ == "__main__":
    main()
