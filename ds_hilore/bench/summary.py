"""The bench's report document from what the ranks measured (plain data, the JSON).

NOTE [ Every rank's samples, and the slowest ]
``samples`` holds every rank's raw record as rank 0 gathered it (``ranks[r]``: its warm-up
steps, peaks, FLOPs, and each round's or whole-run step's wall and CPU seconds per run) and
what every rank holds alike (``shared``: gradient errors summed over ranks, HiLoRe's stats as
rank 0 read them). The verdicts use one time per round and run: the slowest rank's (a
DeepSpeed step ends when its last rank does); a peak is the largest rank's. ``rounds`` (and
the whole run's ``run.steps``) hold those per-round figures, from which every paired ratio
and interval is computed (``ds_hilore.bench.paired``).
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch

from ds_hilore.bench import paired
from ds_hilore.bench.methods import METHODS
from ds_hilore.bench.targets import label as label_of
from ds_hilore.bench.targets import samples as paired_samples
from ds_hilore.bench.targets import targets

__all__ = ["comparisons", "document", "efficiency", "recomputed_flops", "regime", "slowest"]


def slowest(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Per run, the largest of the ranks' values (each rank's dict: run label -> value); a run
    some rank has no value for is left out (the others' largest need not be the slowest)."""
    labels = dict.fromkeys(k for d in per_rank for k in d)
    return {k: max(d[k] for d in per_rank) for k in labels if all(k in d for d in per_rank)}


def _rounds(ranks: list[dict]) -> list[dict[str, Any]]:
    """Round k of every rank as one record: its order, and each run's slowest rank's seconds."""
    out = []
    for k in range(min(len(r["rounds"]) for r in ranks)):
        every = [r["rounds"][k] for r in ranks]
        out.append({"round": k, "step": every[0]["step"], "order": every[0]["order"],
                    "wall_s": slowest([e["wall_s"] for e in every]),
                    "cpu_s": slowest([e["cpu_s"] for e in every])})
    return out


def _run_steps(ranks: list[dict], shared: dict) -> list[dict[str, Any]]:
    """Whole-run step i of every rank as one record: slowest seconds, and each allocator's
    warm-up work on any rank."""
    out = []
    for i in range(min(len(r["steps"]) for r in ranks)):
        every = [r["steps"][i] for r in ranks]
        work = {label: sorted({k for e in every for k in e["work"].get(label, [])})
                for label in every[0]["work"]}
        out.append({"step": i, "seq_len": every[0]["seq_len"], "order": every[0]["order"],
                    "tokens": shared["tokens"][i],
                    "wall_s": slowest([e["wall_s"] for e in every]),
                    "cpu_s": slowest([e["cpu_s"] for e in every]), "work": work})
    return out


def host(config: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """Where the bench ran (read in the bench's own process: the ranks run on the same
    machine), and the codec kernels whose compilation failed in rank 0 (they ran eager)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out = {"platform": platform.platform(), "python": platform.python_version(),
           "torch": torch.__version__, "cpus": os.cpu_count(), "load_avg_1m": load,
           "device": config["device"], "ranks": config["ranks"],
           "threads_per_rank": config.get("threads")}
    for name in ("transformers", "deepspeed"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    if config["device"] == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    out["codec_compile_failures"] = dict(shared.get("codec_compile_failures") or {})
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def recomputed_flops(mine: list[int] | None, nogc: list[int] | None) -> int | None:
    """FLOPs a step runs above no checkpointing's, microbatch by microbatch: a microbatch that
    runs fewer (its backward skipped, or its rows elided) recomputes nothing and counts 0."""
    if mine is None or nogc is None or len(mine) != len(nogc):
        return None
    return sum(max(0, m - n) for m, n in zip(mine, nogc))


def _flops(ranks: list[dict], label: str) -> list[int] | None:
    """Every rank's microbatch FLOPs of one step, rank by rank (None if any is missing)."""
    per_rank = [r.get("flops", {}).get(label) for r in ranks]
    return None if any(f is None for f in per_rank) else [x for f in per_rank for x in f]


def _warm_up(ranks: list[dict], label: str) -> dict[str, Any]:
    """A run's warm-up steps: count, seconds (each step the slowest rank's), its work."""
    per_rank = [r["warmup"].get(label) for r in ranks]
    if any(w is None for w in per_rank):
        return {"warmup_steps": 0, "profile_s": 0.0}
    walls = [max(w["wall_s"][i] for w in per_rank) for i in range(len(per_rank[0]["wall_s"]))]
    return {"warmup_steps": len(walls), "profile_s": float(sum(walls)),
            "warmup_work": per_rank[0]["work"]}


def _peak(ranks: list[dict], label: str, key: str) -> int | None:
    values = [r["peaks"][label][key] for r in ranks if label in r.get("peaks", {})]
    return max(values) if len(values) == len(ranks) else None


def _errors(values: list[float] | None) -> dict[str, float] | None:
    return {"mean": statistics.fmean(values), "max": max(values)} if values else None


def _row(label: str, samples: dict, rounds: list[dict], nogc_flops) -> dict[str, Any]:
    """One run's row: its method and budget, then what was measured of it (None where nothing
    was: ``skipped`` says why)."""
    ranks, shared = samples["ranks"], samples["shared"]
    method, _, budget = label.partition("@")
    row: dict[str, Any] = {"method": method, "budget": float(budget) if budget else None,
                           "label": label, "skipped": shared["skipped"].get(label)}
    if shared.get("notes", {}).get(label):
        row["note"] = shared["notes"][label]
    if row["skipped"]:
        return row
    wall = [r["wall_s"][label] for r in rounds if label in r["wall_s"]]
    tokens = [shared["tokens"][r["step"]] / r["wall_s"][label] for r in rounds
              if label in r["wall_s"]]
    errors = shared.get("grad_err", {}).get(label) or {}
    flops = _flops(ranks, label)
    row.update({
        "step_s": _spread(wall), "tokens_per_s": _spread(tokens),
        "cpu_s": _spread([r["cpu_s"][label] for r in rounds if label in r["cpu_s"]]),
        "peak_bytes": _peak(ranks, label, "peak_bytes"),
        "activation_peak_bytes": _peak(ranks, label, "activation_peak_bytes"),
        "grad_err": _errors(errors.get("step")),
        "grad_err_microbatch": _errors(errors.get("microbatch")),
        "recomputed_flops": recomputed_flops(flops, nogc_flops),
        "update_flops": None if flops is None else sum(flops),
        "warmed": shared.get("warmed", {}).get(label, True),
        **_warm_up(ranks, label),
        **(shared.get("hilore", {}).get(label) or {"plan_mix": None, "plans": None,
                                                   "allocator": None}),
    })
    return row


def _fill_paired(doc: dict[str, Any]) -> None:
    """Each row's paired speed against GC (wall and CPU), the gap it closes, its peak over
    GC's and whether it fits its budget."""
    rows = {r["label"]: r for r in doc["runs"] if r.get("step_s")}
    gc, nogc, gc_peak = rows.get("gc"), rows.get("nogc"), doc["gc_peak_bytes"]
    for row in doc["runs"]:
        row["within_budget"] = None
        if row.get("peak_bytes") is not None and gc_peak:
            row["peak_over_gc"] = row["peak_bytes"] / gc_peak
            if row["budget"] is not None:
                row["within_budget"] = row["peak_bytes"] <= row["budget"] * gc_peak
        row["vs_gc"], row["gap_closed"] = None, None
        if not row.get("step_s") or gc is None:
            continue
        row["vs_gc"] = {key: paired.compare(*paired_samples(doc, row["label"], "gc", metric))
                        for key, metric in (("wall", "wall_s"), ("cpu", "cpu_s"))}
        t_gc, t_nogc = gc["step_s"]["median"], (nogc or gc)["step_s"]["median"]
        if t_gc != t_nogc:
            row["gap_closed"] = (t_gc - row["step_s"]["median"]) / (t_gc - t_nogc)


def comparisons(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pair of timed runs (a before b in the table): b's step time over a's, per round,
    by the wall clock and by CPU seconds, with the 95 % interval (``paired.compare``)."""
    timed = [r for r in doc["runs"] if r.get("step_s")]
    out = []
    for i, a in enumerate(timed):
        for b in timed[i + 1:]:
            out.append({"a": a["label"], "b": b["label"], **{
                key: paired.compare(*paired_samples(doc, a["label"], b["label"], metric))
                for key, metric in (("wall", "wall_s"), ("cpu", "cpu_s"))}})
    return out


def regime(doc: dict[str, Any]) -> dict[str, Any]:
    """Where the shape stands: no-GC's peak over GC's, GC's recompute over GC's update FLOPs,
    sequences per microbatch (the paper's regime: >= 1.5, >= 0.25, >= 8)."""
    rows = {r["label"]: r for r in doc["runs"] if not r.get("skipped")}
    nogc, gc = rows.get("nogc"), rows.get("gc")
    out = {"nogc_peak_over_gc": None, "gc_recompute_share": None,
           "sequences_per_microbatch": doc["config"]["micro_batch"]}
    if nogc and gc and nogc.get("peak_bytes") and gc.get("peak_bytes"):
        out["nogc_peak_over_gc"] = nogc["peak_bytes"] / gc["peak_bytes"]
    if gc and gc.get("update_flops") and gc.get("recomputed_flops") is not None:
        out["gc_recompute_share"] = gc["recomputed_flops"] / gc["update_flops"]
    return out


def efficiency(doc: dict[str, Any]) -> dict[str, float]:
    """HiLoRe's machinery alone: forced all-R vs gc, forced all-H vs nogc (throughput ratios)."""
    med = {label_of(r): r["tokens_per_s"]["median"] for r in doc["runs"] if r.get("tokens_per_s")}
    return {f"{forced}_vs_{ref}": med[forced] / med[ref]
            for forced, ref in (("hilore_all_r", "gc"), ("hilore_all_h", "nogc"))
            if forced in med and ref in med}


# NOTE [ The whole run's accounting ]
# Every run's update time is the sum of its steps' times (each the slowest rank's). A step is
# one of a HiLoRe allocator's warm-up steps when its stats show warm-up work on any rank
# (``stats.step_work``: profiling, planning, calibration, leave-one-out); its warm-up seconds
# are the sum over those steps of its time minus GC's on the same step (the step data, its
# length and the machine's moment alike), what the warm-up cost above doing GC's work. Its
# steady ratio is the paired comparison with GC over the steps after its last warm-up step.
def _run_summary(steps: list[dict], label: str) -> dict[str, Any]:
    """One run's whole-run figures (NOTE [ The whole run's accounting ])."""
    mine = [s["wall_s"][label] for s in steps]
    gc = [s["wall_s"]["gc"] for s in steps]
    out: dict[str, Any] = {"update_s": float(sum(mine)), "gc_update_s": float(sum(gc))}
    out["time_over_gc"] = out["update_s"] / out["gc_update_s"] if out["gc_update_s"] else None
    if not any(label in s["work"] for s in steps):
        return out
    warm = [i for i, s in enumerate(steps) if s["work"].get(label)]
    after = (warm[-1] + 1) if warm else 0
    out.update({"warm_up_steps": warm,
                "warm_up_s": float(sum(mine[i] - gc[i] for i in warm)),
                "steady_from": after,
                "steady": paired.compare(mine[after:], gc[after:])})
    return out


def _whole_run(samples: dict) -> dict[str, Any]:
    steps = _run_steps(samples["ranks"], samples["shared"])
    labels = [label for label in samples["shared"]["runs"]
              if not samples["shared"]["skipped"].get(label)]
    runs = {label: _run_summary(steps, label) for label in labels} if steps else {}
    return {"steps": steps, "lengths": samples["shared"]["lengths"], "runs": runs}


def document(config: dict[str, Any], samples: dict[str, Any], stop: dict[str, Any],
             seconds: float) -> dict[str, Any]:
    """The report (the JSON document) of ``config`` (``Config.to_dict()``) from rank 0's last
    ``samples``: ``config``, ``host``, ``samples`` (raw, NOTE [ Every rank's samples, and the
    slowest ]), ``stop`` and ``seconds``; in the paired mode ``rounds``, ``runs`` (one row per
    run), ``gc_peak_bytes``, ``profile_s``, ``comparisons``, ``regime``, ``efficiency`` and
    ``targets``; in the whole-run mode ``run``."""
    doc: dict[str, Any] = {"config": dict(config), "host": host(config, samples["shared"]),
                           "samples": samples,
                           "stop": stop, "seconds": seconds}
    if config.get("run_steps"):
        doc["run"] = _whole_run(samples)
        return doc
    ranks = samples["ranks"]
    doc["rounds"] = _rounds(ranks)
    nogc_flops = _flops(ranks, "nogc")
    doc["runs"] = [_row(label, samples, doc["rounds"], nogc_flops)
                   for label in samples["shared"]["runs"]]
    gc = next((r for r in doc["runs"] if r["label"] == "gc"), {})
    doc["gc_peak_bytes"] = gc.get("peak_bytes")
    doc["profile_s"] = float(sum(r.get("profile_s", 0.0) for r in doc["runs"]
                                 if METHODS[r["method"]].allocator))
    doc["config"]["tokens_per_step"] = samples["shared"]["tokens"][0]
    _fill_paired(doc)
    doc["regime"] = regime(doc)
    doc["comparisons"] = comparisons(doc)
    doc["efficiency"] = efficiency(doc)
    doc["targets"] = targets(doc) if doc["gc_peak_bytes"] else []
    return doc
