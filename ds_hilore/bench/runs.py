"""One run of ``hilore bench``: a method on its own copy of the model, and the update it times.

``step(run, micro_batches)`` is one optimizer step of the GRPO actor update: for every
microbatch, the predicted exposure handed to HiLoRe's scheduler (``Scheduler.expect``: |A_i| *
response tokens), the forward, chunked token log-probs, ``ds_hilore.grpo.policy_loss`` divided by
the number of microbatches (gradient accumulation), the backward; then ``AdamW.step`` and
``runtime.end_step``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys
import warnings
from typing import Any

import torch

from ds_hilore.bench.data import EPSILON_HIGH, EPSILON_LOW, exposure
from ds_hilore.bench.methods import METHODS, Context
from ds_hilore.bench.options import PRESETS
from ds_hilore.grpo import policy_loss, token_logprobs

__all__ = ["Run", "build_model", "close", "fresh_peak", "logprobs", "measure_peak", "new_run",
           "step", "warm"]

STEP_SEED = 1234


@dataclasses.dataclass
class Run:
    method: str
    budget: float | None
    model: torch.nn.Module | None = None
    context: Context | None = None
    optimizer: Any = None
    skipped: str | None = None
    wall_s: dict[int, float] = dataclasses.field(default_factory=dict)  # round -> seconds
    cpu_s: dict[int, float] = dataclasses.field(default_factory=dict)  # round -> CPU seconds
    profile_s: float = 0.0
    warmup_steps: int = 0
    warmed: bool = True  # False: the warm-up stopped at its cap with HiLoRe still planning
    peak_bytes: int | None = None
    activation_peak_bytes: int | None = None
    grad_errs: list[float] = dataclasses.field(default_factory=list)  # per step
    grad_errs_micro: list[float] = dataclasses.field(default_factory=list)  # per microbatch
    microbatch_flops: list[int] | None = None  # fwd + bwd FLOPs of each microbatch of one step
    stats: dict[str, Any] | None = None
    plans: dict[str, dict[str, str]] | None = None  # shape bucket -> unit -> planned action
    note: str | None = None
    copy_of: Run | None = None  # all_l: measured once, reported per budget
    calibration_seen: list = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget:g}"

    @property
    def live(self) -> bool:
        return not self.skipped and self.copy_of is None


# ---------------------------------------------------------------------------------- model
def build_model(config: dict[str, Any]) -> torch.nn.Module:
    import transformers

    dtype = torch.bfloat16 if config["dtype"] == "bf16" else torch.float32
    torch.manual_seed(config["seed"])
    if config["model"] in PRESETS:
        fields = dict(PRESETS[config["model"]])
        if config["layers"] is not None:
            fields["num_hidden_layers"] = config["layers"]
        model_type = fields.pop("model_type")
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        model = model.to(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            config["model"], local_files_only=True, dtype=dtype)
        if config["layers"] is not None:
            lm = model.get_decoder()
            lm.layers = lm.layers[: config["layers"]]
            model.config.num_hidden_layers = len(lm.layers)
            if getattr(model.config, "layer_types", None):
                model.config.layer_types = model.config.layer_types[: config["layers"]]
    if config["lora_r"]:
        import peft

        r = config["lora_r"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear"))
        for name, p in model.named_parameters():  # non-zero B: every adapter has a gradient
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    model.train()
    return model.to(config["device"])


def lm_of(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``ids[:, 1:]``, chunked over the vocabulary (no (B, T, V) logits)."""
    lm = lm_of(model)
    captured = {}

    def keep(module, args, out):
        captured["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    # the whole model runs (HiLoRe's scheduler starts a microbatch at its forward), the LM head
    # on one position only; the decoder's last hidden state goes to the chunked log-probs
    hook = lm.get_decoder().register_forward_hook(keep)
    try:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    hidden = captured["h"]  # (B, T, H)
    return token_logprobs(hidden[:, :-1], lm.get_output_embeddings(), ids[:, 1:])  # (B, T-1)


# ---------------------------------------------------------------------------------- the update
def _forward_loss(model, micro):
    torch.manual_seed(STEP_SEED)
    logp = logprobs(model, micro["input_ids"]).float()  # (B, T-1)
    return policy_loss(logp, micro["old_logp"], micro["advantages"], micro["mask"],
                       loss_type="grpo", epsilon_low=EPSILON_LOW, epsilon_high=EPSILON_HIGH,
                       model=model).loss


def _expect(run: Run, micro, step_exposure: float, exposed: int) -> None:
    """Hand HiLoRe the next microbatch's predicted exposure before its forward (its public
    call, ``HiLoReRuntime.expect``; a zero is exact: A = 0 gives a zero coefficient whatever
    the ratio, beta = 0), with the step's total and how many of its microbatches are non-zero."""
    if run.context.runtime is not None:
        run.context.runtime.expect(exposure(micro), step_exposure, exposed or None)


def step(run: Run, micro_batches, optimize: bool = True, flops: bool = False,
         after_each=None) -> None:
    """One optimizer step over ``micro_batches`` (accumulated) with the run's method on;
    ``after_each(i)`` is called after microbatch i's backward (the gradient pass reads it)."""
    model = run.model
    model.zero_grad(set_to_none=True)
    n = len(micro_batches)
    counter = None
    if flops:  # forward + backward under the counter (SAC's recompute must see the same ops)
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
    predicted = [sum(exposure(m)) for m in micro_batches]
    step_exposure, exposed = sum(predicted), sum(1 for p in predicted if p > 0)
    counts = []  # the counter starts from zero at each entry: read per microbatch
    for i, micro in enumerate(micro_batches):
        _expect(run, micro, step_exposure, exposed)
        with run.context.step():
            if counter is not None:
                with counter:
                    (_forward_loss(model, micro) / n).backward()
                counts.append(int(counter.get_total_flops()))
            else:
                (_forward_loss(model, micro) / n).backward()
        if after_each is not None:
            after_each(i)
    if counter is not None:
        run.microbatch_flops = counts
    if optimize:
        run.optimizer.step()
        model.zero_grad(set_to_none=True)  # NOTE [ One baseline for every run ]
    if run.context.runtime is not None:
        run.context.runtime.end_step()


def warm(run: Run) -> bool:
    """The run's warm-up is over: HiLoRe planned every shape, leave-one-out and calibration done."""
    runtime = run.context.runtime
    if not METHODS[run.method].policy or runtime is None or runtime.policy is None:
        return True
    policy = runtime.policy
    # a plan's peak checked too: a check may plan again (NOTE [ Headroom a checked plan left ])
    planned = bool(policy.buckets) and all(b.plan is not None and b.loo is None and
                                           not policy.metering.awaits_check(b)
                                           for b in policy.buckets.values())
    # calibration runs only where there is something to pack (a codec, L in the plan); it is
    # over when it reached its count or stopped advancing
    seen = run.calibration_seen
    run.calibration_seen = seen[-2:] + [policy.calibrated]
    calibrated = (runtime._codec is None
                  or policy.calibrated >= runtime.config.calibration_microbatches
                  or (len(seen) >= 3 and len(set(seen[-3:] + [policy.calibrated])) == 1))
    return planned and calibrated


# ---------------------------------------------------------------------------------- lifecycle
def progress(message: str) -> None:
    print(f"hilore bench: {message}", file=sys.stderr, flush=True)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def new_run(method: str, budget, base, config, extra=None) -> Run:
    run = Run(method, budget)
    reason = METHODS[method].skip_reason(config)
    if reason:
        run.skipped = reason
        return run
    frozen = {id(p): p for p in base.parameters() if not p.requires_grad}
    run.model = copy.deepcopy(base, memo=frozen)  # LoRA: the frozen base weights are shared
    cfg = dict(config, budget=budget, **(extra or {}))
    try:
        run.context = METHODS[method].setup(run.model, cfg)
    except Exception as error:  # noqa: BLE001 -- reported as the reason it was skipped
        if config.get("strict"):
            raise
        run.skipped, run.model = f"setup failed: {first_line(error)}", None
        return run
    run.note = run.context.note
    params = [p for p in run.model.parameters() if p.requires_grad]
    run.optimizer = torch.optim.AdamW(params, lr=1e-5)
    _state_now(run.optimizer)  # NOTE [ One baseline for every run ]
    return run


# NOTE [ One baseline for every run ]
# Every run's model copy lives in one process, and a HiLoRe run's budget is relative to the GC
# peak it profiles there: the process's memory outside the step is part of that peak. Were an
# optimizer's state made at its first step and gradients kept between steps, a run profiled
# after others had stepped would see their state and gradients in its baseline and get a
# larger budget (measured at 1.10x on paper-cpu: static 366.9, hr 376.8, hilore 386.5 MB, in
# warm-up order). So every optimizer's state exists from the run's creation and no run keeps
# its gradients past its step: outside a step, the process holds the same bytes whichever run
# profiles, warms up or is measured, and every budgeted run gets the same absolute budget.
# Garbage is collected before each run's warm-up and metered step (``collect``): a tensor
# kept alive by a reference cycle until the collector's next pass would count in one run's
# baseline and not in another's.
def _state_now(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's per-parameter state (step 0, zero moments) made now, as its first step would
    make it: the update is unchanged (the moments start at zero, the step count at 0)."""
    from torch.optim.optimizer import _get_scalar_dtype

    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable") or group.get("amsgrad"):
            continue  # laid out otherwise: left to the first step
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def close(run: Run) -> None:
    if run.model is not None and run.context is not None:
        try:
            METHODS[run.method].teardown(run.model, run.context)
        except Exception as error:  # noqa: BLE001 -- the copy is dropped anyway
            progress(f"{run.label}: teardown failed ({first_line(error)})")
    run.model = run.context = run.optimizer = None


def collect() -> None:
    """Python's cyclic garbage collected now (NOTE [ One baseline for every run ]): tensors held
    by reference cycles (autograd graphs, frames) otherwise live until the collector's next
    pass, which comes after a count of Python allocations, not at the same point of every run."""
    gc.collect()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fresh_peak(device: str) -> None:
    """CUDA: the device's peak counters reset before a run warms up. HiLoRe never resets them
    (other readers share them) and reads a window under an earlier peak only as bounds (NOTE
    [ Shared peak counters ] in runtime/memory.py): a run profiled after a run that peaked
    higher (no checkpointing) would plan from sampled bytes, a lower bound, and its plan's
    check could not see an overshoot. The bench owns its process: nothing else reads them."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def measure_peak(run: Run, micro_batches, device: str) -> tuple[int, int]:
    """(whole-process peak, peak above the step's start) of one metered step: forward, loss,
    backward, AdamW and ``end_step`` of every microbatch. CPU: in-use bytes read after every
    aten op -- the reading HiLoRe's scheduler plans its budget with (NOTE [ Tracked on CPU ] in
    plan/metering.py), so "within budget" and the budget use one meter; CUDA: the device's
    peak counter."""
    from ds_hilore.runtime.memory import PeakMeter

    run.model.zero_grad(set_to_none=True)
    collect()
    sync(device)
    with PeakMeter(device) as meter:
        step(run, micro_batches)
        sync(device)
    return meter.peak_bytes, meter.peak_delta
