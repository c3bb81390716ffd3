"""Worker for tests/test_data_parallel.py: ``ds_hilore.attach`` (no DeepSpeed) under torch's
data-parallel wrappers on 2 CPU ranks (gloo), NOTE [ Data parallel wrappers ] in
ds_hilore/runtime/install.py. Run by tests.launch.run_distributed; each ``--case`` wraps a tiny
Llama (2 layers, attention dropout on) and trains 3 optimizer steps of one microbatch of a GRPO
loss, rank 1's microbatches longer than rank 0's (16 and 24 positions: shape buckets 16 and 32
on their own), the second step's advantages all zero on both ranks (a backward of zeros, which
the wrappers' gradient hooks must still see):

* ``ddp``: DistributedDataParallel around the model, HiLoRe attached to the wrapper;
* ``fsdp2``: ``fully_shard`` on each decoder layer and on the model;
* ``fsdp1``: FullyShardedDataParallel wrapping each decoder layer and the model;

each with HF's non-reentrant gradient checkpointing (the reference), ``force_plan`` H and R,
and the planner (``low_precision: "none"``: every plan exact). Reported per run: the SHA-256 of
this rank's gradients after each step (its shard under FSDP), the collective's class, each
step's count of skipped layer backwards, and, for the planner, each step's plans. ``tensor_parallel``: a layer's projection parallelized with
DTensor (no FSDP): reports what ``attach`` raised.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from tests.launch import case_arguments, run_cases

STEPS = 3
ADVANTAGES = ([1.0, -1.0], [0.0, 0.0], [0.5, -0.5])  # per step, on both ranks
PLANNER = {"low_precision": "none", "profile_microbatches": 1, "plan_validation_microbatches": 0,
           "calibration_microbatches": 0, "memory_budget": 1.5}


def _model():
    from tests.models import tiny_model

    return tiny_model("llama", layers=2, hidden=32, intermediate=64)


def _wrapped(kind: str):
    """(what trains, the transformers model inside it)."""
    model = _model()
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), model
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model), model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                       device_id=torch.device("cpu"), use_orig_params=True)
    return wrapped, model


def _digest(module) -> str:
    """This rank's gradients: the local shard of a DTensor."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            h.update(name.encode())
            h.update(grad.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _train(kind: str, mode: str) -> dict:
    """3 steps; ``mode`` "gc" (HF's checkpointing), "H", "R" (force_plan) or "planner"."""
    import ds_hilore
    from ds_hilore.grpo import policy_loss
    from tests.models import VOCAB

    wrapped, model = _wrapped(kind)
    runtime = None
    if mode == "gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        runtime = ds_hilore.attach(wrapped, PLANNER if mode == "planner" else {"force_plan": mode})
    rank, digests, plans, skipped = dist.get_rank(), [], [], []
    for step in range(STEPS):
        length = 16 + 8 * rank
        ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(10 * step + rank))
        torch.manual_seed(100 + step)  # the same dropout draws for every mode
        logits = wrapped(input_ids=ids, use_cache=False).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = torch.ones_like(logp, dtype=torch.bool)
        policy_loss(logp, logp.detach(), torch.tensor(ADVANTAGES[step]), mask, model=model).loss.backward()
        if runtime is not None:
            runtime.end_step()
            skipped.append(runtime.stats["backward_skipped"])
            if runtime.policy is not None:
                plans.append(runtime.policy.stats["plans"])
        digests.append(_digest(wrapped))
        wrapped.zero_grad(set_to_none=True)
    collective = type(runtime.collective).__name__ if runtime is not None else None
    if runtime is not None:
        runtime.detach()
    return {"digests": digests, "collective": collective, "plans": plans, "skipped": skipped}


def _case(kind: str) -> dict:
    return {mode: _train(kind, mode) for mode in ("gc", "H", "R", "planner")}


def tensor_parallel() -> dict:
    import ds_hilore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model.model.layers[0].mlp, mesh, {"gate_proj": ColwiseParallel()})
    try:
        ds_hilore.attach(model)
    except ds_hilore.HiLoReError as error:
        return {"raised": str(error)}
    return {"raised": None}


CASES = {"ddp": lambda: _case("ddp"), "fsdp2": lambda: _case("fsdp2"),
         "fsdp1": lambda: _case("fsdp1"), "tensor_parallel": tensor_parallel}


def main() -> None:
    args = case_arguments(CASES)
    dist.init_process_group("gloo")  # the runner's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    torch.set_num_threads(1)
    run_cases("data_parallel_worker", args.case, lambda case: CASES[case](), args.result_dir)


if __name__ == "__main__":
    main()
