"""``hilore bench``: throughput, memory and gradient error of every activation method (a frontier).

For each method of ``ds_hilore.bench.methods.METHODS`` (budgeted ones once per memory budget)
on its own copy of the same initial model, the bench runs the GRPO actor update on GRPO-shaped
steps (``ds_hilore.bench.data``: groups of ``--group-size``, ``--grad-accum`` microbatches of
``--micro-batch`` sequences per step, a share of A = 0 groups, clipped tokens, varied response
lengths; ``--drop-zero-advantage``: the filtered variant), in this order:

1. warm-up, one run at a time (HiLoRe: profiling, calibration, leave-one-out; ``profile_s``);
2. the peak memory of one step (``PeakMeter``, an op-level tracker on CPU);
3. the step's accumulated gradient at the initial weights against no checkpointing, on every
   bench step (and per microbatch), and the FLOPs of one step (``FlopCounterMode``);
4. paired rounds (``--rounds N`` or ``auto``): each round runs every run once, back to back, on
   the same step's microbatches, the order rotating by one from round to round; each sample
   (wall and process CPU seconds) is kept in ``rounds``. ``auto`` adds rounds until the
   decisive comparisons (``ds_hilore.bench.targets.decisive``) are decided, or ``--max-minutes``
   would be passed by one more round.

``--max-minutes`` bounds the whole bench, not only its rounds (NOTE [ The bench's minutes ]).
An interrupt (SIGINT, as ``timeout`` sends) in any phase ends the bench with the report of what
was measured so far, ``stop.phase`` naming where it stopped.

The report: ``config``, ``host``, ``gc_peak_bytes``, ``profile_s``, ``regime`` (the shape's
ratios: no-GC's peak over GC's, GC's recompute share of its update's FLOPs, sequences per
microbatch), ``rounds`` (raw samples), ``runs`` (one row per run, ``ds_hilore.bench.summary``),
``comparisons`` (every pair of runs, paired ratio and 95 % interval, ``ds_hilore.bench.paired``),
``targets`` (HiLoRe's verdict per budget, with ``undecided``), ``efficiency`` and ``stop`` (why
the rounds ended).

Memory: ``peak_bytes`` is the whole process (CPU: mallinfo2 + mmap'd, as HiLoRe measures its
own budget; CUDA: max_memory_allocated) while every run's model copy is alive, so it is the same
baseline for every run; ``activation_peak_bytes`` is the peak above what was in use at the start
of the step. With LoRA the copies share the frozen base weights.

``ds_ac`` needs DeepSpeed's communication backend: when none is up it is skipped, unless
``--ds-init``: then the bench starts a one-rank group (gloo on CPU, nccl on CUDA, a free local
port) and ends it when done. ``all_l``'s plan does not depend on the budget: it is measured once,
and the row is repeated per budget (``measured_once``). HiLoRe's own budget is relative to the
GC peak it measures while profiling; ``within_budget`` uses the bench's GC peak.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from ds_hilore.bench import summary
from ds_hilore.bench.data import GrpoShape, attach_behaviour, grpo_steps
from ds_hilore.bench.methods import METHODS, end_group
from ds_hilore.bench.options import (DEFAULT_METHODS, MAX_ROUNDS, PRESETS, BenchError,
                                     add_arguments, check_args, parse_budgets)
from ds_hilore.bench.paired import MIN_ROUNDS
from ds_hilore.bench.report import plot, table
from ds_hilore.bench.runs import (Run, build_model, close, collect, first_line, fresh_peak, lm_of,
                                  logprobs, measure_peak, new_run, progress, step, sync, warm)
from ds_hilore.bench.targets import decisive

__all__ = ["DEFAULT_METHODS", "PRESETS", "BenchError", "add_arguments", "check_args",
           "make_steps", "parse_budgets", "run_bench"]

MiB = 1 << 20
MAX_WARMUP = 40  # steps of HiLoRe warm-up at most (profile + calibration + LOO)
AUTO_MINUTES = 30.0  # --rounds auto without --max-minutes


def shape_of(config: dict[str, Any]) -> GrpoShape:
    return GrpoShape(**{f: config[f] for f in ("micro_batch", "seq_len", "group_size", "grad_accum",
                                               "zero_adv_share", "clip_share",
                                               "drop_zero_advantage")})


def make_steps(model, config) -> list[list[dict[str, torch.Tensor]]]:
    """The bench's steps (``ds_hilore.bench.data.grpo_steps``) with behaviour log-probs."""
    vocab = lm_of(model).get_output_embeddings().weight.shape[0]
    steps = grpo_steps(shape_of(config), vocab, config["batches"], config["seed"])
    if not all(steps):
        raise BenchError("--drop-zero-advantage with --zero-adv-share 1: no completion is left "
                         "to train on; allowed: --zero-adv-share below 1")
    return attach_behaviour(steps, lambda ids: logprobs(model, ids), config["device"])


# ---------------------------------------------------------------------------------- phases
# NOTE [ block_h's k, measured against GC in the same memory ]
# A peak is the whole process's, so it holds every run alive at the time. The runs made after
# GC's first reading (the budgeted ones, and each probe's own copy and optimizer state) raise
# every later peak, block_h's probes included; compared with that first reading, a probe that
# fits looked over budget (paper-cpu at 1.10: k = 0, where k = 2 fits against GC measured
# beside it). So each probe is compared with GC's peak read again while the probe is alive.
# Runs made after the search only raise both peaks alike, so a k found here still fits.
def _find_block_k(base, config, budget: float, gc_run: Run, data) -> tuple[int, list]:
    """Largest k (last k layers H, the rest R) whose measured peak fits budget x GC's peak,
    both read with the probe alive; the probes as (k, peak, GC's peak beside it)."""
    lo, hi, probes = 0, config["layers_n"], []
    while lo < hi:
        k = (lo + hi + 1) // 2
        run = new_run("block_h", budget, base, config, {"block_k": k})
        if run.skipped:
            break
        try:
            step(run, data)
            gc_peak, _ = measure_peak(gc_run, data, config["device"])
            peak, _ = measure_peak(run, data, config["device"])
        finally:
            close(run)
        probes.append((k, peak, gc_peak))
        if peak <= budget * gc_peak:
            lo = k
        else:
            hi = k - 1
    return lo, probes


def _setup_runs(base, config, steps, state=None) -> tuple[list[Run], int, dict]:
    """Every run (nogc / gc first: GC's peak is the unit of every budget); GC's probe peak.
    ``state["runs"]`` holds every run as it is made (closed should the bench be ended)."""
    runs = [new_run(m, None, base, config) for m in config["methods"] if not METHODS[m].budgeted]
    if state is not None:
        state["runs"] = runs
    gc_run = next(r for r in runs if r.method == "gc")
    if gc_run.skipped:
        raise RuntimeError(f"gc cannot run: {gc_run.skipped}")
    step(gc_run, steps[0])
    gc_peak, _ = measure_peak(gc_run, steps[0], config["device"])
    progress(f"GC peak {gc_peak / MiB:.1f} MiB (whole process)")
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
                    progress(f"block_h: finding k for budget {budget:g} by measuring")
                    block_k[budget] = _find_block_k(base, config, budget, gc_run, steps[0])
                extra = {"block_k": block_k[budget][0]}
            runs.append(new_run(name, budget, base, config, extra))
            shared = runs[-1] if name == "all_l" else None
    return runs, gc_peak, block_k


# NOTE [ The bench's minutes ]
# ``--max-minutes`` is the whole bench's time: a one-shot run (a GPU lent for minutes) must end
# with a verdict, and the warm-up (HiLoRe's profiling, calibration and leave-one-out, run by run)
# can take most of it. So before each warm-up step the bench asks whether the time left still
# holds what must follow for the runs warmed so far: the peak and gradient passes (about
# ``batches`` + 3 steps of each) and MIN_ROUNDS paired rounds, a run's step priced at its
# latest warm-up step. When it does not, the runs the decisive comparisons need
# (``ESSENTIAL``: the references and the two HiLoRe allocators, warmed first) finish their
# warm-up, marked ``warmed: false`` should they stop at the cap, and every other run not yet
# warmed is dropped, its row saying why: fewer runs make shorter rounds, so more of them fit.
ESSENTIAL = ("nogc", "gc", "hilore", "static")


class Clock:
    """The bench's time: ``limit_s`` (None: unbounded) from its making; ``step_s`` holds each
    warmed run's latest warm-up step (seconds), the price of its steps to come."""

    def __init__(self, minutes: float | None):
        self.begin = time.perf_counter()
        self.limit_s = None if minutes is None else 60.0 * minutes
        self.step_s: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.begin

    def short(self, batches: int) -> bool:
        """The time left no longer holds the passes and MIN_ROUNDS rounds of the runs priced
        so far."""
        if self.limit_s is None:
            return False
        round_s = sum(self.step_s.values())
        return self.elapsed() + (batches + 3 + MIN_ROUNDS) * round_s > self.limit_s


def _warm_up(live: list[Run], steps, device: str, strict: bool, clock: Clock,
             batches: int) -> None:
    """Each run warmed up, the ``ESSENTIAL`` ones first; runs the time left on ``clock`` cannot
    hold are dropped (NOTE [ The bench's minutes ])."""
    for run in sorted(live, key=lambda r: r.method not in ESSENTIAL):
        essential = run.method in ESSENTIAL
        if not essential and clock.short(batches):
            _drop(run, clock)
            continue
        collect()  # NOTE [ One baseline for every run ] (runs.py)
        fresh_peak(device)
        begin, done = time.perf_counter(), False
        try:
            while not done and run.warmup_steps < MAX_WARMUP:
                t0 = time.perf_counter()
                step(run, steps[run.warmup_steps % len(steps)])
                sync(device)
                clock.step_s[run.label] = time.perf_counter() - t0
                run.warmup_steps += 1
                done = warm(run)
                if not done and not essential and clock.short(batches):
                    break
        except Exception as error:  # noqa: BLE001 -- the run is reported as failed
            if strict:
                raise
            run.skipped = f"failed: {first_line(error)}"
            clock.step_s.pop(run.label, None)
            close(run)
            continue
        if not done and not essential and run.warmup_steps < MAX_WARMUP:
            _drop(run, clock)
            continue
        run.profile_s, run.warmed = time.perf_counter() - begin, done
        progress(f"warm-up {run.label}: {run.warmup_steps} step(s), {run.profile_s:.2f} s"
                 + ("" if done else " (HiLoRe still planning: stopped at the cap)"))


def _drop(run: Run, clock: Clock) -> None:
    minutes = clock.limit_s / 60.0
    run.skipped = (f"not warmed up: --max-minutes {minutes:g} left no time for it after the "
                   f"runs the decisive comparisons need ({clock.elapsed() / 60.0:.1f} min used)")
    progress(f"{run.label}: {run.skipped}")
    clock.step_s.pop(run.label, None)
    close(run)


def _gradients(live: list[Run], steps, init, strict: bool = False) -> None:
    """Per run: the relative error of each step's accumulated gradient (and of each
    microbatch's, from the differences of the accumulated ones) against nogc's; one step's
    FLOPs."""
    reference: list[list[dict]] = []
    for run in sorted(live, key=lambda r: r.method != "nogc"):  # the reference first
        named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        for k, micro_batches in enumerate(steps):
            with torch.no_grad():
                for n, p in named:
                    p.copy_(init[n])
            cumulative: list[dict] = []
            step(run, micro_batches, optimize=False, after_each=lambda i: cumulative.append(
                {n: p.grad.detach().double().clone() for n, p in named if p.grad is not None}))
            if run.method == "nogc":
                reference.append(cumulative)
            elif reference:
                ref = reference[k]
                run.grad_errs.append(_rel_err(cumulative[-1], ref[-1]))
                for i in range(len(cumulative)):
                    run.grad_errs_micro.append(_rel_err(_diff(cumulative, i), _diff(ref, i)))
        if run.method == "nogc":
            run.grad_errs = [0.0] * len(steps)
            run.grad_errs_micro = [0.0] * sum(len(s) for s in steps)
        try:
            step(run, steps[0], optimize=False, flops=True)
        except Exception as error:  # noqa: BLE001 -- the counter's dispatch mode can clash
            if strict:
                raise
            progress(f"{run.label}: FLOPs not counted ({first_line(error)})")
            run.microbatch_flops = None
        run.model.zero_grad(set_to_none=True)


def _diff(cumulative: list[dict], i: int) -> dict:
    if i == 0:
        return cumulative[0]
    return {n: g - cumulative[i - 1].get(n, 0) for n, g in cumulative[i].items()}


def _rel_err(g: dict, r: dict) -> float:
    num = sum(((g[n] if n in g else torch.zeros_like(r[n])) - r[n]).pow(2).sum() for n in r)
    den = sum(r[n].pow(2).sum() for n in r)
    return float(torch.sqrt(num / den)) if float(den) > 0 else 0.0


def _one_round(live: list[Run], index: int, data, step_index: int) -> dict[str, Any]:
    shift = index % len(live)
    order = live[shift:] + live[:shift]  # rotating: no run always first or last
    record = {"round": index, "step": step_index, "order": [r.label for r in order],
              "wall_s": {}, "cpu_s": {}}
    for run in order:
        sync_device = "cuda" if next(run.model.parameters()).is_cuda else "cpu"
        sync(sync_device)
        c0, t0 = time.process_time(), time.perf_counter()
        step(run, data)
        sync(sync_device)
        record["wall_s"][run.label] = run.wall_s[index] = time.perf_counter() - t0
        record["cpu_s"][run.label] = run.cpu_s[index] = time.process_time() - c0
        if run.context.runtime is not None:
            run.stats = run.context.runtime.stats
            run.plans = bucket_plans(run.context.runtime)
    return record


def bucket_plans(runtime) -> dict[str, dict[str, str]] | None:
    """The allocator's plan of every shape bucket, "BxT" -> unit -> action (what a step's mix
    counts, unit by unit); None without an allocator."""
    policy = getattr(runtime, "policy", None)
    if policy is None:
        return None
    return {"x".join(map(str, key)): dict(bucket.plan.actions)
            for key, bucket in policy.buckets.items() if bucket.plan is not None}


def _rounds(live, steps, config, clock: Clock, provisional,
            saved=None) -> tuple[list[dict], dict]:
    """Paired rounds, fixed or until decided (``auto``); the records and why they stopped,
    with the decisive comparisons left undecided. ``saved(report)`` after each round (the
    report so far, kept should the process be ended); an interrupt (SIGINT, as ``timeout``
    sends) ends the rounds, and the ones completed are reported."""
    auto = config["rounds"] == "auto"
    target = MAX_ROUNDS if auto else config["rounds"]
    records: list[dict] = []
    reason = "rounds"
    while len(records) < target:
        per_round = (sum(sum(r["wall_s"].values()) for r in records) / len(records)) if records else 0
        if clock.limit_s is not None and records and clock.elapsed() + per_round > clock.limit_s:
            reason = "max_minutes"
            break
        k = len(records)
        progress(f"round {k + 1}{'' if auto else '/' + str(target)}: one step of each of "
                 f"{len(live)} runs")
        try:
            records.append(_one_round(live, k, steps[k % len(steps)], k % len(steps)))
        except KeyboardInterrupt:
            progress(f"interrupted in round {k + 1}: reporting the {k} round(s) completed")
            reason = "interrupted"
            break
        deciding = auto and len(records) >= MIN_ROUNDS
        report = provisional(records) if saved is not None or deciding else None
        if saved is not None:
            saved(report)
        if deciding and all(c["decided"] for c in decisive(report)):
            reason = "decided"
            break
    left = [f"{c['run']} vs {c['rival']}" for c in decisive(provisional(records))
            if not c["decided"]]
    return records, {"reason": reason, "undecided": left}


def run_bench(config: dict[str, Any], save=None) -> dict[str, Any]:
    """Everything the bench measures, as the JSON document (see the module docstring);
    ``save(document)`` is also handed the document so far after each paired round. An
    interrupt before the rounds ends with the document of what was measured, ``stop.phase``
    naming the phase it ended in."""
    auto = config["rounds"] == "auto"
    clock = Clock(config["max_minutes"] or (AUTO_MINUTES if auto else None))
    state: dict[str, Any] = {"phase": "building the model", "runs": []}
    try:
        return _measure(config, save, clock, state)
    except KeyboardInterrupt:
        progress(f"interrupted while {state['phase']}: no paired round ran")
        if "provisional" in state:
            out = state["provisional"]([])
        else:  # nothing measured yet: the configuration alone
            out = {"config": {k: v for k, v in config.items() if k != "layers_n"}, "runs": [],
                   "rounds": []}
        out["stop"] = {"reason": "interrupted", "phase": state["phase"], "undecided": []}
        out["seconds"] = clock.elapsed()
        return out
    finally:
        for run in state["runs"]:
            close(run)
        end_group()


def _measure(config, save, clock: Clock, state: dict[str, Any]) -> dict[str, Any]:
    device = config["device"]
    progress(f"building {config['model']} ({config['dtype']}, {device}, "
             f"{'full fine-tuning' if config['full'] else 'LoRA r=' + str(config['lora_r'])})")
    base = build_model(config)
    config["layers_n"] = len(lm_of(base).get_decoder().layers)
    steps = make_steps(base, config)
    init = {n: p.detach().clone() for n, p in base.named_parameters() if p.requires_grad}
    state["phase"] = "setting up the runs"
    runs, gc_probe_peak, block_k = _setup_runs(base, config, steps, state)
    gc_peak = gc_probe_peak

    def provisional(records):
        return summary.report(config, runs, gc_peak, steps, block_k, records)

    state["provisional"] = provisional
    state["phase"] = "warming up"
    _warm_up([r for r in runs if r.live], steps, device, config.get("strict", False), clock,
             config["batches"])
    live = [r for r in runs if r.live]
    state["phase"] = "measuring peaks"
    progress("peak memory pass")
    for run in live:
        run.peak_bytes, run.activation_peak_bytes = measure_peak(run, steps[0], device)
    gc_run = next(r for r in runs if r.method == "gc")
    gc_peak = gc_run.peak_bytes or gc_probe_peak  # same pass, every copy alive: same baseline
    state["phase"] = "measuring gradients and FLOPs"
    progress("gradient and FLOP pass")
    _gradients(live, steps, init, config.get("strict", False))

    def saved(document):
        save(dict(document, stop={"reason": "running", "undecided": []}))

    state["phase"] = "paired rounds"
    if clock.limit_s is not None:
        progress(f"paired rounds: {(clock.limit_s - clock.elapsed()) / 60:.1f} of "
                 f"{clock.limit_s / 60:g} minutes left")
    records, stop = _rounds(live, steps, config, clock, provisional,
                            None if save is None else saved)
    out = provisional(records)  # the runs are closed by ``run_bench``
    out["config"]["gc_probe_peak_bytes"] = int(gc_probe_peak)  # GC's first reading
    out["stop"] = stop
    out["seconds"] = clock.elapsed()
    return out


def main(config: dict[str, Any], json_path: str | None, plot_path: str | None) -> int:
    if config.get("threads"):
        torch.set_num_threads(config["threads"])

    def save(report) -> None:  # whole or not at all: written aside, then renamed
        with open(json_path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
        os.replace(json_path + ".tmp", json_path)

    try:
        report = run_bench(config, save if json_path else None)
    finally:
        end_group()
    if json_path:  # before the table: a table that fails loses nothing
        save(report)
        progress(f"wrote {json_path}")
    if not report["rounds"]:  # ended before its first paired round: nothing to compare
        if "gc_peak_bytes" in report:
            print(table(report))
        print(f"hilore bench: error: interrupted while {report['stop'].get('phase')}, before any "
              "paired round" + (f"; what was measured is in {json_path}" if json_path else ""),
              file=sys.stderr)
        return 1
    print(table(report))
    if plot_path:
        plot(report, plot_path)
        progress(f"wrote {plot_path}")
    return 0
