"""Worker for tests/test_grpo_distributed.py: GRPO losses under DeepSpeed, 2 ranks, GAS 2.

Run by tests.launch.run_distributed. For each ``--pass`` it runs one optimizer step of
``gradient_accumulation_steps`` micro-steps through a plain ``deepspeed.initialize`` engine
(ZeRO stage 0, fp32, CPU) and reports the engine's accumulated, rank-averaged gradient as
read after the last micro-step's backward and before ``engine.step()``:

* ``grpo``        policy_loss(loss_type="grpo") as is.
* ``dapo``        num_items_in_batch = global_num_items(masks, G) = N / (G · W).
* ``dapo_trl_n``  num_items_in_batch = N (TRL's value) -- documents the G · W factor.

The optimizer's learning rate is 0, so every pass sees the same weights. The data and the
model builders are shared with the test, which computes the single-process reference.
"""

from __future__ import annotations

import argparse

import torch

from tests.launch import write_result
from tests.models import tiny_model

GAS, MICRO_BATCH, SEQ, WORLD = 2, 4, 16, 2
PASSES = ("grpo", "dapo", "dapo_trl_n")


def build_model() -> torch.nn.Module:
    return tiny_model("llama", dropout=False, seed=7).float()


def micro_data(rank: int, micro: int) -> dict[str, torch.Tensor]:
    """The micro-batch ``micro`` of ``rank``: ids (B, SEQ), mask / noise (B, SEQ-1), adv (B,)."""
    g = torch.Generator().manual_seed(100 + 10 * rank + micro)
    ids = torch.randint(0, 128, (MICRO_BATCH, SEQ), generator=g)
    lengths = torch.randint(2, SEQ, (MICRO_BATCH,), generator=g)
    mask = torch.arange(SEQ - 1)[None, :] < lengths[:, None]  # (B, SEQ-1), variable lengths
    adv = torch.randn(MICRO_BATCH, generator=g)
    adv[(rank + micro) % MICRO_BATCH] = 0.0  # one A = 0 sequence per micro-batch
    noise = 0.3 * torch.randn(MICRO_BATCH, SEQ - 1, generator=g)  # old = logp + noise: clipping
    return {"ids": ids, "mask": mask, "adv": adv, "noise": noise}


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()  # (B, SEQ-1, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, SEQ-1)


def engine_gradient(engine, rank: int, name: str) -> dict[str, list[float]]:
    import deepspeed

    from ds_hilore.grpo import global_num_items, policy_loss

    data = [micro_data(rank, k) for k in range(GAS)]
    n_scaled = global_num_items([d["mask"] for d in data], GAS)  # collective: N / (G · W)
    num_items = {"grpo": None, "dapo": n_scaled, "dapo_trl_n": n_scaled * GAS * WORLD}[name]
    loss_type = "grpo" if name == "grpo" else "dapo"
    grads = None
    for k, d in enumerate(data):
        logp = logprobs(engine, d["ids"])
        out = policy_loss(logp, logp.detach() + d["noise"], d["adv"], d["mask"], loss_type=loss_type,
                          epsilon_high=0.28, num_items_in_batch=num_items)
        engine.backward(out.loss)
        if k == GAS - 1:  # reduced across ranks at this boundary, not yet stepped
            grads = {n: deepspeed.utils.safe_get_full_grad(p).flatten().tolist()
                     for n, p in engine.module.named_parameters()}
        engine.step()
    return grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed runner passes it
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(distributed_port=args.master_port)
    model = build_model()
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == WORLD, world
    grads = {name: engine_gradient(engine, rank, name) for name in args.passes.split(",")}
    write_result(args.result_dir, rank, {"rank": rank, "world_size": world, "backend": dist.get_backend(),
                                         "gas": engine.gradient_accumulation_steps(), "grads": grads})


if __name__ == "__main__":
    from tests.launch import end_distributed

    main()
    end_distributed()  # NOTE [ Ending the process group ] in tests/launch.py
