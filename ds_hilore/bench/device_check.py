"""A device's check before a benchmark: exactness of H and R, and the peak against the budget.

    python -m ds_hilore.bench.device_check --device cuda --dtype bf16 --budget 1.10

1. Exactness: the gradient of one GRPO step (``ds_hilore.bench.data``) with HiLoRe forced to H
   everywhere and to R everywhere, against HF gradient checkpointing (``gc``) at the same
   weights, bitwise. A device whose kernels are not deterministic (GC against a second GC run
   not bitwise) is reported as such, and H and R must then be no further from GC than GC is
   from itself.
   Elision on the device (NOTE [ Stand-ins on accelerators ] in runtime/elision.py), H
   everywhere against GC on the same step: ``"whole"`` (the default on accelerators) on a step
   with a microbatch whose every sequence is zero, its layers' backward skipped -- a check;
   and, reported without failing, whether this device's kernels keep stand-ins exact: every
   zero sequence elided (``true``) in microbatches that keep others, and in that all-zero
   microbatch with its layers' backward run over the stand-ins.
2. Memory: HiLoRe at ``--budget`` after its warm-up, one metered step; its peak against the
   budget times GC's. On CUDA both ``max_memory_allocated`` and ``max_memory_reserved`` (the
   caching allocator's view: what the device really had to give), each against GC's own. The
   cache is emptied before each metered step, so a reserve is that step's own, not what earlier
   steps left cached (HiLoRe's warm-up runs other plans); what was cached then is reported too
   (``cached_before``), outside the check. GC is metered after HiLoRe's run: on CPU the peak
   is the process's heap, which keeps what compiling HiLoRe's codecs allocated (~24 MB on a
   two-layer model), and GC metered first would be measured without it.

Prints one line per check and a JSON document (``--json``); the exit status is 1 when any
check fails, so a shell script run with ``set -e`` stops loudly.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import sys
from typing import Any

import torch

from ds_hilore._errors import HiLoReError
from ds_hilore.bench import data, stats
from ds_hilore.bench.engines import LR, grpo_loss, sync, trainable
from ds_hilore.bench.methods import METHODS, hilore_block, prepare
from ds_hilore.bench.models import build_model, lm_of

__all__ = ["check", "main"]

MAX_WARMUP = 40
MICRO_BATCH, GROUP_SIZE, GRAD_ACCUM = 8, 4, 2


@dataclasses.dataclass
class _Copy:
    """A method switched on in its own copy of the model: the runtime alone, no DeepSpeed
    (what is checked is HiLoRe's exactness and memory on the device)."""

    model: torch.nn.Module
    runtime: Any
    optimizer: torch.optim.Optimizer


def _steps(base, args, group_size: int = GROUP_SIZE) -> list[list[dict]]:
    """One optimizer step of GRPO data (``ds_hilore.bench.data``, groups kept together), on
    the device."""
    shape = data.Shape(micro_batch=MICRO_BATCH, group_size=group_size, grad_accum=GRAD_ACCUM,
                       layout="grouped")
    vocab = lm_of(base).get_output_embeddings().weight.shape[0]
    step = data.global_step(shape, vocab, args.seq_len, seed=0, index=0)
    return [[{k: v.to(args.device) for k, v in m.items()} for m in step]]


def _step(run: _Copy, micro_batches, optimize: bool = True) -> None:
    """One optimizer step (accumulated over ``micro_batches``), each forward told its
    predicted exposure; ``optimize`` False: the gradients are left in ``.grad``."""
    run.model.zero_grad(set_to_none=True)
    prediction = data.prediction(micro_batches)
    for micro in micro_batches:
        if run.runtime is not None:
            run.runtime.expect(data.exposure(micro), *prediction)
        (grpo_loss(run.model, micro, run.model) / len(micro_batches)).backward()
    if optimize:
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
    if run.runtime is not None:
        run.runtime.end_step()


def _grads(run: _Copy, micro_batches) -> dict[str, torch.Tensor]:
    _step(run, micro_batches, optimize=False)
    return {n: p.grad.detach().clone() for n, p in run.model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _max_diff(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


@contextlib.contextmanager
def _opened(method: str, base, args, budget: float | None = None, **block):
    """``method`` on a copy of ``base`` (``block``: more keys of its "hilore" block), closed
    on the way out."""
    spec = METHODS[method]
    frozen = {id(p): p for p in base.parameters() if not p.requires_grad}
    model = copy.deepcopy(base, memo=frozen)  # LoRA: the frozen base weights are shared
    runtime = None
    if spec.engine == "hilore":
        from ds_hilore import attach

        runtime = attach(model, {**hilore_block(spec, budget=budget, tolerance=None,
                                                codec_backend=args.codec_backend), **block})
    else:
        prepare(spec, lm_of(model))
    try:
        yield _Copy(model, runtime, torch.optim.AdamW(trainable(model), lr=LR))
    finally:
        if runtime is not None:
            runtime.detach()


# all H through the layers' frames, as a budgeted plan stores (the method itself keeps what
# nogc keeps, without frames: NOTE [ A layer that keeps everything ] in runtime/calling.py)
_FRAMED = {"hilore_all_h": {"derive_pointwise": True, "elide_zero_rows": "auto"}}


def _exactness(base, args, steps) -> dict[str, Any]:
    grads = {}
    for method in ("gc", "hilore_all_h", "hilore_all_r"):
        with _opened(method, base, args, **_FRAMED.get(method, {})) as run:
            grads[method] = _grads(run, steps[0])
            if method == "gc":
                grads["gc_again"] = _grads(run, steps[0])
    noise = _max_diff(grads["gc"], grads["gc_again"])
    out = {"gc_vs_gc_max_abs": noise, "deterministic": noise == 0.0}
    for method in ("hilore_all_h", "hilore_all_r"):
        diff = _max_diff(grads[method], grads["gc"])
        out[method] = {"max_abs_vs_gc": diff, "ok": diff <= noise}
    return out


# (what, elide_zero_rows, layers' backward skipped when it can be, step, a check or a report)
ELISION = (("whole: a microbatch all zero", "whole", True, "one_group", True),
           ("true: zero sequences beside others", True, True, "mixed", False),
           ("true: a microbatch all zero, its backward run", True, False, "one_group", False))


def _elision(base, args, steps, noise: float) -> dict[str, Any]:
    """H everywhere under each setting of ``ELISION`` against GC on the same step."""
    steps_of = {"mixed": steps[0],  # groups of half a microbatch
                "one_group": _steps(base, args, group_size=MICRO_BATCH)[0]}
    refs, out = {}, {}
    for what, setting, skip, name, counted in ELISION:
        micro = steps_of[name]
        if name not in refs:
            with _opened("gc", base, args) as gc:
                refs[name] = _grads(gc, micro)
        try:
            with _opened("hilore_all_h", base, args,
                         **{**_FRAMED["hilore_all_h"], "elide_zero_rows": setting}) as run:
                runtime = run.runtime
                runtime.zero_backward_skip = skip
                _grads(run, micro)  # the discovery step
                diff = _max_diff(_grads(run, micro), refs[name])
                stats = runtime.stats
            entry = {"max_abs_vs_gc": diff, "ok": diff <= noise,
                     "elided_sequences": sum(m.get("exact_zero_sequences", 0)
                                             for m in stats["microbatches"]),
                     "backward_skipped": int(stats.get("backward_skipped", 0))}
        except HiLoReError as error:  # a leak caught by the runtime's checks
            entry = {"error": str(error).splitlines()[0][:300], "ok": False}
        out[what] = dict(entry, check=counted)
    return out


def _peaks(run: _Copy, micro_batches, device: str) -> tuple[dict[str, int], int | None]:
    """(the peak of one metered step: allocated, and on CUDA reserved; what was cached
    before it, CUDA only)."""
    from ds_hilore.runtime.memory import PeakMeter

    run.model.zero_grad(set_to_none=True)
    sync(device)
    cached = None
    if device == "cuda":
        cached = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()  # the step's own reserve (module docstring)
        torch.cuda.reset_peak_memory_stats()
    with PeakMeter(device) as meter:
        _step(run, micro_batches)
        sync(device)
    out = {"allocated": int(meter.peak_bytes)}
    if device == "cuda":
        out["reserved"] = int(torch.cuda.max_memory_reserved())
    return out, cached


def _warm_up(run: _Copy, micro_batches) -> None:
    """Steps until two in a row show no warm-up work in HiLoRe's stats (``stats.step_work``)."""
    before, steady = None, 0
    validates = run.runtime.config.plan_validation_microbatches > 0
    for _ in range(MAX_WARMUP):
        _step(run, micro_batches)
        after = run.runtime.stats
        steady = 0 if stats.step_work(before, after, validates) else steady + 1
        before = after
        if steady >= 2:
            return


def _memory(base, args, steps, budget: float) -> dict[str, Any]:
    device = args.device
    with _opened("hilore", base, args, budget) as run:
        if device == "cuda":  # profiled under no earlier peak of the checks above
            torch.cuda.reset_peak_memory_stats()
        _warm_up(run, steps[0])
        mine, cached = _peaks(run, steps[0], device)
        mix = dict(run.runtime.stats.get("actions", {}))
    with _opened("gc", base, args) as gc:  # second: the process then holds the same
        _step(gc, steps[0])
        gc_peaks, gc_cached = _peaks(gc, steps[0], device)
    out = {"budget": budget, "gc": gc_peaks, "hilore": mine, "plan_mix": mix}
    if cached is not None:
        out["cached_before"] = {"gc": int(gc_cached), "hilore": int(cached)}
    for kind in mine:
        ratio = mine[kind] / gc_peaks[kind]
        out[f"{kind}_ratio"] = ratio
        out[f"{kind}_ok"] = ratio <= budget
    return out


def _say(message: str) -> None:
    """What the check starts now (a check that hangs or is killed shows where)."""
    print(f"device check: {message}", file=sys.stderr, flush=True)


def check(args) -> dict[str, Any]:
    """Both checks (see the module docstring); ``ok`` says whether every one passed."""
    base = build_model("tiny", args.dtype, args.device, seed=0, layers=args.layers, lora_r=16)
    steps = _steps(base, args)
    _say("exactness: GC twice, H and R everywhere")
    exact = _exactness(base, args, steps)
    _say("elision: " + ", ".join(what for what, *_ in ELISION))
    exact["elision"] = _elision(base, args, steps, exact["gc_vs_gc_max_abs"])
    _say(f"memory: HiLoRe at {args.budget:g} after its warm-up, then GC")
    memory = _memory(base, args, steps, args.budget)
    ok = (all(exact[m]["ok"] for m in ("hilore_all_h", "hilore_all_r"))
          and all(e["ok"] for e in exact["elision"].values() if e["check"])
          and all(v for k, v in memory.items() if k.endswith("_ok")))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"device": device, "dtype": args.dtype, "torch": torch.__version__,
            "exactness": exact, "memory": memory, "ok": ok}


def _lines(result: dict[str, Any]) -> list[str]:
    exact, memory = result["exactness"], result["memory"]
    lines = [f"device check on {result['device']} ({result['dtype']}, torch {result['torch']}):",
             f"  GC vs a second GC run: max |diff| {exact['gc_vs_gc_max_abs']:.3g} "
             f"({'bitwise' if exact['deterministic'] else 'NOT deterministic on this device'})"]
    for method in ("hilore_all_h", "hilore_all_r"):
        e = exact[method]
        lines.append(f"  {method} vs GC: max |diff| {e['max_abs_vs_gc']:.3g} "
                     f"({'ok' if e['ok'] else 'FAILED'})")
    for what, e in exact["elision"].items():
        verdict = ("ok" if e["ok"] else "FAILED") if e["check"] else \
            ("exact" if e["ok"] else "not exact (reported, not a check)")
        found = e.get("error") or (f"max |diff| {e['max_abs_vs_gc']:.3g}, {e['elided_sequences']} "
                                   f"sequences elided, {e['backward_skipped']} backward skipped")
        lines.append(f"  elide_zero_rows {what}: {found} ({verdict})")
    for kind in ("allocated", "reserved"):
        if f"{kind}_ratio" in memory:
            lines.append(f"  hilore@{memory['budget']:g} peak {kind}: "
                         f"{memory['hilore'][kind] / 2**20:.1f} MiB = {memory[f'{kind}_ratio']:.3f}x "
                         f"GC's {memory['gc'][kind] / 2**20:.1f} MiB "
                         f"({'ok' if memory[f'{kind}_ok'] else 'OVER THE BUDGET'})")
    if "cached_before" in memory:
        lines.append("  reserved before the metered step (left by earlier steps, emptied): "
                     + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in
                                 memory["cached_before"].items()))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_hilore.bench.device_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--budget", type=float, default=1.10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--codec-backend", choices=("compile", "eager"), default="compile")
    parser.add_argument("--json", default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here; allowed: cpu", file=sys.stderr)
        return 2
    result = check(args)
    print("\n".join(_lines(result)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
