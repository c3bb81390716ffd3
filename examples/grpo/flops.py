"""The FLOP regime of the actor update (``--count_flops``): how much of it is recomputation.

After the last step, one optimizer step's micro-batches of the last rollout run forward and
backward twice at the final weights, counted by ``torch.utils.flop_counter.FlopCounterMode``:
once with the run's checkpointing (transformers' GC, or HiLoRe's plan) and once with
checkpointing off. What a micro-batch runs above no checkpointing is what it recomputes;
a micro-batch that runs fewer FLOPs (HiLoRe skipped a backward it knew to be zero) counts 0,
as ``hilore bench`` counts it (``ds_hilore.bench.summary.recomputed_flops``).

NOTE [ Counting FLOPs after training ]
The counted passes use ``torch.autograd.grad`` on the module, as the gradient-error check does:
DeepSpeed's gradient buffers, the optimizer and the weights never see them, so the run's
trajectory and its timings are those of training alone. They run after the last step, so the
extra micro-batches HiLoRe sees change none of the plans that trained. FLOPs do not depend on
the machine's load: one step's count is the regime's figure.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .rollout import Rollout, set_checkpointing
from .update import _global_token_mean, _micro_loss, _minibatches, _step_exposure

__all__ = ["count_update_flops", "recompute_share", "recomputed"]


def recomputed(mine: list[int], none: list[int]) -> int:
    """FLOPs run above no checkpointing's, micro-batch by micro-batch (fewer counts 0)."""
    if len(mine) != len(none):
        raise ValueError(f"FLOP counts of {len(mine)} and {len(none)} micro-batches: count the same ones")
    return sum(max(0, m - n) for m, n in zip(mine, none))


def recompute_share(flops: dict | None) -> float | None:
    """The recomputed share of the update's FLOPs (``count_update_flops``'s result)."""
    if not flops or not flops.get("update_flops"):
        return None
    return flops["recomputed_flops"] / flops["update_flops"]


def count_update_flops(engine, rollout: Rollout, args, checkpointing: bool = True) -> dict | None:
    """The FLOPs of one optimizer step's micro-batches on this rollout, summed over ranks, with
    the run's checkpointing (``checkpointing``: whether it has any) and without; None when the
    counter cannot run here (said on rank 0). A collective: call it on every rank."""
    from torch.utils.flop_counter import FlopCounterMode

    module = engine.module
    params = [p for p in module.parameters() if p.requires_grad]
    minibatch = _minibatches(rollout, args)[0]
    num_items = _num_items(minibatch, args)
    counts = {}
    try:
        for label, on in (("mine", checkpointing), ("none", False)):
            set_checkpointing(module, on)
            exposure = _step_exposure(engine, minibatch, args) if on else None
            counts[label] = []
            for micro in minibatch:
                with FlopCounterMode(display=False) as counter:
                    out, _ = _micro_loss(engine, micro, args, num_items, module, exposure, None)
                    torch.autograd.grad(out.loss, params, allow_unused=True)
                counts[label].append(int(counter.get_total_flops()))
            _close_step(engine)
    except Exception as error:  # noqa: BLE001 -- another dispatch mode can refuse the counter
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"note: FLOPs not counted ({type(error).__name__}: {error})", flush=True)
        return None
    finally:
        set_checkpointing(module, checkpointing)
    return _summed(counts, minibatch)


def _num_items(minibatch: list[Rollout], args):
    if not _global_token_mean(args):
        return None
    return float(sum(m.completion_mask.sum() for m in minibatch))


def _close_step(engine) -> None:
    """The counted micro-batches closed as a step in HiLoRe's books, as a training step is."""
    if engine.hilore is not None:
        engine.hilore.check_late()
        engine.hilore.end_step()


def _summed(counts: dict[str, list[int]], minibatch: list[Rollout]) -> dict:
    totals = torch.tensor([sum(counts["mine"]), sum(counts["none"]), recomputed(counts["mine"], counts["none"]),
                           sum(m.tokens for m in minibatch), len(minibatch)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals)
    mine, none, again, tokens, micro = (int(v) for v in totals.tolist())
    out = {"update_flops": mine, "no_checkpointing_flops": none, "recomputed_flops": again,
           "microbatches": micro, "tokens_per_microbatch": tokens / micro,
           "sequences_per_microbatch": len(minibatch[0])}
    out["recompute_share"] = recompute_share(out)
    return out
