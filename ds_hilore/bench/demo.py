"""``python -m ds_hilore.bench.demo``: HiLoRe next to no checkpointing and HF gradient checkpointing.

On a small Qwen2-shaped causal LM with random weights (or a local checkpoint, ``--model PATH``;
nothing is ever downloaded) with LoRA adapters on every linear layer, each method of ``METHODS``
runs the same GRPO microbatch -- chunked token log-probs (``ds_hilore.grpo.token_logprobs``) into
``ds_hilore.grpo.policy_loss``, one update off-policy -- and the demo reports per method:

* median forward+backward time of the timed steps (after warm-up), relative to HF GC;
* peak memory above the weights, measured in a separate pass with ``memory.PeakMeter``;
* retained bytes per action from ``runtime.stats`` and the number of recomputed units;
* the relative gradient error ‖g − g_exact‖ / ‖g_exact‖ over the trainable parameters against
  no checkpointing. Exact methods (GC, H, R and their mixes) must match bitwise; the demo exits
  with status 1 when one does not, so it doubles as a smoke check.

Every step seeds the RNG the same way, so LoRA dropout draws the same masks in every method.
CPU numbers are what they are: a method can be slower than GC here (int8 packing and unpacking
are extra memory-bound passes, which on a CPU can cost more than recomputing a small layer), and
on a machine that other jobs keep busy, wall times are noisy (the header prints the load).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
import warnings
from typing import Any, Iterator, Mapping, Sequence

import torch

from ds_hilore.config import HiLoReConfig
from ds_hilore.grpo import PolicyLoss, group_advantages, policy_loss, token_logprobs
from ds_hilore.runtime import HiLoReRuntime, attach
from ds_hilore.runtime.codecs import codec_from_config
from ds_hilore.runtime.memory import PeakMeter

__all__ = ["METHODS", "PRESETS", "DemoPreset", "Method", "main"]

MiB = 1 << 20
STEP_SEED = 1234  # reseeded before every step: same dropout masks in every method


@dataclasses.dataclass(frozen=True)
class DemoPreset:
    """Model and batch shape, step counts and codec backend of one demo run."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int  # tokens per sequence (prompt + completion)
    batch: int  # sequences per microbatch
    group: int  # completions per prompt (GRPO group); must divide batch
    lora_r: int
    warmup: int  # untimed steps per method
    steps: int  # timed steps per method
    codec_backend: str = "compile"  # of the L codec: "compile" (eager fallback) or "eager"


PRESETS: Mapping[str, DemoPreset] = {
    "full": DemoPreset(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=8192,
                      seq=256, batch=4, group=2, lora_r=16, warmup=1, steps=3),
    "quick": DemoPreset(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512,
                       seq=64, batch=4, group=2, lora_r=4, warmup=0, steps=1,
                         codec_backend="eager"),
}


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of keeping activations for backward (one row per variant)."""

    name: str
    hf_gc: bool = False  # transformers' gradient checkpointing (non-reentrant)
    force_plan: str | dict[str, str] | None = None  # HiLoRe's plan; None: HiLoRe not attached
    exact: bool = True  # gradient must equal no checkpointing bitwise


METHODS: tuple[Method, ...] = (
    Method("no checkpointing"),
    Method("HF grad. ckpt (GC)", hf_gc=True),
    Method("HiLoRe all-R", force_plan="R"),
    Method("HiLoRe all-H", force_plan="H"),
    Method("HiLoRe attn-H/mlp-R", force_plan={"*.attn": "H", "*.mlp": "R"}),
    Method("HiLoRe all-L (int8)", force_plan="L", exact=False),
)
REFERENCE, BASELINE = METHODS[0].name, METHODS[1].name  # gradient reference, time/memory unit


@dataclasses.dataclass
class Result:
    """What one method measured."""

    method: Method
    step_s: list[float]  # seconds per timed step
    peak_bytes: int  # bytes above what was in use before the step
    grads: dict[str, torch.Tensor]
    stats: dict[str, Any] | None  # runtime.stats of the last step (HiLoRe only)
    grad_error: float = float("nan")
    bitwise: bool = False


# ---------------------------------------------------------------------------------- setup
def build_model(preset: DemoPreset, path: str | None = None, seed: int = 0) -> torch.nn.Module:
    """A Qwen2-shaped causal LM (random weights, or ``path`` loaded offline) with LoRA, fp32."""
    import peft
    import transformers

    torch.manual_seed(seed)
    if path is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32)
    else:
        config = transformers.Qwen2Config(
            vocab_size=preset.vocab, hidden_size=preset.hidden, num_hidden_layers=preset.layers,
            num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
            intermediate_size=preset.intermediate, max_position_embeddings=max(preset.seq, 512),
            tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    lora = peft.LoraConfig(r=preset.lora_r, lora_alpha=2 * preset.lora_r, lora_dropout=0.05,
                           target_modules="all-linear")
    with warnings.catch_warnings():  # peft reads transformers' deprecated alias; harmless
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        model = peft.get_peft_model(model, lora)
    for name, p in model.named_parameters():  # non-zero B: every adapter carries gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.train()
    return model


def make_batch(model: torch.nn.Module, preset: DemoPreset, seed: int = 0) -> dict[str, torch.Tensor]:
    """One GRPO microbatch: token ids, completion mask, advantages, behaviour log-probs.

    Prompts fill the first quarter of each sequence, completions have random lengths. Rewards
    are 0/1 per group; the last group is uniform (all solved), so its advantages are exactly 0
    and its sequences' coefficients vanish. ``old_logp`` is the policy's own
    log-probs plus noise: one update off-policy, so some tokens leave the clip range.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (preset.batch, preset.seq), generator=g)  # (B, T)
    prompt = preset.seq // 4
    lengths = torch.randint(preset.seq // 4, preset.seq - prompt, (preset.batch,), generator=g)
    pos = torch.arange(1, preset.seq)[None, :]  # (1, T-1) position of each target token
    mask = (pos >= prompt) & (pos < prompt + lengths[:, None])  # (B, T-1)
    rewards = (torch.rand(preset.batch, generator=g) < 0.5).float()  # (B,) 0/1
    rewards[: preset.group] = torch.tensor([1.0, 0.0]).repeat(preset.group)[: preset.group]
    rewards[-preset.group:] = 1.0  # a uniform group: A = 0
    with torch.no_grad():
        logp = _logprobs(model, ids)  # (B, T-1) fp32
    old = logp + 0.3 * torch.randn(logp.shape, generator=g)  # (B, T-1)
    return {"input_ids": ids, "mask": mask, "old_logp": old,
            "advantages": group_advantages(rewards, preset.group)}


def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``ids[:, 1:]`` from the last hidden state, chunked (no (B, T, V) logits)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, H)
    return token_logprobs(hidden[:, :-1], lm.get_output_embeddings(), ids[:, 1:])  # (B, T-1)


def grpo_step(model: torch.nn.Module, data: Mapping[str, torch.Tensor]) -> PolicyLoss:
    """Forward, GRPO loss (which hands ω to an attached runtime) and backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(STEP_SEED)
    logp = _logprobs(model, data["input_ids"])  # (B, T-1)
    out = policy_loss(logp, data["old_logp"], data["advantages"], data["mask"],
                      loss_type="grpo", epsilon_high=0.28, model=model)
    out.loss.backward()
    return out


# ---------------------------------------------------------------------------------- run
@contextlib.contextmanager
def activated(model: torch.nn.Module, method: Method,
              codec_backend: str = "compile") -> Iterator[HiLoReRuntime | None]:
    """The model with ``method``'s activation handling switched on; restored afterwards."""
    if method.hf_gc:
        with _hf_checkpointing(model):
            yield None
    elif method.force_plan is not None:
        runtime = attach(model, hilore_config(method, codec_backend))
        try:
            yield runtime
        finally:
            runtime.detach()
    else:
        yield None


@contextlib.contextmanager
def _hf_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """transformers' own (non-reentrant) gradient checkpointing, then the model as it was."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    enable, disable = _hf_checkpointing_switches(lm)
    had_input_grads = bool(getattr(lm, "_require_grads_hooks", None))
    enable({"use_reentrant": False})
    try:
        yield
    finally:
        disable()
        # NOTE [ Input grads after GC ]: enabling also calls enable_input_require_grads(), which
        # transformers 5.x's disable leaves in place (it removes it only for its own peft
        # integration); later methods would then see a layer-0 input that requires grad and
        # save more tensors than the no-checkpointing run did.
        if not had_input_grads and getattr(lm, "_require_grads_hooks", None):
            lm.disable_input_require_grads()


def _hf_checkpointing_switches(lm: torch.nn.Module):
    """transformers' checkpointing on/off; ``activation_*`` names from 5.x, older names before."""
    if hasattr(lm, "activation_checkpointing_enable"):
        return (lambda kw: lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kw),
                lm.activation_checkpointing_disable)
    return (lambda kw: lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw),
            lm.gradient_checkpointing_disable)


def hilore_config(method: Method, codec_backend: str = "compile") -> HiLoReConfig:
    return HiLoReConfig(force_plan=method.force_plan, low_precision="int8",
                        codec_backend=codec_backend)


def timed_step(model: torch.nn.Module, data, method: Method, preset: DemoPreset) -> float:
    """Seconds of one forward+backward with ``method`` switched on."""
    with activated(model, method, preset.codec_backend):
        start = time.perf_counter()
        grpo_step(model, data)
        elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def inspect(model: torch.nn.Module, data, method: Method, preset: DemoPreset,
            step_s: list[float]) -> Result:
    """Gradients and runtime stats of one step, then one step under ``PeakMeter`` (its
    dispatch mode slows ops, so it is never timed)."""
    with activated(model, method, preset.codec_backend) as runtime:
        grpo_step(model, data)
        grads = _trainable_grads(model)
        if runtime is not None:
            runtime.end_step()
        stats = runtime.stats if runtime is not None else None
        model.zero_grad(set_to_none=True)
        with PeakMeter("cpu") as meter:
            grpo_step(model, data)
        model.zero_grad(set_to_none=True)
    return Result(method, step_s, meter.peak_delta, grads, stats)


def _trainable_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def compare(results: list[Result]) -> None:
    """Fill each result's gradient error against the reference method (no checkpointing)."""
    ref = next(r for r in results if r.method.name == REFERENCE).grads
    ref_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref.values()))
    for r in results:
        if r.grads.keys() != ref.keys():
            r.grad_error, r.bitwise = float("inf"), False
            continue
        diff = torch.sqrt(sum((r.grads[n].double() - ref[n].double()).pow(2).sum() for n in ref))
        r.grad_error = float(diff / ref_norm)
        r.bitwise = all(torch.equal(r.grads[n], ref[n]) for n in ref)


def run(model: torch.nn.Module, data, preset: DemoPreset,
        methods: Sequence[Method] = METHODS) -> list[Result]:
    """Measure every method on the same batch; progress lines go to stdout.

    Timed steps go round-robin over the methods (warm-up rounds first), so that a noisy
    machine slows every method alike and the ratios to GC stay meaningful.
    """
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    rounds = preset.warmup + preset.steps
    for r in range(rounds):
        kind = "warm-up" if r < preset.warmup else "timed"
        print(f"[round {r + 1}/{rounds}, {kind}] one step of each method ...", flush=True)
        for method in methods:
            elapsed = timed_step(model, data, method, preset)
            if r >= preset.warmup:
                times[method.name].append(elapsed)
    results = []
    for i, method in enumerate(methods, 1):
        print(f"[{i}/{len(methods)}] {method.name}: gradients, stats and a peak-memory pass ...",
              flush=True)
        results.append(inspect(model, data, method, preset, times[method.name]))
    compare(results)
    return results


# ---------------------------------------------------------------------------------- report
def describe(model: torch.nn.Module, data, preset: DemoPreset, source: str) -> None:
    """What is being measured: model, batch, GRPO coefficient concentration, codec."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    cfg = model.get_base_model().config
    print(f"model: {source}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}; LoRA r={preset.lora_r} on all linear layers: "
          f"{trainable:,} trainable of {total:,} parameters; fp32, CPU")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host: {os.cpu_count()} CPUs, torch uses {torch.get_num_threads()} threads, load "
          f"average {load:.1f}" + (" -- other jobs are running: step times are noisy"
                                   if load > 0.5 * (os.cpu_count() or 1) else ""))
    b, t = data["input_ids"].shape
    print(f"batch: {b} sequences x {t} tokens, {int(data['mask'].sum())} completion tokens, "
          f"GRPO groups of {preset.group}, loss_type grpo, one update off-policy")
    with torch.no_grad():
        logp = _logprobs(model, data["input_ids"])
        m = policy_loss(logp, data["old_logp"], data["advantages"], data["mask"],
                        loss_type="grpo", epsilon_high=0.28).metrics
    zero_rows = int((data["advantages"] == 0).sum())
    print(f"coefficients ω = dL/dlogp: {zero_rows}/{b} sequences have A = 0 (ω ≡ 0: HiLoRe "
          f"elides their H/L slices), {m['zero_fraction']:.1%} of completion tokens have ω = 0 "
          f"(clipped: {m['clip_fraction_low']:.1%} low, {m['clip_fraction_high']:.1%} high), "
          f"the top 10 % of tokens carry {m['top10_share']:.1%} of Σ|ω|")


def warm_codec(codec_backend: str) -> str:
    """Compile the L codec before timing; says whether the compiled or eager kernels run."""
    codec = codec_from_config(hilore_config(METHODS[-1], codec_backend))
    start = time.perf_counter()
    codec.warmup()
    failures = [k.failure for k in codec.spec.kernels() if k.failure]
    how = (f"eager fallback ({failures[0]})" if failures else
           "torch.compile" if codec_backend == "compile" else "eager")
    return f"codec int8: {how}, ready in {time.perf_counter() - start:.1f} s"


def report(results: list[Result]) -> int:
    """Print the table; returns the exit status (1 if an exact method is not bitwise exact)."""
    base = next(r for r in results if r.method.name == BASELINE)
    header = (f"{'method':<22} {'step s':>7} {'x GC':>5} | {'peak MiB':>8} {'x GC':>5} | "
              f"{'mix':>6} {'H MiB':>6} {'L MiB':>6} {'recomp':>6} {'codec s':>7} | "
              f"{'grad rel err':>12}  exact?")
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        print(_row(r, statistics.median(base.step_s), base.peak_bytes))
    print("step s: median wall time of fwd+bwd over the timed steps; peak MiB: peak above the "
          "weights, in a separate pass; mix: unit actions; H/L MiB: activations kept per action "
          "once the loss is known (layer inputs, kept by every method, not counted); recomp: "
          "units recomputed in backward; codec s: pack + unpack time of the last step; grad rel "
          "err: ||g - g_exact|| / ||g_exact|| over trainable parameters vs no checkpointing.")
    failed = [r.method.name for r in results if r.method.exact and not r.bitwise]
    if failed:
        print(f"FAILED: exact methods whose gradient differs from no checkpointing: {failed}")
        return 1
    return 0


def _row(r: Result, base_s: float, base_bytes: int) -> str:
    t = statistics.median(r.step_s)
    st = r.stats or {}
    mix = "".join(f"{n}{a}" for a, n in st.get("actions", {}).items() if n) or "-"
    held = st.get("bytes", {})
    rc = st.get("recomputed_units", "-")
    codec_s = f"{st['pack_s'] + st['unpack_s']:.3f}" if st else "-"
    verdict = ("bitwise" if r.bitwise else "NOT BITWISE") if r.method.exact else "lossy"
    return (f"{r.method.name:<22} {t:>7.3f} {t / base_s:>5.2f} | {r.peak_bytes / MiB:>8.1f} "
            f"{r.peak_bytes / base_bytes:>5.2f} | {mix:>6} {_mib(held.get('H')):>6} "
            f"{_mib(held.get('L')):>6} {rc:>6} {codec_s:>7} | {r.grad_error:>12.3e}  {verdict}")


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.2f}"


# ---------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ds_hilore.bench.demo",
                                     description=__doc__.splitlines()[0].split(": ", 1)[-1])
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared with ``hilore demo``)."""
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="local checkpoint directory to load with from_pretrained instead of "
                             "the built-in random Qwen2-shaped model (never downloads)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, one timed step, eager int8 codec (a smoke check: no compile "
                             "time)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per method")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); 1 gives steadier "
                             "timings on a machine that other jobs keep busy")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    preset, model, data = setup(args)
    return report(run(model, data, preset))


def setup(args: argparse.Namespace):
    """Sizes, model and batch from the command line; prints what will be measured."""
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    preset = PRESETS["quick" if args.quick else "full"]
    if args.steps is not None:
        preset = dataclasses.replace(preset, steps=max(1, args.steps))
    model = build_model(preset, args.model)
    data = make_batch(model, preset)
    describe(model, data, preset, args.model or "random Qwen2-shaped")
    print(warm_codec(preset.codec_backend), flush=True)
    return preset, model, data


if __name__ == "__main__":
    sys.exit(main())
