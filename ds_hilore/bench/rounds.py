"""The paired mode on one rank: every run's engine opened, warmed up, its peak metered, its
gradient measured against no checkpointing, then timed in paired rounds.

Every function is a collective: the ranks open the same runs, in the same order, and step them
together. What a rank measures goes to its ``record`` (raw, its own); what every rank holds
alike (gradient errors, summed over ranks; HiLoRe's stats, rank 0's) to ``shared``.

1. Warm-up, one run at a time: a run with HiLoRe's scheduler (an allocator, a plan pinned by
   a pattern) steps until two steps in a row did no warm-up work (``stats.step_work``:
   profiling, planning, calibration, leave-one-out), at most ``MAX_WARMUP``; any other run one
   step (its first allocations). Each step's time and work is kept.
2. Peaks: one metered step per run, every run alive (NOTE [ Engines side by side ]).
3. Gradients: each run's step gradient at the initial weights, summed over ranks, against no
   checkpointing's, on every step of the data; then one step's FLOPs.
4. Paired rounds: round k runs every run once, back to back, on step k mod ``batches``, the
   order rotating by one each round, each step between barriers; the bench says when they end
   (NOTE [ The run folder ] in link.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_hilore.bench import stats
from ds_hilore.bench.engines import (Run, close_run, max_over_ranks, metered_step, open_run,
                                     rank_steps, step_gradients, summed_over_ranks, timed_step,
                                     train_step, trainable)
from ds_hilore.bench.methods import METHODS
from ds_hilore.bench.models import lm_of
from ds_hilore.runtime.codecs import compile_failures

__all__ = ["MAX_WARMUP", "Interrupted", "open_runs", "paired", "warm_up_run"]

MAX_WARMUP = 40  # optimizer steps of an allocator's warm-up at most
STEADY = 2  # steps in a row without warm-up work: warmed up


class Interrupted(Exception):
    """The bench asked the ranks to stop (link.stopped)."""


def paired(config, base: torch.nn.Module, link) -> None:
    """The paired mode (see the module docstring); ``link``: the run folder's ``Link``."""
    vocab = lm_of(base).get_output_embeddings().weight.shape[0]
    steps = rank_steps(config, vocab, dist.get_rank(), [config.seq_len] * config.batches)
    init = [p.detach().clone() for p in trainable(base)]
    record = {"rank": dist.get_rank(), "warmup": {}, "peaks": {}, "flops": {}, "rounds": [],
              "block_h": {}}
    shared = {"runs": [], "skipped": {}, "notes": {}, "grad_err": {}, "hilore": {},
              "warmed": {}, "tokens": [s.tokens for s in steps], "phase": "opening the engines"}
    runs: list[Run] = []
    try:
        open_runs(runs, base, config, steps[0], record, shared, link)
        live = [r for r in runs if r.engine is not None]
        for phase, work in (("warming up", _warm_up), ("measuring peaks", _peaks),
                            ("measuring gradients and FLOPs", _gradients)):
            shared["phase"] = phase
            link.say(phase)
            work(live, steps, record, shared, link, config, init)
            link.publish(record, shared, phase)
        shared["phase"] = "running paired rounds"
        _rounds(live, steps, record, shared, link, config)
        shared["phase"] = "done"
    except Interrupted:
        link.say(f"interrupted while {shared['phase']}")
    finally:
        shared["codec_compile_failures"] = compile_failures()  # they run eager
        link.publish(record, shared, shared["phase"])
        for run in runs:
            close_run(run)


def open_runs(runs, base, config, step, record, shared, link) -> None:
    """Every run's engine, appended to ``runs`` as made: the methods without a budget first
    (GC is the unit of every budget), then each budgeted method at each budget; ``block_h``'s
    k by measuring on ``step`` (skipped without one: the whole run warms nothing first)."""
    plan = [(m, None) for m in config.methods if not METHODS[m].budgeted]
    plan += [(m, b) for m in config.methods if METHODS[m].budgeted for b in config.budgets]
    for name, budget in plan:
        link.say(f"engine {name}{'' if budget is None else f'@{budget:g}'} (ZeRO-"
                 f"{config.zero_stage}, {config.ranks} rank(s))")
        if METHODS[name].searched and step is None:
            run = Run(name, budget, skipped="its k is found by measuring steps before it runs; "
                      "the whole run starts every engine fresh")
        elif METHODS[name].searched:
            gc_run = next(r for r in runs if r.method == "gc")
            k, record["block_h"][f"{budget:g}"] = _find_block_k(base, config, budget, gc_run,
                                                                  step, link)
            run = open_run(name, budget, base, config, block_k=k)
        else:
            run = open_run(name, budget, base, config)
        runs.append(run)
        shared["runs"].append(run.label)
        if run.skipped:
            shared["skipped"][run.label] = run.skipped
        if run.note:
            shared["notes"][run.label] = run.note
        if link.stopped():
            raise Interrupted


# NOTE [ block_h's k, measured against GC in the same memory ]
# A peak is the whole process's, so it holds every engine alive at the time. Each probe is
# compared with GC's peak read again while the probe is alive (both the largest over ranks),
# not with a reading taken before the probe existed.
def _find_block_k(base, config, budget: float, gc_run: Run, step, link) -> tuple[int, list]:
    """The largest k (the last k layers H, the rest R) whose peak fits budget x GC's peak,
    and the probes as [k, peak, GC's peak beside it]."""
    lo, hi, probes = 0, len(lm_of(base).get_decoder().layers), []
    while lo < hi:
        k = (lo + hi + 1) // 2
        probe = open_run("block_h", budget, base, config, block_k=k)
        try:
            train_step(probe, step.micro_batches, step.prediction)
            gc_peak = max_over_ranks(metered_step(gc_run, step.micro_batches, step.prediction,
                                                  config.device)[0], config.device)
            peak = max_over_ranks(metered_step(probe, step.micro_batches, step.prediction,
                                               config.device)[0], config.device)
        finally:
            close_run(probe)
        probes.append([k, int(peak), int(gc_peak)])
        lo, hi = (k, hi) if peak <= budget * gc_peak else (lo, k - 1)
    link.say(f"block_h@{budget:g}: k = {lo} (probes {probes})")
    return lo, probes


def warm_up_run(run: Run, steps, device: str, link) -> tuple[list, list, bool]:
    """``run`` stepped until warmed up (see the module docstring): each step's (wall, CPU)
    seconds on this rank, each step's warm-up work, and whether it ended warmed up."""
    times, work, steady = [], [], 0
    runtime = getattr(run.engine, "hilore", None)
    runtime = runtime if runtime is not None and runtime.policy is not None else None
    validates = runtime is not None and runtime.config.plan_validation_microbatches > 0
    before = None if runtime is None else runtime.stats
    while len(times) < (MAX_WARMUP if runtime is not None else 1):
        step = steps[len(times) % len(steps)]
        times.append(timed_step(run, step, device))
        done = []
        if runtime is not None:
            after = runtime.stats
            done, before = stats.step_work(before, after, validates, [step.seq_len]), after
        work.append(done)
        steady = 0 if max_over_ranks(float(bool(done)), device) else steady + 1
        if link.stopped():
            raise Interrupted
        if runtime is not None and steady >= STEADY:
            break
    return times, work, runtime is None or steady >= STEADY


def _warm_up(live, steps, record, shared, link, config, init) -> None:
    for run in live:
        times, work, warmed = warm_up_run(run, steps, config.device, link)
        record["warmup"][run.label] = {"wall_s": [t[0] for t in times],
                                       "cpu_s": [t[1] for t in times], "work": work}
        shared["warmed"][run.label] = warmed
        _digest(run, shared)
        link.say(f"warm-up {run.label}: {len(times)} step(s), {sum(t[0] for t in times):.2f} s"
                 + ("" if warmed else " (HiLoRe still planning: stopped at the cap)"))


def _peaks(live, steps, record, shared, link, config, init) -> None:
    for run in live:
        peak, delta = metered_step(run, steps[0].micro_batches, steps[0].prediction,
                                   config.device)
        record["peaks"][run.label] = {"peak_bytes": peak, "activation_peak_bytes": delta}
        if link.stopped():
            raise Interrupted


def _gradients(live, steps, record, shared, link, config, init) -> None:
    """Each run's step error against nogc's (the reference first), summed over ranks; none
    under ZeRO-3 (its parameters are partitioned: no module holds the weights to set)."""
    if config.zero_stage == 3:
        link.say("gradient errors and FLOPs not measured under ZeRO-3")
        return
    reference = None
    for run in sorted(live, key=lambda r: r.method != "nogc"):
        if run.spec.reentrant:  # its recompute's backward writes .grad, past autograd.grad
            shared["notes"][run.label] = "gradient error not measured: reentrant checkpointing"
            continue
        mine = [[summed_over_ranks(g, config.device) for g in
                 step_gradients(run, s.micro_batches, s.prediction, init)[0]] for s in steps]
        reference = reference or mine
        shared["grad_err"][run.label] = {
            "step": [_rel_err(m[-1], r[-1]) for m, r in zip(mine, reference)],
            "microbatch": [_rel_err(_diff(m, i), _diff(r, i))
                           for m, r in zip(mine, reference) for i in range(len(m))]}
        record["flops"][run.label] = _flops(run, steps[0], init, link)
        if link.stopped():
            raise Interrupted


def _flops(run: Run, step, init, link) -> list[int] | None:
    try:
        return step_gradients(run, step.micro_batches, step.prediction, init, flops=True)[1]
    except Exception as error:  # noqa: BLE001 -- the counter's dispatch mode can clash
        link.say(f"{run.label}: FLOPs not counted ({type(error).__name__}: {error})")
        return None


def _diff(cumulative: list[torch.Tensor], i: int) -> torch.Tensor:
    return cumulative[0] if i == 0 else cumulative[i] - cumulative[i - 1]


def _rel_err(g: torch.Tensor, r: torch.Tensor) -> float:
    """||g - r|| / ||r|| in fp64 (0 when r is 0)."""
    den = float(r.double().norm())
    return float((g.double() - r.double()).norm()) / den if den > 0 else 0.0


def _rounds(live, steps, record, shared, link, config) -> None:
    k = 0
    while link.go(k, record, shared):
        shift = k % len(live)
        order = live[shift:] + live[:shift]  # rotating: no run always first or last
        entry = {"round": k, "step": k % len(steps), "order": [r.label for r in order],
                 "wall_s": {}, "cpu_s": {}}
        for run in order:
            wall, cpu = timed_step(run, steps[entry["step"]], config.device)
            entry["wall_s"][run.label], entry["cpu_s"][run.label] = wall, cpu
        record["rounds"].append(entry)
        for run in live:
            _digest(run, shared)
        k += 1


def _digest(run: Run, shared: dict) -> None:
    """Rank 0's reading of a HiLoRe run's stats, for its report row."""
    if run.engine.hilore is not None and dist.get_rank() == 0:
        shared["hilore"][run.label] = stats.digest(run.engine.hilore.stats)
