"""The actor update: ``ppo_epochs`` passes over a step's rollouts in minibatches, each one
optimizer step of ``gradient_accumulation_steps`` micro-batches, with ``ds_hilore.grpo``'s
policy loss (which hands its exact per-token coefficients to HiLoRe before the backward).

Also measured here, because only the update is what HiLoRe changes: its wall time and
tokens (actor-update throughput), optionally its peak memory (``PeakMeter``; its sampling
slows every op, so a metered update is not timed), HiLoRe's stats summed over the update's
optimizer steps, and optionally the relative gradient error of HiLoRe's plan against no
checkpointing on the first micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.distributed as dist

from ds_hilore.grpo import drop_zero_rows, global_num_items, policy_loss
from ds_hilore.runtime.memory import PeakMeter

from .rollout import Rollout, sequence_logprobs, set_checkpointing

__all__ = ["UpdateResult", "actor_update", "gradient_error"]

ACTIONS = "HLRE"


@dataclasses.dataclass
class UpdateResult:
    """What one step's update did on this rank."""

    loss: float  # mean over micro-batches
    kl: float  # mean KL estimate to the reference (nan when beta = 0)
    clip_fraction: float  # mean share of clipped tokens
    tokens: int  # prompt + completion tokens forwarded and backwarded
    seconds: float  # wall time of the update
    cpu_seconds: float  # CPU time of this process during the update (less sensitive to other jobs)
    peak_bytes: int | None  # PeakMeter's peak during the update (None when not metered)
    peak_delta: int | None  # the same above what was in use when the update began
    hilore: dict | None  # H/L/R/E counts, bytes per action, recomputed units, codec and recompute seconds


def actor_update(engine, rollout: Rollout, args, meter_memory: bool = False) -> UpdateResult:
    """Run the update; ``meter_memory`` wraps it in a ``PeakMeter``."""
    meter = PeakMeter(engine.device) if meter_memory else contextlib.nullcontext()
    losses, kls, clips, tokens = [], [], [], 0
    totals = _HiLoReTotals() if engine.hilore is not None else None
    start, cpu_start = time.perf_counter(), time.process_time()
    with meter:
        for _ in range(args.ppo_epochs):
            for minibatch in _minibatches(rollout, args):
                num_items = None
                if args.loss_type in ("dapo", "cispo"):  # the global token mean, see ds_hilore.grpo
                    num_items = global_num_items([mb.completion_mask for mb in minibatch],
                                                 args.gradient_accumulation_steps)
                for micro in minibatch:
                    out = _micro_step(engine, micro, args, num_items)
                    losses.append(out.loss.item())
                    kls.append(out.metrics["mean_kl"])
                    clips.append(out.metrics["clip_fraction_low"] + out.metrics["clip_fraction_high"])
                    tokens += micro.tokens
                if totals is not None:  # the optimizer step just taken: its micro-batches only
                    totals.add(engine.hilore.stats["microbatches"][-len(minibatch):])
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return UpdateResult(
        loss=sum(losses) / len(losses), kl=sum(kls) / len(kls), clip_fraction=sum(clips) / len(clips),
        tokens=tokens, seconds=seconds, cpu_seconds=cpu_seconds,
        peak_bytes=meter.peak_bytes if meter_memory else None,
        peak_delta=meter.peak_delta if meter_memory else None,
        hilore=None if totals is None else totals.as_dict())


def _minibatches(rollout: Rollout, args):
    """Lists of ``gradient_accumulation_steps`` micro-batches, in rollout order."""
    micro = args.per_device_training_batch_size
    order = torch.arange(len(rollout))
    micros = [rollout.rows(order[i:i + micro]) for i in range(0, len(rollout), micro)]
    gas = args.gradient_accumulation_steps
    return [micros[i:i + gas] for i in range(0, len(micros), gas)]


def micro_loss(engine, micro: Rollout, args, num_items=None, model=None):
    """The policy loss of one micro-batch (``model``: a module to call instead of ``engine``)."""
    loss_kwargs = {}
    if args.drop_zero_rows:
        selection = drop_zero_rows(micro.advantages, micro.completion_mask, beta=args.beta)
        micro, loss_kwargs = micro.rows(selection.index), selection.loss_kwargs
    logp = sequence_logprobs(model or engine, micro.input_ids, micro.attention_mask, micro.prompt_len)
    return policy_loss(logp, micro.old_logp, micro.advantages, micro.completion_mask,
                       loss_type=args.loss_type, ref_logp=micro.ref_logp, beta=args.beta,
                       epsilon_low=args.epsilon, max_completion_length=args.max_answer_seq_len,
                       num_items_in_batch=num_items, model=engine.module, **loss_kwargs)


def _micro_step(engine, micro: Rollout, args, num_items):
    out = micro_loss(engine, micro, args, num_items)
    engine.backward(out.loss)  # ω went to HiLoRe inside policy_loss
    engine.step()  # an optimizer step at the end of each minibatch
    return out


class _HiLoReTotals:
    """HiLoRe's stats summed over the optimizer steps of one update."""

    def __init__(self):
        self.actions = dict.fromkeys(ACTIONS, 0)
        self.bytes = dict.fromkeys(ACTIONS, 0)
        self.recomputed_units = 0
        self.recompute_s = self.pack_s = self.unpack_s = 0.0  # seconds

    def add(self, microbatches: list[dict]) -> None:
        for mb in microbatches:
            for a in ACTIONS:
                self.actions[a] += mb["actions"].get(a, 0)
                self.bytes[a] += mb["bytes"].get(a, 0)
            self.recomputed_units += mb.get("recomputed_units", 0)
            self.recompute_s += mb.get("recompute_s", 0.0)
            self.pack_s += mb.get("pack_s", 0.0)
            self.unpack_s += mb.get("unpack_s", 0.0)

    def as_dict(self) -> dict:
        return dict(vars(self))


# ---------------------------------------------------------------------------------- gradient error
def gradient_error(engine, rollout: Rollout, args) -> float:
    """‖g_plan − g_exact‖ / ‖g_exact‖ over the trainable parameters on the first micro-batch,
    summed over ranks: g_plan with HiLoRe's current plan, g_exact with checkpointing off.

    Uses ``torch.autograd.grad`` on the module (not ``engine.backward``), so DeepSpeed's
    gradient buffers and the optimizer never see these gradients. 0 exactly when the plan
    holds no L unit (H and R are exact). A collective: call it on every rank.
    """
    module = engine.module
    params = [p for p in module.parameters() if p.requires_grad]
    micro = rollout.rows(torch.arange(min(args.per_device_training_batch_size, len(rollout))))
    num_items = float(micro.completion_mask.sum()) if args.loss_type in ("dapo", "cispo") else None
    with_plan = torch.autograd.grad(micro_loss(engine, micro, args, num_items, module).loss, params,
                                    allow_unused=True)
    set_checkpointing(module, False)
    try:
        exact = torch.autograd.grad(micro_loss(engine, micro, args, num_items, module).loss, params,
                                    allow_unused=True)
    finally:
        set_checkpointing(module, True)
    diff = sum(_sq(a, b) for a, b in zip(with_plan, exact))  # fp64 0-dim
    norm = sum(_sq(b, None) for b in exact)
    sums = torch.stack([diff, norm])  # (2,) fp64
    if dist.is_initialized():
        dist.all_reduce(sums)
    return float(sums[0].sqrt() / sums[1].sqrt()) if sums[1] > 0 else 0.0


def _sq(a, b) -> torch.Tensor:
    if a is None:
        return torch.zeros((), dtype=torch.float64)
    d = a.double() if b is None else a.double() - b.double()
    return d.pow(2).sum().cpu()
