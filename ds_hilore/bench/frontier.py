"""``hilore bench``: throughput, memory and gradient error of every activation method (a frontier).

For each method of ``ds_hilore.bench.methods.METHODS`` (budgeted ones once per memory budget)
on its own copy of the same initial model, the bench times the GRPO actor update -- forward,
chunked token log-probs, ``ds_hilore.grpo.policy_loss`` on groups with and without reward spread
(one update off-policy, so tokens get clipped) and a response mask, backward, ``AdamW.step`` --
round-robin over the runs after warm-up. HiLoRe's warm-up (profiled all-R microbatches,
calibration, leave-one-out) is timed on its own (``profile_s``). Then, in separate passes:
the peak memory of one step (``PeakMeter``), the gradient at the initial weights against no
checkpointing on every bench microbatch, and the FLOPs of the backward (``FlopCounterMode``).

Besides the runs, the report carries ``overlaps`` (pairs of runs whose min-max throughput ranges
overlap), ``efficiency`` (forced all-R vs gc, forced all-H vs nogc) and ``targets`` (HiLoRe's
verdict per budget, ``ds_hilore.bench.targets``); ``ds_hilore.bench.report`` reads it (table,
plot, ``--report`` to print a saved one again).

Memory: ``peak_bytes`` is the whole process (CPU: mallinfo2 + mmap'd, as HiLoRe measures its
own budget; CUDA: max_memory_allocated) while every run's model copy is alive, so it is the same
baseline for every run; ``activation_peak_bytes`` is the peak above what was in use at the start
of the step (weights, optimizer state, gradients freed). With LoRA the copies share the frozen
base weights; only adapters and optimizer state are per copy.

``ds_ac`` needs DeepSpeed's communication backend: when none is up it is skipped, unless
``--ds-init``: then the bench starts a one-rank group (gloo on CPU, nccl on CUDA, a free local
port) and ends it when done (on CPU, DeepSpeed first builds its shm comm op: minutes).

Notes: LoRA dropout is 0 (every copy draws the same masks anyway: the RNG is reseeded each
step). ``all_l``'s plan does not depend on the budget: it is measured once, and the row is
repeated per budget (``measured_once``). HiLoRe's own budget is relative to the GC peak it
measures while profiling; ``within_budget`` uses the bench's GC peak.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any

import torch

from ds_hilore.bench.methods import METHODS, Context
from ds_hilore.bench.report import efficiency, overlaps, plot, table
from ds_hilore.bench.targets import targets
from ds_hilore.grpo import group_advantages, policy_loss, token_logprobs

__all__ = ["DEFAULT_METHODS", "PRESETS", "BenchError", "check_args", "parse_budgets", "run_bench"]

MiB = 1 << 20
STEP_SEED = 1234
MAX_WARMUP = 40  # microbatches of HiLoRe warm-up at most (profile + calibration + LOO)
DEFAULT_METHODS = tuple(METHODS)

_QWEN25 = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True,
               rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)
PRESETS: dict[str, dict[str, Any]] = {  # published config.json numbers; random weights
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=False, max_position_embeddings=4096),
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "phi-3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32064, tie_word_embeddings=False, rms_norm_eps=1e-5,
                       max_position_embeddings=4096),
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, vocab_size=262144, tie_word_embeddings=True,
                       sliding_window=512, rms_norm_eps=1e-6, max_position_embeddings=32768),
}


class BenchError(Exception):
    """A flag value the bench cannot run with; one line naming the flag and what is allowed."""


# ---------------------------------------------------------------------------------- arguments
def parse_budgets(text: str) -> list[float]:
    try:
        budgets = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--budgets {text}: not a comma-separated list of numbers; allowed: "
                         "multiples of GC's peak >= 1.0, e.g. --budgets 1.05,1.10,1.20") from None
    bad = [b for b in budgets if not b >= 1.0 or not math.isfinite(b)]
    if bad or not budgets:
        raise BenchError(f"--budgets {text}: budgets are multiples of GC's peak and must be >= 1.0 "
                         "(e.g. --budgets 1.05,1.10,1.20)")
    return budgets


def parse_methods(text: str | None) -> list[str]:
    names = list(DEFAULT_METHODS) if not text else [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise BenchError(f"--methods: unknown method {','.join(unknown) or '(none)'}; allowed: "
                         f"{', '.join(METHODS)}")
    for required in ("gc", "nogc"):  # the budget's unit and the gradient / speed reference
        if required not in names:
            names.insert(0, required)
    return names


def check_args(args) -> dict[str, Any]:
    """The bench's configuration from parsed arguments; ``BenchError`` on a bad value."""
    if args.model is None:
        raise BenchError("--model is required (a preset or a local checkpoint directory), or "
                         "--report IN.json to print a saved report")
    if args.model not in PRESETS and not os.path.isdir(args.model):
        raise BenchError(f"--model {args.model}: unknown preset and not a directory; allowed: "
                         f"{', '.join(PRESETS)} or a local checkpoint directory")
    for flag, value, low in (("--seq-len", args.seq_len, 4), ("--micro-batch", args.micro_batch, 2),
                             ("--repeats", args.repeats, 1)):
        if value < low:
            raise BenchError(f"{flag} {value}: must be >= {low}")
    if args.micro_batch % 2:
        raise BenchError(f"--micro-batch {args.micro_batch}: must be even (GRPO groups of 2)")
    if args.layers is not None and args.layers < 1:
        raise BenchError(f"--layers {args.layers}: must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device here; allowed: cpu")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return {"model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "budgets": parse_budgets(args.budgets), "methods": parse_methods(args.methods),
            "repeats": args.repeats, "layers": args.layers, "full": bool(args.full),
            "dtype": args.dtype, "device": device, "lora_r": None if args.full else args.lora_r,
            "codec_backend": args.codec_backend, "seed": args.seed, "batches": 2,
            "ds_init": bool(getattr(args, "ds_init", False))}


# ---------------------------------------------------------------------------------- model, data
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


def _lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``ids[:, 1:]``, chunked over the vocabulary (no (B, T, V) logits)."""
    lm = _lm(model)
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


def make_batches(model, config) -> list[dict[str, torch.Tensor]]:
    """GRPO microbatches: groups of 2 with and without reward spread, masked responses of
    random length after a prompt of T/4, behaviour log-probs one update off-policy."""
    b, t, device = config["micro_batch"], config["seq_len"], config["device"]
    vocab = _lm(model).get_output_embeddings().weight.shape[0]
    out = []
    for k in range(config["batches"]):
        g = torch.Generator().manual_seed(config["seed"] + 100 + k)
        ids = torch.randint(0, vocab, (b, t), generator=g)
        prompt = t // 4
        lengths = torch.randint(max(1, t // 4), t - prompt, (b,), generator=g)
        pos = torch.arange(1, t)[None, :]
        mask = (pos >= prompt) & (pos < prompt + lengths[:, None])  # (B, T-1)
        rewards = (torch.rand(b, generator=g) < 0.5).float()
        rewards[:2] = torch.tensor([1.0, 0.0])  # a group with spread
        if b >= 4:
            rewards[-2:] = 1.0  # a uniform group: A = 0
        ids = ids.to(device)
        with torch.no_grad():
            logp = logprobs(model, ids).float()
        old = logp + 0.3 * torch.randn(logp.shape, generator=g).to(device)
        out.append({"input_ids": ids, "mask": mask.to(device), "old_logp": old,
                    "advantages": group_advantages(rewards, 2).to(device)})
    return out


# ---------------------------------------------------------------------------------- runs
@dataclasses.dataclass
class Run:
    method: str
    budget: float | None
    model: torch.nn.Module | None = None
    context: Context | None = None
    optimizer: Any = None
    skipped: str | None = None
    step_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s: list[float] = dataclasses.field(default_factory=list)
    profile_s: float = 0.0
    warmup_steps: int = 0
    peak_bytes: int | None = None
    activation_peak_bytes: int | None = None
    grad_errs: list[float] = dataclasses.field(default_factory=list)
    backward_flops: int | None = None
    stats: dict[str, Any] | None = None
    note: str | None = None
    copy_of: Run | None = None  # all_l: measured once, reported per budget
    calibration_seen: list = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget:g}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _forward_loss(model, data):
    torch.manual_seed(STEP_SEED)
    logp = logprobs(model, data["input_ids"]).float()
    return policy_loss(logp, data["old_logp"], data["advantages"], data["mask"],
                       loss_type="grpo", epsilon_high=0.28, model=model).loss


def step(run: Run, data, optimize: bool = True, flops: bool = False):
    """One actor update (forward, loss, backward, AdamW step) with the run's method on."""
    model = run.model
    model.zero_grad(set_to_none=True)
    with run.context.step():
        if flops:  # forward + backward under the counter (SAC's recompute must see the same ops)
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                _forward_loss(model, data).backward()
            run.backward_flops = int(counter.get_total_flops())
        else:
            _forward_loss(model, data).backward()
    if optimize:
        run.optimizer.step()
    if run.context.runtime is not None:
        run.context.runtime.end_step()


def _warm(run: Run) -> bool:
    runtime = run.context.runtime
    if not METHODS[run.method].policy or runtime is None or runtime.policy is None:
        return True
    policy = runtime.policy
    planned = bool(policy.buckets) and all(b.plan is not None and b.loo is None
                                           for b in policy.buckets.values())
    # calibration runs only where there is something to pack (a codec, L in the plan); it is
    # over when it reached its count or stopped advancing
    seen = run.calibration_seen
    run.calibration_seen = seen[-2:] + [policy.calibrated]
    calibrated = (runtime._codec is None
                  or policy.calibrated >= runtime.config.calibration_microbatches
                  or (len(seen) >= 3 and len(set(seen[-3:] + [policy.calibrated])) == 1))
    return planned and calibrated


def _progress(message: str) -> None:
    print(f"hilore bench: {message}", file=sys.stderr, flush=True)


def _new_run(method: str, budget, base, config, extra=None) -> Run:
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
        run.skipped, run.model = f"setup failed: {_first_line(error)}", None
        return run
    run.note = run.context.note
    params = [p for p in run.model.parameters() if p.requires_grad]
    run.optimizer = torch.optim.AdamW(params, lr=1e-5)
    return run


def _close(run: Run) -> None:
    if run.model is not None and run.context is not None:
        try:
            METHODS[run.method].teardown(run.model, run.context)
        except Exception as error:  # noqa: BLE001 -- the copy is dropped anyway
            _progress(f"{run.label}: teardown failed ({_first_line(error)})")
    run.model = run.context = run.optimizer = None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _measure_peak(run: Run, data, device: str) -> tuple[int, int]:
    from ds_hilore.runtime.memory import PeakMeter

    run.model.zero_grad(set_to_none=True)
    _sync(device)
    with PeakMeter(device) as meter:
        step(run, data)
        _sync(device)
    return meter.peak_bytes, meter.peak_delta


def _find_block_k(base, config, budget: float, gc_peak: int, data) -> tuple[int, list]:
    """Largest k (last k layers H, the rest R) whose measured peak fits budget x GC peak."""
    n = config["layers_n"]
    lo, hi, probes = 0, n, []
    while lo < hi:
        k = (lo + hi + 1) // 2
        run = _new_run("block_h", budget, base, config, {"block_k": k})
        if run.skipped:
            break
        try:
            step(run, data)
            peak, _ = _measure_peak(run, data, config["device"])
        finally:
            _close(run)
        probes.append((k, peak))
        if peak <= budget * gc_peak:
            lo = k
        else:
            hi = k - 1
    return lo, probes


def run_bench(config: dict[str, Any]) -> dict[str, Any]:
    """Everything the bench measures, as the JSON document (see the module docstring)."""
    device = config["device"]
    _progress(f"building {config['model']} ({config['dtype']}, {device}, "
              f"{'full fine-tuning' if config['full'] else 'LoRA r=' + str(config['lora_r'])})")
    base = build_model(config)
    layers = _lm(base).get_decoder().layers
    config["layers_n"] = len(layers)
    batches = make_batches(base, config)
    init = {n: p.detach().clone() for n, p in base.named_parameters() if p.requires_grad}
    tokens = config["micro_batch"] * config["seq_len"]

    # nogc / gc first: GC's peak is the unit of every budget
    runs: list[Run] = []
    fixed = [m for m in config["methods"] if not METHODS[m].budgeted]
    for name in fixed:
        runs.append(_new_run(name, None, base, config))
    gc_run = next(r for r in runs if r.method == "gc")
    if gc_run.skipped:
        raise RuntimeError(f"gc cannot run: {gc_run.skipped}")
    step(gc_run, batches[0])
    gc_peak, _ = _measure_peak(gc_run, batches[0], device)
    _progress(f"GC peak {gc_peak / MiB:.1f} MiB (whole process)")

    block_k: dict[float, tuple[int, list]] = {}
    for name in [m for m in config["methods"] if METHODS[m].budgeted]:
        shared = None
        for budget in config["budgets"]:
            if name == "all_l" and shared is not None:
                runs.append(Run(name, budget, copy_of=shared))
                continue
            extra = None
            if name == "block_h":
                if budget not in block_k:
                    _progress(f"block_h: finding k for budget {budget:g} by measuring")
                    block_k[budget] = _find_block_k(base, config, budget, gc_peak, batches[0])
                extra = {"block_k": block_k[budget][0]}
            run = _new_run(name, budget, base, config, extra)
            runs.append(run)
            shared = run if name == "all_l" else None

    live = [r for r in runs if not r.skipped and r.copy_of is None]
    # warm-up (HiLoRe: profiling, calibration, leave-one-out), one run at a time
    for run in live:
        begin = time.perf_counter()
        try:
            while True:
                step(run, batches[run.warmup_steps % len(batches)])
                run.warmup_steps += 1
                warm = _warm(run)
                if warm or run.warmup_steps >= MAX_WARMUP:
                    break
        except Exception as error:  # noqa: BLE001
            run.skipped = f"failed: {_first_line(error)}"
            _close(run)
            continue
        _sync(device)
        run.profile_s = time.perf_counter() - begin
        _progress(f"warm-up {run.label}: {run.warmup_steps} step(s), {run.profile_s:.2f} s"
                  + ("" if warm else " (HiLoRe still planning: stopped at the cap)"))
    live = [r for r in live if not r.skipped]

    # timed steps, round-robin
    for rep in range(config["repeats"]):
        _progress(f"round {rep + 1}/{config['repeats']}: one step of each of {len(live)} runs")
        for run in live:
            data = batches[rep % len(batches)]
            _sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            step(run, data)
            _sync(device)
            run.step_s.append(time.perf_counter() - t0)
            run.cpu_s.append(time.process_time() - c0)
            if run.context.runtime is not None:
                run.stats = run.context.runtime.stats

    # peak memory, separate pass
    _progress("peak memory pass")
    for run in live:
        run.peak_bytes, run.activation_peak_bytes = _measure_peak(run, batches[0], device)

    # gradients at the initial weights, every bench microbatch; FLOPs of the backward
    _progress("gradient and FLOP pass")
    grads: dict[str, list[dict[str, torch.Tensor]]] = {}
    for run in live:
        named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        run_grads = []
        for k, data in enumerate(batches):
            with torch.no_grad():
                for n, p in named:
                    p.copy_(init[n])
            step(run, data, optimize=False)
            run_grads.append({n: p.grad.detach().double().clone() for n, p in named
                              if p.grad is not None})
        grads[run.label] = run_grads
        try:
            step(run, batches[0], optimize=False, flops=True)
        except Exception as error:  # noqa: BLE001 -- the counter's dispatch mode can clash
            _progress(f"{run.label}: FLOPs not counted ({_first_line(error)})")
            run.backward_flops = None
        run.model.zero_grad(set_to_none=True)
    ref = grads.get("nogc")
    for run in live:
        if ref is None:
            break
        for g, r in zip(grads[run.label], ref):
            num = sum(((g[n] if n in g else torch.zeros_like(r[n])) - r[n]).pow(2).sum() for n in r)
            den = sum(r[n].pow(2).sum() for n in r)
            run.grad_errs.append(float(torch.sqrt(num / den)))
    nogc_flops = next((r.backward_flops for r in live if r.method == "nogc"), None)
    # the budgets' unit: GC's peak in the same pass, with every copy alive (same baseline)
    gc_probe_peak, gc_peak = gc_peak, gc_run.peak_bytes if gc_run.peak_bytes else gc_peak
    for run in runs:
        _close(run)
    from ds_hilore.bench.methods import end_group

    end_group()

    report = _report(config, runs, gc_peak, tokens, nogc_flops, block_k)
    report["config"]["gc_probe_peak_bytes"] = int(gc_probe_peak)  # block_h's k was found with it
    report["overlaps"] = [list(pair) for pair in overlaps(report)]
    report["efficiency"] = efficiency(report)
    report["targets"] = targets(report)
    return report


# ---------------------------------------------------------------------------------- report
def _host(config) -> dict[str, Any]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    host = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_avg_1m": load, "device": config["device"]}
    try:
        import transformers

        host["transformers"] = transformers.__version__
    except ImportError:
        pass
    if config["device"] == "cuda":
        host["gpu"] = torch.cuda.get_device_name()
    return host


def _row(run: Run, gc_peak: int, tokens: int, nogc_flops) -> dict[str, Any]:
    src = run.copy_of or run
    row: dict[str, Any] = {"method": run.method, "budget": run.budget}
    if src.skipped or not src.step_s:
        row.update({"tokens_per_s": None, "peak_bytes": None, "activation_peak_bytes": None,
                    "within_budget": None, "grad_err": None, "plan_mix": None, "gap_closed": None,
                    "cpu_s": None, "recomputed_flops": None,
                    "skipped": src.skipped or "no timed step"})
        return row
    tps = [tokens / s for s in src.step_s]
    stats = src.stats or {}
    row.update({
        "tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
        "peak_bytes": src.peak_bytes, "activation_peak_bytes": src.activation_peak_bytes,
        "within_budget": (None if run.budget is None else bool(src.peak_bytes <= run.budget * gc_peak)),
        "grad_err": ({"mean": statistics.fmean(src.grad_errs), "max": max(src.grad_errs)}
                     if src.grad_errs else None),
        "plan_mix": ({a: n for a, n in stats.get("actions", {}).items() if n} if src.stats else None),
        # per step: bytes held per action (L: packed, each unpacked once in the backward), codec time
        "held_bytes": ({a: n for a, n in stats.get("bytes", {}).items() if n} if src.stats else None),
        "pack_s": stats.get("pack_s") if src.stats else None,
        "unpack_s": stats.get("unpack_s") if src.stats else None,
        # the allocator's own view of its last step: its budget and peak, estimated error
        "allocator": ({k: stats.get(k) for k in ("budget_bytes", "peak_bytes", "grad_error_est",
                                                  "risk_budget")}
                      if src.stats and stats.get("budget_bytes") is not None else None),
        "gap_closed": None,  # filled from the medians below
        "cpu_s": {"median": statistics.median(src.cpu_s), "min": min(src.cpu_s), "max": max(src.cpu_s)},
        "recomputed_flops": (None if nogc_flops is None or src.backward_flops is None
                             else max(0, src.backward_flops - nogc_flops)),
        "skipped": None,
        "step_s": {"median": statistics.median(src.step_s), "min": min(src.step_s),
                   "max": max(src.step_s)},
        "profile_s": src.profile_s, "warmup_steps": src.warmup_steps,
    })
    if src.note:
        row["note"] = src.note
    if run.copy_of is not None:
        row["measured_once"] = True
    return row


def _report(config, runs, gc_peak, tokens, nogc_flops, block_k) -> dict[str, Any]:
    rows = [_row(r, gc_peak, tokens, nogc_flops) for r in runs]
    median = {(r["method"], r["budget"]): r["step_s"]["median"] for r in rows if r.get("step_s")}
    t_gc, t_nogc = median.get(("gc", None)), median.get(("nogc", None))
    for r in rows:
        if r.get("step_s") and t_gc is not None and t_nogc is not None and t_gc != t_nogc:
            r["gap_closed"] = (t_gc - r["step_s"]["median"]) / (t_gc - t_nogc)
    cfg = {k: v for k, v in config.items() if k != "layers_n"}
    cfg["layers_built"] = config["layers_n"]
    cfg["tokens_per_step"] = tokens
    cfg["block_h_k"] = {f"{b:g}": {"k": k, "probes": [{"k": pk, "peak_bytes": pp} for pk, pp in probes]}
                        for b, (k, probes) in block_k.items()}
    profile_s = sum(r.profile_s for r in runs if r.copy_of is None and METHODS[r.method].policy)
    return {"config": cfg, "host": _host(config), "gc_peak_bytes": int(gc_peak),
            "profile_s": float(profile_s), "runs": rows}


def main(config: dict[str, Any], json_path: str | None, plot_path: str | None) -> int:
    if config.get("threads"):
        torch.set_num_threads(config["threads"])
    from ds_hilore.bench.methods import end_group

    try:
        report = run_bench(config)
    finally:
        end_group()
    print(table(report))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
        _progress(f"wrote {json_path}")
    if plot_path:
        plot(report, plot_path)
        _progress(f"wrote {plot_path}")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--model", metavar="PRESET_OR_DIR", default=None,
                        help=f"a preset ({', '.join(PRESETS)}; random weights) or a local "
                             "checkpoint directory (never downloads)")
    parser.add_argument("--seq-len", metavar="N", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--micro-batch", metavar="B", type=int, default=4,
                        help="sequences per microbatch, even: GRPO groups of 2 (default 4)")
    parser.add_argument("--budgets", default="1.05,1.10,1.20",
                        help="memory budgets, multiples of GC's peak >= 1.0 (default 1.05,1.10,1.20)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default all; nogc and "
                             "gc are always run)")
    parser.add_argument("--repeats", metavar="K", type=int, default=7, help="timed steps per run (default 7)")
    parser.add_argument("--json", metavar="OUT.json", default=None, help="write the report as JSON")
    parser.add_argument("--plot", metavar="OUT.png", default=None, help="write the frontier plot (PNG)")
    parser.add_argument("--layers", metavar="L", type=int, default=None, help="cut the model to L decoder layers")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--lora-r", metavar="R", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights' dtype (default fp32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda if available")
    parser.add_argument("--codec-backend", choices=("compile", "eager"), default="compile",
                        help="HiLoRe's codec kernels (default compile)")
    parser.add_argument("--ds-init", action="store_true",
                        help="ds_ac: start a one-rank DeepSpeed group (gloo on CPU, nccl on CUDA) "
                             "when none is up; without it ds_ac is skipped then")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--report", metavar="IN.json", default=None,
                        help="print the table and targets of a saved report (with --plot: redraw "
                             "it) instead of running")
