"""Worker for tests/test_matched_passes.py: matched passes (calibration, validation) on 2 CPU ranks.

Run by tests.launch.run_distributed. Each ``--case`` is ``<stage>:<passes>``, one engine after
the other in one launch, every one on the same data:

* stage: ``zero3`` (ZeRO-3, small parameters persistent) or ``zero2``;
* passes: ``on`` (one calibrated microbatch, then every step validated), ``off`` (neither),
  ``pieces`` (as ``on``, with the passes' spare memory taken as 0: every pass runs layer by
  layer, NOTE [ What a pass holds ] in ds_hilore/plan/pass_runner.py), or ``spread`` (as
  ``on`` with two calibration samples: NOTE [ Calibration spread over ranks ] in
  ds_hilore/plan/calibrate.py).

Once the bucket is profiled its plan packs the attention units (S and L, the same on every
rank; an L MLP stores other tensors under ZeRO-3 than under ZeRO-2, so its error would differ
between the stages by more than rounding) and the tolerance is loose, so no decision depends on
what the passes measured: training is the same with passes or without. SGD keeps the two
stages' parameters within rounding of each other (Adam's first steps, ~lr x sign(g), do not).
Every rank sees its own tokens and advantages.

Reports per optimizer step the measured error, the calibration samples and pieces; after every
micro-step ZeRO-3's state as DeepSpeed holds it (the coordinator's trace, each parameter's
status and owners, each module's backward counters); and the SHA-256 of every final parameter.
"""

from __future__ import annotations

import argparse

import deepspeed
import pytest
import torch
import torch.distributed as dist

from tests.launch import run_cases
from tests.models import equal_utilities
from tests.workers.ds_engine_worker import build_model, digest, plan_splits

SEED = 2468
VOCAB, BATCH, SEQ = 128, 4, 16
GAS, STEPS = 2, 4  # step 1 profiled, step 2 calibrated, steps 3 and 4 validated
FROZEN, LR = 3, 0.05  # steps 1-3 at learning rate 0: NOTE [ The same weights at calibration ]
# NOTE [ The same weights at calibration ]
# Weights after an optimizer step differ in their last bits between ZeRO-2 and ZeRO-3 (the
# gradients are summed over ranks in another order), and packing in int8 rounds each activation
# to a grid: a last-bit change of a weight moves an activation across a rounding boundary now
# and then, and a calibration sample or a validation by a fraction of a percent (validation's
# passes run after the step's update). The steps up to the first validation run at learning
# rate 0, so both stages measure on the same weights there: the passes are compared, not the
# optimizers; the last step trains (lr > 0), and its validation is compared within that margin.
PLAN = {(0, "attn"): "S", (0, "mlp"): "H", (1, "attn"): "L", (1, "mlp"): "R"}
ADVANTAGES = {0: [[1.0, -1.0, 0.5, -0.5], [0.25, -0.75, 1.0, -1.0]],
              1: [[0.5, -0.5, 1.0, -1.0], [-1.0, 1.0, 0.25, -0.25]]}


def ds_config(stage: str, passes: str) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 64} if stage == "zero3" else {"stage": 2}
    on = passes != "off"
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 1.0, "steps_per_print": 10**6, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "hilore": {"enabled": True, "memory_budget": 4.0, "low_precision": "int8",
                       "codec_backend": "eager", "min_pack_numel": 64, "profile_microbatches": GAS,
                       "calibration_microbatches": 2 if passes == "spread" else 1 if on else 0,
                       "validation_interval": 1 if on else 0,
                       "plan_validation_microbatches": 0, "grad_error_tolerance": 0.9}}


def micro_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)  # (B, T) token ids


def grpo_loss(engine, ids: torch.Tensor, advantages: list[float]) -> torch.Tensor:
    from ds_hilore.grpo import policy_loss

    logits = engine(input_ids=ids).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    mask = torch.ones_like(logp, dtype=torch.bool)  # (B, T-1)
    return policy_loss(logp, None, torch.tensor(advantages), mask, loss_type="grpo",
                       model=engine.module).loss


def zero3_state(engine) -> dict | None:
    """What DeepSpeed's ZeRO-3 holds between micro-steps: the trace, parameter states, counters."""
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None:
        return None
    coordinator = offload.get_param_coordinator()
    mangled = "_PartitionedParameterCoordinator__"
    index = {m.ds_id: i for i, m in enumerate(engine.module.modules())}  # ds_ids count over engines
    return {"mode": getattr(coordinator, mangled + "trace_mode").name,
            "order": [index[m.ds_id] for m in getattr(coordinator, mangled + "submodule_order")],
            "step_id": getattr(coordinator, mangled + "step_id"),
            "available": getattr(coordinator, mangled + "n_available_params"),
            "params": [(p.ds_status.name, sorted(index.get(i, i) for i in p.ds_active_sub_modules),
                        p.grad is None) for p in engine.module.parameters()],
            "modules": [(m.__dict__.get("applied_pre_backward_ref_cnt"), m.__dict__.get("ds_grads_remaining"),
                         len(m.__dict__.get("ds_recompute_parameters", ())))
                        for m in engine.module.modules()]}


def run_case(case: str, args) -> dict:
    import ds_hilore.integrations.engine

    stage, passes = case.split(":")
    model = build_model("full", gc=False)
    engine, *_ = ds_hilore.integrations.engine.initialize(
        model=model, model_parameters=list(model.parameters()), config=ds_config(stage, passes),
        distributed_port=args.master_port)
    rank = dist.get_rank()
    runtime = engine.hilore
    kinds = {u.name: (u.layer_index, u.kind) for u in runtime.units}
    plan_splits(runtime.policy, lambda name: PLAN[kinds[name]])
    if passes == "pieces":
        runtime.policy.passes._spare_bytes = lambda job: 0
    record = {"losses": [], "zero3": [], "steps": []}
    for step in range(1, STEPS + 1):
        for group in engine.optimizer.param_groups:  # NOTE [ The same weights at calibration ]
            group["lr"] = 0.0 if step <= FROZEN else LR
        for micro in range(GAS):
            torch.manual_seed(SEED + 1000 * step + 10 * micro + rank)  # dropout masks
            loss = grpo_loss(engine, micro_batch(step, micro, rank), ADVANTAGES[rank][micro])
            engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item().hex())
            record["zero3"].append(zero3_state(engine))
        stats = runtime.stats
        norm = engine.get_global_grad_norm()
        record["steps"].append({"grad_norm": float(norm) if norm is not None else None,
                                "measured": stats["grad_error_measured"],
                                "measured_microbatch": stats["grad_error_measured_microbatch"],
                                "calibration": stats["calibration"],
                                "actions": dict(stats.get("actions", {}))})
    record["plans"] = runtime.stats["plans"]
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        record["param_sha"] = {name: digest(p.detach().clone()) for name, p in named}
    engine.destroy()
    return record


def main() -> None:
    # fixed times (never undone: the process ends with its cases): the engines' plans, and so
    # the errors compared across them, do not depend on the machine's load
    equal_utilities(pytest.MonkeyPatch())
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True)
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed runner passes it
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_cases("matched_passes_worker", args.case, lambda case: run_case(case, args), args.result_dir)


if __name__ == "__main__":
    main()
