"""The actor update: ``ppo_epochs`` passes over a step's rollouts in minibatches, each one
optimizer step of ``gradient_accumulation_steps`` micro-batches, with ``ds_hilore.grpo``'s
policy loss (which hands its exact per-token coefficients to HiLoRe before the backward).
Before each actor forward HiLoRe also gets the micro-batch's predicted exposure,
|A_i| x response tokens per sequence (``engine.hilore.expect``): exact zeros when beta = 0.
From the second PPO epoch on, the previous epoch's ratios of the same tokens predict which
are clipped (NOTE [ Exposure at later PPO epochs ] in ds_hilore/grpo/exposure.py): those
count 0, a prediction that orders and packs but elides nothing it is not exact about.

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

from ds_hilore.grpo import drop_zero_rows, exposure, global_num_items, policy_loss
from ds_hilore.grpo.losses import LOSS_TYPES
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
    hilore: dict | None  # H/L/R/E counts, bytes per action, recomputed units, codec and recompute
    # seconds, the warm-up work of its optimizer steps (stats["warm_up"], kinds summed; {}: none)
    # and how many of them were steady (stats["steady"])


def actor_update(engine, rollout: Rollout, args, meter_memory: bool = False) -> UpdateResult:
    """Run the update; ``meter_memory`` wraps it in a ``PeakMeter``."""
    meter = PeakMeter(engine.device) if meter_memory else contextlib.nullcontext()
    losses, kls, clips, tokens = [], [], [], 0
    totals = _HiLoReTotals() if engine.hilore is not None else None
    start, cpu_start = time.perf_counter(), time.process_time()
    ratios: dict[tuple[int, int], torch.Tensor] = {}  # (minibatch, micro) -> last epoch's ratios
    with meter:
        for _ in range(args.ppo_epochs):
            for m, minibatch in enumerate(_minibatches(rollout, args)):
                num_items = None
                if _global_token_mean(args):  # the global token mean, see ds_hilore.grpo
                    num_items = global_num_items([mb.completion_mask for mb in minibatch],
                                                 args.gradient_accumulation_steps)
                previous = [ratios.get((m, j)) for j in range(len(minibatch))]
                step_exposure = _step_exposure(engine, minibatch, args, previous)
                for j, micro in enumerate(minibatch):
                    out, ratios[m, j] = _micro_step(engine, micro, args, num_items, step_exposure,
                                                    previous[j])
                    losses.append(out.loss.item())
                    kls.append(out.metrics["mean_kl"])
                    clips.append(out.metrics["clip_fraction_low"] + out.metrics["clip_fraction_high"])
                    tokens += micro.tokens
                if totals is not None:  # the optimizer step just taken: its micro-batches only
                    totals.add(engine.hilore.stats, len(minibatch))
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


def _global_token_mean(args) -> bool:
    """Whether the loss type divides by the step's token count (dapo, cispo, vespo: the loss
    table says which need ``num_items_in_batch``)."""
    return "num_items_in_batch" in LOSS_TYPES[args.loss_type].needs


def micro_loss(engine, micro: Rollout, args, num_items=None, model=None, step_exposure=None,
               previous_ratios=None):
    """The policy loss of one micro-batch (``model``: a module to call instead of ``engine``).
    ``step_exposure``: the optimizer step's predicted exposure (``_step_exposure``); given, the
    micro-batch's own is handed to HiLoRe before the forward (``previous_ratios``: this
    micro-batch's ratios at the previous epoch, None at the first)."""
    return _micro_loss(engine, micro, args, num_items, model, step_exposure, previous_ratios)[0]


def _micro_loss(engine, micro: Rollout, args, num_items, model, step_exposure, previous_ratios):
    """``micro_loss`` and this forward's detached ratios π_θ / π_old (B, C) of the rows kept."""
    micro, loss_kwargs = _selected(micro, args)
    if step_exposure is not None:  # before the actor forward: what the plan splits and elides by
        engine.hilore.expect(_predicted(micro, args, previous_ratios), step_exposure)
    logp = sequence_logprobs(model or engine, micro.input_ids, micro.attention_mask, micro.prompt_len)
    out = policy_loss(logp, micro.old_logp, micro.advantages, micro.completion_mask,
                      loss_type=args.loss_type, ref_logp=micro.ref_logp, beta=args.beta,
                      epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
                      max_completion_length=args.max_answer_seq_len,
                      num_items_in_batch=num_items, model=engine.module, **loss_kwargs)
    return out, torch.exp(logp.detach().float() - micro.old_logp.float())


def _selected(micro: Rollout, args) -> tuple[Rollout, dict]:
    """The rows the loss sees (``--drop_zero_rows``) and the loss's arguments for them."""
    if not args.drop_zero_rows:
        return micro, {}
    selection = drop_zero_rows(micro.advantages, micro.completion_mask, beta=args.beta)
    return micro.rows(selection.index), selection.loss_kwargs


def _predicted(micro: Rollout, args, previous_ratios) -> list[float]:
    """Per-sequence predicted exposure: |A_i| x response tokens, less the tokens the previous
    epoch clipped (clipped surrogates only: cispo caps, sapo and vespo gate softly)."""
    if previous_ratios is None or LOSS_TYPES[args.loss_type].surrogate.name != "clipped":
        return exposure.predicted(micro.advantages, micro.completion_mask)
    return exposure.predicted_after_clip(micro.advantages, micro.completion_mask, previous_ratios,
                                         args.epsilon, args.epsilon_high)


def _step_exposure(engine, minibatch: list[Rollout], args, previous=None) -> float | None:
    """The predicted exposure of an optimizer step, summed over its micro-batches and ranks;
    None when nothing is predicted. A zero advantage means a zero coefficient only without a
    KL term: with beta > 0 nothing is predicted (the plan then splits by row and decides from
    the coefficients after the forward). ``previous``: each micro-batch's last-epoch ratios."""
    if engine.hilore is None or args.beta != 0:
        return None
    previous = previous or [None] * len(minibatch)
    total = torch.tensor([sum(sum(_predicted(_selected(m, args)[0], args, r))
                              for m, r in zip(minibatch, previous))],
                         dtype=torch.float64, device=engine.device)  # (1,)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0])


def _micro_step(engine, micro: Rollout, args, num_items, step_exposure=None, previous_ratios=None):
    """One micro-step; returns the loss and this forward's ratios (the next epoch's prediction)."""
    out, ratios = _micro_loss(engine, micro, args, num_items, None, step_exposure, previous_ratios)
    engine.backward(out.loss)  # ω went to HiLoRe inside policy_loss
    engine.step()  # an optimizer step at the end of each minibatch
    return out, ratios


class _HiLoReTotals:
    """HiLoRe's stats summed over the optimizer steps of one update."""

    def __init__(self):
        self.actions = dict.fromkeys(ACTIONS, 0)
        self.bytes = dict.fromkeys(ACTIONS, 0)
        self.recomputed_units = 0
        self.recompute_s = self.pack_s = self.unpack_s = 0.0  # seconds
        self.warm_up: dict[str, float] = {}  # NOTE [ Warm-up, counted ] in ds_hilore/plan/scheduler.py
        # optimizer steps that agreed nothing before their forwards (NOTE [ A steady step agrees
        # nothing before its forwards ] in ds_hilore/plan/steady.py)
        self.steady = 0

    def add(self, stats: dict, microbatches: int) -> None:
        """An optimizer step's ``engine.hilore.stats``: its last ``microbatches`` micro-batches."""
        for kind, amount in (stats.get("warm_up") or {}).items():
            self.warm_up[kind] = self.warm_up.get(kind, 0) + amount
        self.steady += int(bool(stats.get("steady")))
        for mb in stats["microbatches"][-microbatches:]:
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
    num_items = float(micro.completion_mask.sum()) if _global_token_mean(args) else None
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
