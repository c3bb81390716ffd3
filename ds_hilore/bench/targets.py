"""The project's targets for ``hilore`` at one budget, read off a bench report.

For each budget the report has a ``hilore`` row at, ``targets(report)`` says, from the measured
numbers only:

* ``peak_ratio``: its whole-process peak over GC's (target <= the budget);
* ``grad_err_mean``: mean relative gradient error against no checkpointing (target <= 0.010);
* ``flops_avoided``: the share of GC's recomputed FLOPs it does not recompute (target >= 0.60);
* ``gap_closed`` (wall-clock medians) and ``gap_closed_cpu`` (process CPU-seconds medians), each
  with whether the GC -> no-GC gap is larger than the spread (GC's fastest step slower than
  no-GC's slowest); the target (>= 0.60) applies only where it is;
* ``rivals``: every other method's timed run (budgeted ones: their run for this budget) that
  stays within the same budget and error tolerance, with
  ``ahead`` (HiLoRe's median throughput above the rival's max), ``inside_spread`` (above the
  rival's median but not its max) or ``behind``, by the wall clock and by CPU-seconds.

``met`` collects each target's verdict (``None`` where the numbers do not decide it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ERROR_TOLERANCE", "FLOPS_AVOIDED", "GAP_CLOSED", "targets", "targets_text"]

ERROR_TOLERANCE = 0.010
FLOPS_AVOIDED = 0.60
GAP_CLOSED = 0.60


def _label(row: dict[str, Any]) -> str:
    return row["method"] if row["budget"] is None else f"{row['method']}@{row['budget']:g}"


def _gap(rows: dict[str, dict], key: str, run: dict) -> tuple[float | None, bool]:
    gc, nogc = rows.get("gc"), rows.get("nogc")
    if not gc or not nogc or not gc.get(key) or not nogc.get(key):
        return None, False
    t_gc, t_nogc = gc[key]["median"], nogc[key]["median"]
    real = gc[key]["min"] > nogc[key]["max"]
    if t_gc == t_nogc:
        return None, real
    return (t_gc - run[key]["median"]) / (t_gc - t_nogc), real


def _standing(mine: dict, theirs: dict, faster_is_larger: bool) -> str:
    sign = 1.0 if faster_is_larger else -1.0
    best_of_theirs = theirs["max"] if faster_is_larger else theirs["min"]
    if sign * (mine["median"] - best_of_theirs) > 0:
        return "ahead"
    if sign * (mine["median"] - theirs["median"]) > 0:
        return "inside_spread"
    return "behind"


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One verdict per budget with a timed ``hilore`` row (see the module docstring)."""
    timed = [r for r in report["runs"] if r.get("tokens_per_s") and r.get("peak_bytes")]
    fixed = {r["method"]: r for r in timed if r["budget"] is None}
    gc_peak = report["gc_peak_bytes"]
    gc_flops = (fixed.get("gc") or {}).get("recomputed_flops")
    out = []
    for me in [r for r in timed if r["method"] == "hilore"]:
        budget = me["budget"]
        err = me["grad_err"]["mean"] if me.get("grad_err") else None
        flops = (None if not gc_flops or me.get("recomputed_flops") is None
                 else 1.0 - me["recomputed_flops"] / gc_flops)
        gap, gap_real = _gap(fixed, "step_s", me)
        gap_cpu, gap_cpu_real = _gap(fixed, "cpu_s", me)
        rivals = []
        for other in timed:
            if other["method"] == "hilore" or other["budget"] not in (None, budget):
                continue  # budgeted rivals: their run for this budget
            if other["peak_bytes"] > budget * gc_peak:
                continue
            if other.get("grad_err") and other["grad_err"]["mean"] > ERROR_TOLERANCE:
                continue
            rivals.append({"run": _label(other),
                           "wall": _standing(me["tokens_per_s"], other["tokens_per_s"], True),
                           "cpu": (_standing(me["cpu_s"], other["cpu_s"], False)
                                   if me.get("cpu_s") and other.get("cpu_s") else None)})
        met = {
            "peak": me["peak_bytes"] <= budget * gc_peak,
            "grad_err": None if err is None else err <= ERROR_TOLERANCE,
            "flops_avoided": None if flops is None else flops >= FLOPS_AVOIDED,
            "gap_closed": (None if gap is None or not gap_real else gap >= GAP_CLOSED),
            "gap_closed_cpu": (None if gap_cpu is None or not gap_cpu_real
                               else gap_cpu >= GAP_CLOSED),
            "ahead_of_rivals": all(r["wall"] == "ahead" for r in rivals),
            "ahead_of_rivals_cpu": all(r["cpu"] == "ahead" for r in rivals),
        }
        out.append({"budget": budget, "peak_ratio": me["peak_bytes"] / gc_peak,
                    "grad_err_mean": err, "flops_avoided": flops,
                    "gap_closed": gap, "gap_is_real": gap_real,
                    "gap_closed_cpu": gap_cpu, "gap_cpu_is_real": gap_cpu_real,
                    "rivals": rivals, "met": met})
    return out


def _yes(value) -> str:
    return "n/a" if value is None else ("met" if value else "MISSED")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def targets_text(verdicts: list[dict[str, Any]]) -> str:
    """The verdicts as lines for the bench's table."""
    lines = []
    for v in verdicts:
        met = v["met"]
        behind = [r["run"] for r in v["rivals"] if r["wall"] == "behind"]
        inside = [r["run"] for r in v["rivals"] if r["wall"] == "inside_spread"]
        behind_cpu = [r["run"] for r in v["rivals"] if r["cpu"] == "behind"]
        lines.append(
            f"targets, hilore@{v['budget']:g}: peak {v['peak_ratio']:.3f}x GC ({_yes(met['peak'])}); "
            f"grad err {_num(v['grad_err_mean'], '.4f')} <= {ERROR_TOLERANCE} ({_yes(met['grad_err'])}); "
            f"recomputed FLOPs avoided {_num(v['flops_avoided'], '.0%')} >= {FLOPS_AVOIDED:.0%} "
            f"({_yes(met['flops_avoided'])}); gap closed {_num(v['gap_closed'], '.2f')} wall"
            f"{'' if v['gap_is_real'] else ' (gap inside the spread)'} / "
            f"{_num(v['gap_closed_cpu'], '.2f')} cpu"
            f"{'' if v['gap_cpu_is_real'] else ' (gap inside the spread)'} "
            f"({_yes(met['gap_closed'])} / {_yes(met['gap_closed_cpu'])}); "
            f"ahead of {len(v['rivals'])} in-budget rivals: {_yes(met['ahead_of_rivals'])} wall, "
            f"{_yes(met['ahead_of_rivals_cpu'])} cpu"
            + (f"; inside the spread of {', '.join(inside)}" if inside else "")
            + (f"; behind (wall) {', '.join(behind)}" if behind else "")
            + (f"; behind (cpu) {', '.join(behind_cpu)}" if behind_cpu else ""))
    return "\n".join(lines)
