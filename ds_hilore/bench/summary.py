"""The ``hilore bench`` report from its runs and rounds: one row per run, the paired comparisons,
the regime the shape is in, and HiLoRe's targets (plain data, the JSON document)."""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch

from ds_hilore.bench import paired
from ds_hilore.bench.methods import METHODS
from ds_hilore.bench.report import efficiency
from ds_hilore.bench.targets import label, samples, targets
from ds_hilore.runtime.codecs import compile_failures

__all__ = ["comparisons", "regime", "report"]


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
    # a codec kernel whose compilation failed ran eager: L's figures are then the eager codec's
    host["codec_compile_failures"] = compile_failures()
    return host


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _empty_row(row: dict[str, Any], reason: str) -> dict[str, Any]:
    row.update({k: None for k in ("tokens_per_s", "peak_bytes", "activation_peak_bytes",
                                  "within_budget", "grad_err", "grad_err_microbatch", "plan_mix",
                                  "plans", "gap_closed", "cpu_s", "recomputed_flops", "vs_gc")})
    row["skipped"] = reason
    return row


def recomputed_flops(mine: list[int] | None, nogc: list[int] | None) -> int | None:
    """FLOPs a step runs above no checkpointing's, microbatch by microbatch: a microbatch that
    runs fewer (its backward skipped, or its rows elided) recomputes nothing and counts 0."""
    if mine is None or nogc is None or len(mine) != len(nogc):
        return None
    return sum(max(0, m - n) for m, n in zip(mine, nogc))


def _row(run, gc_peak: int, tokens: dict[int, int], nogc_flops) -> dict[str, Any]:
    """One run's row; ``tokens``: round -> tokens of the step that round ran (the filtered
    variant's steps differ in size)."""
    src = run.copy_of or run
    row: dict[str, Any] = {"method": run.method, "budget": run.budget, "timed_as": src.label}
    if src.skipped or src.peak_bytes is None:
        return _empty_row(row, src.skipped or "not measured")
    stats = src.stats or {}
    wall = [src.wall_s[k] for k in sorted(src.wall_s)]
    cpu = [src.cpu_s[k] for k in sorted(src.cpu_s)]
    tps = [tokens[k] / src.wall_s[k] for k in sorted(src.wall_s)]
    row.update({
        "tokens_per_s": _spread(tps) if wall else None,
        "step_s": _spread(wall) if wall else None, "cpu_s": _spread(cpu) if cpu else None,
        "peak_bytes": src.peak_bytes, "activation_peak_bytes": src.activation_peak_bytes,
        "within_budget": None if run.budget is None else bool(src.peak_bytes <= run.budget * gc_peak),
        # the step's accumulated gradient, and each microbatch's, against no checkpointing
        "grad_err": ({"mean": statistics.fmean(src.grad_errs), "max": max(src.grad_errs)}
                     if src.grad_errs else None),
        "grad_err_microbatch": ({"mean": statistics.fmean(src.grad_errs_micro),
                                 "max": max(src.grad_errs_micro)} if src.grad_errs_micro else None),
        "plan_mix": ({a: n for a, n in stats.get("actions", {}).items() if n} if src.stats else None),
        # the allocator's plan per shape bucket, unit by unit (before any per-microbatch change)
        "plans": src.plans,
        # per step: bytes held per action (L: packed, each unpacked once in the backward), codec time
        "held_bytes": ({a: n for a, n in stats.get("bytes", {}).items() if n} if src.stats else None),
        "pack_s": stats.get("pack_s") if src.stats else None,
        "unpack_s": stats.get("unpack_s") if src.stats else None,
        "allocator": ({k: stats.get(k) for k in ("budget_bytes", "peak_bytes", "grad_error_est",
                                                  "risk_budget")}
                      if src.stats and stats.get("budget_bytes") is not None else None),
        "gap_closed": None, "vs_gc": None,  # filled from the rounds below
        "recomputed_flops": recomputed_flops(src.microbatch_flops, nogc_flops),
        "update_flops": None if src.microbatch_flops is None else sum(src.microbatch_flops),
        "skipped": None if wall else "no timed round",
        "profile_s": src.profile_s, "warmup_steps": src.warmup_steps, "warmed": src.warmed,
    })
    if src.note:
        row["note"] = src.note
    if run.copy_of is not None:
        row["measured_once"] = True
    return row


def comparisons(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pair of timed runs (a before b in the table): b's step time over a's, per round,
    by the wall clock and by CPU-seconds, with the 95 % interval (``paired.compare``)."""
    timed = [r for r in report["runs"] if r.get("step_s") and not r.get("measured_once")]
    out = []
    for i, a in enumerate(timed):
        for b in timed[i + 1:]:
            entry = {"a": label(a), "b": label(b)}
            for key, metric in (("wall", "wall_s"), ("cpu", "cpu_s")):
                mine, theirs = samples(report, a["timed_as"], b["timed_as"], metric)
                entry[key] = paired.compare(mine, theirs)
            out.append(entry)
    return out


def regime(report: dict[str, Any]) -> dict[str, Any]:
    """Where the shape stands: no-GC's peak over GC's, GC's recompute over GC's update FLOPs,
    sequences per microbatch (the paper's regime: >= 1.5, >= 0.25, >= 8)."""
    rows = {r["method"]: r for r in report["runs"] if r["budget"] is None and not r.get("skipped")}
    nogc, gc = rows.get("nogc"), rows.get("gc")
    cfg = report["config"]
    out = {"nogc_peak_over_gc": None, "gc_recompute_share": None,
           "sequences_per_microbatch": cfg["micro_batch"]}
    if nogc and gc:
        out["nogc_peak_over_gc"] = nogc["peak_bytes"] / gc["peak_bytes"]
        if gc.get("update_flops") and gc.get("recomputed_flops") is not None:
            out["gc_recompute_share"] = gc["recomputed_flops"] / gc["update_flops"]
    return out


def _fill_paired(report: dict[str, Any]) -> None:
    rows = {r["method"]: r for r in report["runs"] if r["budget"] is None and r.get("step_s")}
    gc, nogc = rows.get("gc"), rows.get("nogc")
    t = {k: {"median": r["step_s"]["median"]} for k, r in rows.items()}
    for row in report["runs"]:
        if not row.get("step_s") or gc is None:
            continue
        mine, theirs = samples(report, row["timed_as"], gc["timed_as"], "wall_s")
        row["vs_gc"] = {"wall": paired.compare(mine, theirs)}
        mine, theirs = samples(report, row["timed_as"], gc["timed_as"], "cpu_s")
        row["vs_gc"]["cpu"] = paired.compare(mine, theirs)
        if nogc is not None and t["gc"]["median"] != t["nogc"]["median"]:
            row["gap_closed"] = ((t["gc"]["median"] - row["step_s"]["median"])
                                 / (t["gc"]["median"] - t["nogc"]["median"]))


def report(config, runs, gc_peak: int, steps, block_k, records) -> dict[str, Any]:
    """The JSON document (see ``ds_hilore.bench.frontier``) from the runs measured so far."""
    per_step = [sum(int(m["input_ids"].numel()) for m in s) for s in steps]  # tokens
    tokens = {r["round"]: per_step[r["step"]] for r in records}
    nogc_flops = next((r.microbatch_flops for r in runs if r.method == "nogc" and r.live), None)
    rows = [_row(r, gc_peak, tokens, nogc_flops) for r in runs]
    cfg = {k: v for k, v in config.items() if k != "layers_n"}
    cfg["layers_built"] = config["layers_n"]
    cfg["tokens_per_step"] = per_step[0]
    cfg["tokens_of_steps"] = per_step
    cfg["sequences_per_step"] = [sum(int(m["input_ids"].shape[0]) for m in s) for s in steps]
    cfg["block_h_k"] = {  # NOTE [ block_h's k, measured against GC in the same memory ]
        f"{b:g}": {"k": k, "probes": [{"k": pk, "peak_bytes": pp, "gc_peak_bytes": gp}
                                      for pk, pp, gp in probes]}
        for b, (k, probes) in block_k.items()}
    profile_s = sum(r.profile_s for r in runs if r.copy_of is None and METHODS[r.method].policy)
    out = {"config": cfg, "host": _host(config), "gc_peak_bytes": int(gc_peak),
           "profile_s": float(profile_s), "rounds": list(records), "runs": rows}
    _fill_paired(out)
    out["regime"] = regime(out)
    out["comparisons"] = comparisons(out)
    out["efficiency"] = efficiency(out)
    out["targets"] = targets(out)
    return out
