"""Worker for tests/test_collective_plans.py: ZeRO-3 on CPU ranks with a plan of L and S units.

Run by tests.launch.run_distributed. Each ``--case`` is ``gc`` (transformers' gradient
checkpointing, the reference) or ``hilore`` (HiLoRe with the allocator on; once the bucket is
profiled its plan is replaced by a fixed one with H, L and S units on every rank, as the
knapsack makes when packing pays). Every rank sees different data: its own tokens and its own
advantages, and on planned micro-steps rank 0 predicts (``expect``) a zero exposure for a
sequence whose advantage is not zero, so that rank alone has a capture-time elision to disprove.
``--uneven``: the first micro-step of rank 1's last step has one sequence fewer (the bucket, the
max over ranks, has 4).

Reports per micro-step the losses (float.hex), the units each layer recompute re-ran (in the
order they ran: what a rank gathers under ZeRO-3), the units' actions after the forward, and
per optimizer step the global gradient norm the engine clipped with.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from tests.launch import run_cases
from tests.workers.ds_engine_worker import build_model, plan_splits, record_recomputes

SEED = 4321
VOCAB, BATCH, SEQ = 128, 4, 16
GAS, STEPS = 2, 3
# the plan of the planned steps: every kind of capture, the same on every rank
PLAN = {(0, "attn"): "S", (0, "mlp"): "L", (1, "attn"): "H", (1, "mlp"): "S"}
# advantages per rank and micro-step: rank 0's weight sits in the sequences a split packs
# (rows 0, 1 without a prediction), rank 1's in the rows it keeps whole
ADVANTAGES = {0: [[1.0, -1.0, 0.05, -0.05], [1.0, -1.0, 0.5, -0.5]],
              1: [[0.05, -0.05, 1.0, -1.0], [0.0, 0.0, 1.0, -1.0]]}
# predicted exposure on micro-step 1: rank 0 wrongly predicts sequence 3 unexposed
EXPECTED = {0: [1.0, 1.0, 1.0, 0.0], 1: [0.0, 0.0, 1.0, 1.0]}


def ds_config(case: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "gradient_clipping": 1.0, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if case == "hilore":
        config["hilore"] = {"enabled": True, "memory_budget": 4.0, "low_precision": "int8",
                            "codec_backend": "eager", "min_pack_numel": 64,
                            "profile_microbatches": GAS, "calibration_microbatches": 0,
                            "plan_validation_microbatches": 0, "grad_error_tolerance": 0.004}
    return config


def micro_batch(step: int, micro: int, rank: int, uneven: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 1000 * step + 10 * micro + rank)
    batch = BATCH - 1 if uneven and rank == 1 and step == STEPS and micro == 0 else BATCH
    return torch.randint(0, VOCAB, (batch, SEQ), generator=gen)  # (B, T) token ids


def grpo_loss(engine, ids: torch.Tensor, advantages: list[float]) -> torch.Tensor:
    from ds_hilore.grpo import policy_loss

    logits = engine(input_ids=ids).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    adv = torch.tensor(advantages[:ids.shape[0]])  # (B,)
    mask = torch.ones_like(logp, dtype=torch.bool)  # (B, T-1)
    return policy_loss(logp, None, adv, mask, loss_type="grpo", model=engine.module).loss


def run_case(case: str, args, log: list) -> dict:
    import ds_hilore.integrations.engine

    model = build_model("full", gc=case == "gc")
    engine, *_ = ds_hilore.integrations.engine.initialize(
        model=model, model_parameters=list(model.parameters()), config=ds_config(case),
        distributed_port=args.master_port)
    rank = dist.get_rank()
    runtime = engine.hilore
    if runtime is not None:
        kinds = {u.name: (u.layer_index, u.kind) for u in runtime.units}
        plan_splits(runtime.policy, lambda name: PLAN[kinds[name]])
    record = {"losses": [], "recomputed": [], "unit_actions": [], "grad_norms": [], "plans": None,
              "fits": []}
    for step in range(1, STEPS + 1):
        for micro in range(GAS):
            torch.manual_seed(SEED + 1000 * step + 10 * micro + rank)  # dropout masks
            if runtime is not None and step > 1 and micro == 1:
                runtime.policy.expect(EXPECTED[rank])
            del log[:]
            loss = grpo_loss(engine, micro_batch(step, micro, rank, args.uneven), ADVANTAGES[rank][micro])
            actions = [u.action for u in runtime.units] if runtime is not None else None
            if runtime is not None:
                record["fits"].append(runtime.policy.last_fit)
            engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item().hex())
            record["recomputed"].append(list(log))
            record["unit_actions"].append(actions)
        norm = engine.get_global_grad_norm()
        record["grad_norms"].append(float(norm) if norm is not None else None)
    if runtime is not None:
        record["plans"] = runtime.stats["plans"]
        record["rel_error"] = {u["name"]: u["rel_error"]
                               for u in runtime.stats["profiles"]["4x16"]["units"]}
    engine.destroy()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True, choices=("gc", "hilore"))
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed runner passes it
    args = parser.parse_args()
    torch.set_num_threads(1)
    log: list = []
    record_recomputes(log)
    run_cases("collective_plans_worker", args.case, lambda case: run_case(case, args, log),
              args.result_dir)


if __name__ == "__main__":
    main()
