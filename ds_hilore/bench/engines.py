"""One run of the bench on one rank: a method's DeepSpeed engine on its own copy of the model,
and what is done with it -- the training step, a metered step, the gradient at given weights.

``train_step`` is one optimizer step of the GRPO actor update, written as DeepSpeed-Chat's
step 3 writes it: per microbatch the forward (chunked token log-probs), the GRPO loss
(``ds_hilore.grpo.policy_loss``, which hands its coefficients to HiLoRe), ``engine.backward``
and ``engine.step`` (DeepSpeed steps the optimizer at the accumulation boundary). With
``--predict`` each microbatch's predicted exposure goes to HiLoRe before its forward
(``engine.hilore.expect``), as the TRL integration does.

NOTE [ Engines side by side ]
Every run of a rank lives in one process, on its own deep copy of the same seeded model (with
LoRA the frozen base weights are shared, not copied), with its own optimizer and ZeRO buffers,
so each run's peak is read with every other run alive: the same baseline for all of them,
and a budget is a multiple of a GC peak read in that same memory. ZeRO's reduce and all-gather
buckets hold the trainable parameters in one bucket (at most DeepSpeed's default, 5e8): the
default bucket would add up to 2 GB of buffer per engine to every peak on a small LoRA model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from typing import Any

import torch
import torch.distributed as dist

from ds_hilore.bench.data import EPSILON_HIGH, EPSILON_LOW, exposure
from ds_hilore.bench.methods import (METHODS, Method, after_initialize, hilore_block, prepare,
                                     skip_reason, step_context)
from ds_hilore.bench.models import lm_of, logprobs

__all__ = ["LR", "Run", "Step", "close_run", "ds_config", "grpo_loss", "max_over_ranks",
           "metered_step", "open_run", "rank_steps", "step_gradients", "summed_over_ranks", "sync",
           "timed_step", "train_step", "trainable"]

LR = 1e-5
STEP_SEED = 1234  # reseeded before each forward: every method draws the same dropout masks
MAX_BUCKET = int(5e8)  # DeepSpeed's default reduce / all-gather bucket (elements)


@dataclasses.dataclass
class Run:
    """A method (at a budget) on this rank: its engine, or why it is skipped."""

    method: str
    budget: float | None = None
    engine: Any = None
    skipped: str | None = None
    note: str | None = None  # e.g. the k block_h runs with

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget:g}"

    @property
    def spec(self) -> Method:
        return METHODS[self.method]


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def ds_config(config, method: Method, budget: float | None, block_k: int = 0, layers: int = 0,
              numel: int = MAX_BUCKET) -> dict[str, Any]:
    """The ds_config of one run (``config``: the bench's ``Config``; ``numel``: trainable
    elements, NOTE [ Engines side by side ])."""
    bucket = int(min(MAX_BUCKET, max(numel, 1_000_000)))
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": config.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": config.zero_stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket},
        "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if config.dtype == "bf16":
        out["bf16"] = {"enabled": True}
    if method.engine == "hilore":
        out["hilore"] = hilore_block(
            method, budget=budget, tolerance=config.grad_error_tolerance,
            codec_backend=config.codec_backend, elide_zero_rows=config.elide_zero_rows,
            block_k=block_k, layers=layers)
    return out


def open_run(name: str, budget: float | None, base: torch.nn.Module, config,
             block_k: int = 0) -> Run:
    """``name``'s engine on a copy of ``base`` (a collective: every rank opens the same runs
    in the same order); a run its device cannot hold is returned skipped."""
    method = METHODS[name]
    run = Run(name, budget)
    run.skipped = skip_reason(method, config.device)
    if run.skipped:
        return run
    frozen = {id(p): p for p in base.parameters() if not p.requires_grad}
    model = copy.deepcopy(base, memo=frozen)  # LoRA: the frozen base weights are shared
    prepare(method, lm_of(model))
    params = trainable(model)
    layers = len(lm_of(model).get_decoder().layers)
    cfg = ds_config(config, method, budget, block_k, layers, sum(p.numel() for p in params))
    if method.engine == "hilore":
        from ds_hilore import initialize
    else:
        from deepspeed import initialize
    run.engine, *_ = initialize(model=model, model_parameters=params, config=cfg)
    if method.engine != "hilore":
        run.engine.hilore = None  # as ds_hilore.initialize leaves an engine without HiLoRe
    after_initialize(method, run.engine)
    if method.searched:
        run.note = f"k={block_k}"
    return run


def close_run(run: Run) -> None:
    """The engine destroyed (a HiLoRe engine's runtime detached) and dropped."""
    if run.engine is not None:
        run.engine.destroy()
    run.engine = None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def grpo_loss(forward, micro: dict[str, torch.Tensor], module) -> torch.Tensor:
    """The GRPO loss (0-dim) of one microbatch run through ``forward`` (the engine, or its
    module); old log-probs = logp + the data's offsets (``ds_hilore.bench.data``)."""
    from ds_hilore.grpo import policy_loss

    torch.manual_seed(STEP_SEED)
    logp = logprobs(forward, micro["input_ids"]).float()  # (B, T-1)
    old = logp.detach() + micro["old_offset"]  # (B, T-1)
    return policy_loss(logp, old, micro["advantages"], micro["mask"], loss_type="grpo",
                       epsilon_low=EPSILON_LOW, epsilon_high=EPSILON_HIGH, model=module).loss


def _expect(engine, micro, prediction) -> None:
    """``--predict``: the microbatch's predicted exposure, with the step's, before its forward."""
    if prediction is not None and engine.hilore is not None:
        engine.hilore.expect(exposure(micro), *prediction)


def train_step(run: Run, micro_batches: list[dict], prediction=None) -> None:
    """One optimizer step of ``run``'s engine over this rank's ``micro_batches``;
    ``prediction``: (step exposure, exposed microbatches) with ``--predict``, else None."""
    engine = run.engine
    for micro in micro_batches:
        _expect(engine, micro, prediction)
        with step_context(run.spec):
            loss = grpo_loss(engine, micro, engine.module)
        engine.backward(loss)
        engine.step()


def metered_step(run: Run, micro_batches: list[dict], prediction, device: str) -> tuple[int, int]:
    """(whole-process peak, peak above the step's start) in bytes of one ``train_step``. CPU:
    in-use bytes read after every aten op (``PeakMeter``, the reading HiLoRe plans its budget
    with); CUDA: ``max_memory_allocated`` after a reset."""
    from ds_hilore.runtime.memory import PeakMeter

    gc.collect()  # a tensor kept by a reference cycle would count in one run and not another
    sync(device)
    with PeakMeter(device) as meter:  # on CUDA it resets the device's peak counter
        train_step(run, micro_batches, prediction)
        sync(device)
    return int(meter.peak_bytes), int(meter.peak_delta)


def step_gradients(run: Run, micro_batches: list[dict], prediction, init: list[torch.Tensor],
                   flops: bool = False) -> tuple[list[torch.Tensor], list[int] | None]:
    """The step's gradient at the weights ``init`` on this rank, accumulated after each
    microbatch (one flat fp32 CPU vector each), and with ``flops`` each microbatch's forward
    and backward FLOPs (``FlopCounterMode``). ``torch.autograd.grad`` on the engine's module:
    the engine's gradient buffers, its optimizer and its weights are left as they were."""
    engine, n = run.engine, len(micro_batches)
    params = trainable(engine.module)
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, value in zip(params, init):
            p.copy_(value)
    try:
        cumulative, counts, total = [], [] if flops else None, None
        for micro in micro_batches:
            grads, count = _grad(run, micro, prediction, params, n, flops)
            total = grads if total is None else total + grads
            cumulative.append(total.cpu())
            if counts is not None:
                counts.append(count)
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
    if engine.hilore is not None:  # the microbatches closed as a step in HiLoRe's books
        engine.hilore.check_late()
        engine.hilore.end_step()
    return cumulative, counts


def _grad(run: Run, micro, prediction, params, n: int, flops: bool) -> tuple[torch.Tensor, int]:
    """(flat fp32 gradient of one microbatch's loss / n, its FLOPs or 0)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False) if flops else None
    _expect(run.engine, micro, prediction)
    with step_context(run.spec), (counter or contextlib.nullcontext()):
        loss = grpo_loss(run.engine.module, micro, run.engine.module) / n
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat([(g if g is not None else torch.zeros_like(p)).float().flatten()
                      for g, p in zip(grads, params)])  # (trainable elements,)
    return flat, int(counter.get_total_flops()) if counter is not None else 0


def summed_over_ranks(vector: torch.Tensor, device: str) -> torch.Tensor:
    """``vector`` summed over ranks (NCCL needs it on the GPU), returned on the CPU."""
    moved = vector.to("cuda" if device == "cuda" else "cpu")
    dist.all_reduce(moved)
    return moved.cpu()


# ---------------------------------------------------------------------------------- steps
@dataclasses.dataclass
class Step:
    """One optimizer step's data on this rank: its microbatches (on the device), ``expect``'s
    step arguments with ``--predict`` (else None), and every rank's tokens."""

    index: int
    seq_len: int
    micro_batches: list[dict]
    prediction: tuple[float, int | None] | None
    tokens: int


def rank_steps(config, vocab: int, rank: int, lengths: list[int]) -> list[Step]:
    """Step i of the run at sequence length ``lengths[i]``, this rank's part
    (``ds_hilore.bench.data``), moved to the device."""
    from ds_hilore.bench import data

    shape = data.Shape(micro_batch=config.micro_batch, group_size=config.group_size,
                       grad_accum=config.grad_accum, ranks=config.ranks,
                       zero_adv_share=config.zero_adv_share, clip_share=config.clip_share,
                       layout=config.layout, drop_zero_advantage=config.drop_zero_advantage)
    out = []
    for i, seq_len in enumerate(lengths):
        whole = data.global_step(shape, vocab, seq_len, config.seed, i)
        mine = [{k: v.to(config.device) for k, v in m.items()}
                for m in data.rank_microbatches(whole, shape, rank)]
        out.append(Step(i, seq_len, mine, data.prediction(whole) if config.predict else None,
                        data.tokens(whole)))
    return out


def timed_step(run: Run, step: Step, device: str) -> tuple[float, float]:
    """(wall, process CPU) seconds of ``train_step`` on this rank, between barriers: every rank
    starts together, and a rank's time is its own (the bench takes the slowest rank's). On
    CUDA the device's peak counter is reset first: HiLoRe never resets it and reads a window
    under an earlier, higher peak (another engine's step) only as a bound (NOTE [ Shared peak
    counters ] in runtime/memory.py); the bench owns its processes, nothing else reads it."""
    import time

    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    train_step(run, step.micro_batches, step.prediction)
    sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    dist.barrier()
    return wall, cpu


def max_over_ranks(value: float, device: str) -> float:
    """The largest ``value`` over ranks (a collective)."""
    box = torch.tensor([float(value)], dtype=torch.float64,
                       device="cuda" if device == "cuda" else "cpu")  # (1,)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box[0])
