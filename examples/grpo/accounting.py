"""What ``make demo`` concludes from its two runs, recomputed from their per-step records
(``metrics.jsonl``) and summaries: plain functions, no training.

    numbers = account(gc_records, hilore_records, gc_summary, hilore_summary)

NOTE [ The demo's accounting ]
Both runs are seeded alike and see the same prompts, so step i of one is paired with step i of
the other: the same rollout shapes (bitwise the same rollouts while the trajectories agree),
run back to back (NOTE [ Runs in turns ] in turns.py), under the same load of the machine. Times are each step's actor update, the slowest
rank's; generation and evaluation are left out (HiLoRe changes neither).

* Warm-up steps: those in which HiLoRe learned (its ``stats["warm_up"]`` non-empty on any rank:
  profiling, planning, calibration, leave-one-out, the codec's compilation; NOTE [ Warm-up,
  counted ] in ds_hilore/plan/scheduler.py). Every other step is steady.
* Per step: over the steady steps not metered for memory (a metered step's time is the meter's),
  the paired ratio GC time / HiLoRe time (above 1: HiLoRe faster), its median and the 95 %
  signed-rank interval of ``ds_hilore.bench.paired`` (none below 6 steps).
* Whole run: every step's update time summed, warm-up and metered steps included, per arm; the
  ratio of the sums. HiLoRe's warm-up cost: the sum over its warm-up steps of its time minus
  GC's on the same step, what learning cost above doing GC's work.
* Peaks: per rank, the highest metered peak of each run (whole process) and HiLoRe's over GC's,
  against ``memory_budget``.
* Quality: held-out reward before and after; the trajectories are bitwise the same when every
  step's trainable weights hash alike (H and R are exact; a packed unit changes the last bits).
* Regime: GC's recomputed share of its update's FLOPs and the sequences per microbatch
  (``examples.grpo.flops``); HiLoRe's recomputed FLOPs against GC's.
"""

from __future__ import annotations

import dataclasses

from ds_hilore.bench import paired

__all__ = ["PairedStep", "account", "paired_steps"]


@dataclasses.dataclass(frozen=True)
class PairedStep:
    step: int
    gc_s: float  # GC's update time on this step (slowest rank), seconds
    hilore_s: float  # HiLoRe's
    warm_up: bool  # HiLoRe learned in this step (any rank)
    metered: bool  # either run metered memory in this step


def paired_steps(gc_records: list[dict], hilore_records: list[dict]) -> list[PairedStep]:
    """The steps both runs took, paired by index."""
    gc = {r["step"]: r for r in gc_records if r["step"] > 0}
    hl = {r["step"]: r for r in hilore_records if r["step"] > 0}
    return [PairedStep(step, gc[step]["update_s"], hl[step]["update_s"], bool(hl[step].get("warm_up")),
                       bool(gc[step].get("metered") or hl[step].get("metered")))
            for step in sorted(gc.keys() & hl.keys())]


def per_step(steps: list[PairedStep]) -> dict:
    """The steady steps' paired comparison (``paired.compare``: median ratio GC / HiLoRe,
    interval, verdict) and which steps it pairs."""
    steady = [s for s in steps if not s.warm_up and not s.metered]
    out = paired.compare([s.hilore_s for s in steady], [s.gc_s for s in steady])
    return {**out, "steps": [s.step for s in steady]}


def whole_run(steps: list[PairedStep]) -> dict:
    """Every step's update time summed per arm, their ratio, and HiLoRe's warm-up cost."""
    gc, hl = sum(s.gc_s for s in steps), sum(s.hilore_s for s in steps)
    warm = [s for s in steps if s.warm_up]
    return {"gc_s": gc, "hilore_s": hl, "speedup": gc / hl if hl > 0 else None,
            "warm_up_steps": [s.step for s in warm],
            "warm_up_cost_s": sum(s.hilore_s - s.gc_s for s in warm)}


def peaks(gc_summary: dict, hilore_summary: dict) -> dict:
    """Per rank: each run's peak (bytes) and HiLoRe's over GC's; the largest rank's over the
    largest (``largest_ratio``), which the budget bounds: HiLoRe's budget is a multiple of GC's
    peak agreed over ranks, the largest (every rank plans the same), so a rank whose own GC
    peak is lower (shorter completions) may hold more than the multiple of its own."""
    gc, hl = gc_summary.get("peak_bytes_per_rank"), hilore_summary.get("peak_bytes_per_rank")
    ratios = [h / g for g, h in zip(gc, hl)] if gc and hl else None
    largest = max(hl) / max(gc) if gc and hl else None
    budget = hilore_summary.get("memory_budget")
    within = None if largest is None or budget is None else largest <= budget
    return {"gc_bytes": gc, "hilore_bytes": hl, "ratio": ratios, "largest_ratio": largest,
            "memory_budget": budget, "within": within}


def quality(gc_records: list[dict], hilore_records: list[dict], gc_summary: dict, hilore_summary: dict) -> dict:
    """Held-out reward before/after of both, and whether the trajectories agree bitwise."""
    digests = [[r.get("trainable_sha256") for r in records if r["step"] > 0]
               for records in (gc_records, hilore_records)]
    return {"gc_before": gc_summary["held_out_before"], "gc_after": gc_summary["held_out_after"],
            "hilore_before": hilore_summary["held_out_before"], "hilore_after": hilore_summary["held_out_after"],
            "same_after": gc_summary["held_out_after"] == hilore_summary["held_out_after"],
            "bitwise": bool(digests[0]) and digests[0] == digests[1]}


def regime(gc_summary: dict, hilore_summary: dict) -> dict:
    """GC's recomputed share of its update's FLOPs, sequences per microbatch, and the share of
    GC's recomputation HiLoRe's plan avoids (None where FLOPs were not counted)."""
    gc, hl = gc_summary.get("flops") or {}, hilore_summary.get("flops") or {}
    avoided = None
    if gc.get("recomputed_flops") and hl.get("recomputed_flops") is not None:
        avoided = 1.0 - hl["recomputed_flops"] / gc["recomputed_flops"]
    return {"gc_recompute_share": gc.get("recompute_share"), "gc_update_flops": gc.get("update_flops"),
            "gc_recomputed_flops": gc.get("recomputed_flops"),
            "hilore_recomputed_flops": hl.get("recomputed_flops"), "recompute_avoided": avoided,
            "sequences_per_microbatch": gc_summary.get("sequences_per_microbatch"),
            "tokens_per_microbatch": gc.get("tokens_per_microbatch")}


def account(gc_records: list[dict], hilore_records: list[dict], gc_summary: dict, hilore_summary: dict) -> dict:
    """Everything the demo's summary states (NOTE [ The demo's accounting ])."""
    steps = paired_steps(gc_records, hilore_records)
    return {"per_step": per_step(steps), "whole_run": whole_run(steps), "peaks": peaks(gc_summary, hilore_summary),
            "quality": quality(gc_records, hilore_records, gc_summary, hilore_summary),
            "regime": regime(gc_summary, hilore_summary), "plan_mix": hilore_summary.get("actions"),
            "steps": [dataclasses.asdict(s) for s in steps]}
