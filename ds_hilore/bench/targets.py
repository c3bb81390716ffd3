"""The project's targets for ``hilore`` at one budget, read off a bench report's paired rounds.

For each budget the report has a ``hilore`` row at, ``targets(report)`` says, from the measured
numbers only:

* ``peak_ratio``: its whole-process peak over GC's (target <= the budget);
* ``grad_err_mean``: mean relative error of the step's accumulated gradient against no
  checkpointing (target <= 0.010);
* ``flops_avoided``: the share of GC's recomputed FLOPs it does not recompute (target >= 0.40);
* ``gap_closed`` / ``gap_closed_cpu``: the share of the GC -> no-GC gap closed, per round
  (``paired.gap_closed``: median and 95 % interval); met when the interval lies above the
  target, missed when below, undecided otherwise;
* ``rivals``: every other method's timed run (budgeted ones: their run for this budget) within
  the same budget and error tolerance, each with the paired comparison (``paired.compare``:
  HiLoRe's speed over the rival's, median ratio, 95 % interval, ``ahead`` / ``level`` /
  ``behind``) by the wall clock and by CPU-seconds;
* ``decisive``: the comparisons the adaptive rounds wait for -- against ``gc``, ``static`` at
  this budget, the best in-budget rival (``best_rival``: the one HiLoRe's paired rounds put
  closest) and every rival whose own paired rounds against that one are not yet behind it
  (``contenders``: which is best is not known while they are level) -- and ``undecided``.

``met`` collects each target's verdict (``None`` where the numbers do not decide it).
"""

from __future__ import annotations

from typing import Any

from ds_hilore.bench import paired

__all__ = ["ERROR_TOLERANCE", "FLOPS_AVOIDED", "GAP_CLOSED", "best_rival", "contenders", "decisive",
           "default_tolerance", "label", "rival_tolerance", "samples", "standing", "targets", "targets_text", "timed"]

ERROR_TOLERANCE = 0.010
FLOPS_AVOIDED = 0.40  # the paper: recompute time -42.8 % at 1.10x
GAP_CLOSED = 0.60


def label(row: dict[str, Any]) -> str:
    return row["method"] if row["budget"] is None else f"{row['method']}@{row['budget']:g}"


def timed(row: dict[str, Any]) -> str:
    """The label the row's samples carry in ``rounds`` (``all_l``: its first budget's)."""
    return row.get("timed_as") or label(row)


def samples(report: dict[str, Any], a: str, b: str, metric: str) -> tuple[list, list]:
    """Paired samples of runs ``a`` and ``b`` (labels in ``rounds``): the rounds with both."""
    both = [r[metric] for r in report.get("rounds", []) if a in r[metric] and b in r[metric]]
    return [r[a] for r in both], [r[b] for r in both]


def _three(report, me: str, metric: str) -> tuple[list, list, list]:
    keys = ("gc", "nogc")
    rows = [r[metric] for r in report.get("rounds", []) if all(k in r[metric] for k in (me, *keys))]
    return [r[me] for r in rows], [r["gc"] for r in rows], [r["nogc"] for r in rows]


def default_tolerance() -> float:
    """HiLoRe's default ``grad_error_tolerance``: the bench's when ``--grad-error-tolerance``
    is not given."""
    from ds_hilore.config import HiLoReConfig

    return HiLoReConfig.model_fields["grad_error_tolerance"].default


def rival_tolerance(report) -> float:
    """The step error a rival may have and still count as in budget: the error target, or the
    run's own error budget (``--grad-error-tolerance``) where that is tighter -- HiLoRe is held
    to it, so a rival is too."""
    tolerance = report.get("config", {}).get("grad_error_tolerance")
    return ERROR_TOLERANCE if tolerance is None else min(ERROR_TOLERANCE, tolerance)


def _in_budget(report, me: dict[str, Any]) -> list[dict[str, Any]]:
    budget, gc_peak = me["budget"], report["gc_peak_bytes"]
    out = []
    for other in report["runs"]:
        if other["method"] == "hilore" or other["budget"] not in (None, budget):
            continue  # budgeted rivals: their run for this budget
        if not other.get("step_s") or other["peak_bytes"] > budget * gc_peak:
            continue
        if other.get("grad_err") and other["grad_err"]["mean"] > rival_tolerance(report):
            continue
        out.append(other)
    return out


def _versus(report, me: dict, other: dict) -> dict[str, Any]:
    out = {"run": label(other)}
    for key, metric in (("wall", "wall_s"), ("cpu", "cpu_s")):
        mine, theirs = samples(report, timed(me), timed(other), metric)
        out[key] = paired.compare(mine, theirs)
    return out


def best_rival(report: dict[str, Any], me: dict[str, Any], rivals: list[dict]) -> str | None:
    """The in-budget rival closest to ``me`` by the wall clock's paired rounds: the lowest
    median of its step time over HiLoRe's in the same round (while no round pairs them, the
    fastest median step). Not the fastest median step once rounds exist: on a shared machine
    one run's median can sit in quieter rounds than another's."""
    def closeness(other):
        ratio = _versus(report, me, other)["wall"]["median"]
        return (0, ratio) if ratio is not None else (1, other["step_s"]["median"])
    return label(min(rivals, key=closeness)) if rivals else None


def contenders(report: dict[str, Any], best: str | None, rivals: list[dict]) -> list[str]:
    """``best`` and every in-budget rival the paired rounds have not yet put behind it: while
    two rivals are level with each other, which of them is the best is not known, so HiLoRe's
    comparison with each of them is decisive."""
    if best is None:
        return []
    rows = {label(r): r for r in rivals}
    return [best] + [name for name, row in rows.items() if name != best
                     and _versus(report, rows[best], row)["wall"]["verdict"] != "ahead"]


def decisive(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ``hilore`` row: its comparisons with ``gc``, ``static`` at its budget, the best
    in-budget rival (``best_rival``) and every rival still level with that one (``contenders``),
    by the wall clock, each with ``decided``."""
    out = []
    for me in [r for r in report["runs"] if r["method"] == "hilore" and r.get("step_s")]:
        rivals = _in_budget(report, me)
        best = best_rival(report, me, rivals)
        rows = {label(r): r for r in report["runs"] if r.get("step_s")}
        names = ["gc", f"static@{me['budget']:g}", *contenders(report, best, rivals)]
        for name in dict.fromkeys(names):
            if name in rows:
                c = _versus(report, me, rows[name])["wall"]
                out.append({"run": label(me), "rival": name, "best_rival": name == best, **c})
    return out


def _gap_met(gap: dict[str, Any]) -> bool | None:
    if gap["low"] is None:
        return None
    if gap["low"] >= GAP_CLOSED:
        return True
    return False if gap["high"] < GAP_CLOSED else None


def _all_ahead(rivals: list[dict], key: str) -> bool | None:
    verdicts = [r[key]["verdict"] for r in rivals]
    if all(v == "ahead" for v in verdicts):
        return True
    undecided = [r for r in rivals if not r[key]["decided"]]
    return None if undecided and "behind" not in verdicts else False


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One verdict per budget with a timed ``hilore`` row (see the module docstring)."""
    fixed = {r["method"]: r for r in report["runs"] if r["budget"] is None and r.get("step_s")}
    gc_peak = report["gc_peak_bytes"]
    gc_flops = (fixed.get("gc") or {}).get("recomputed_flops")
    out = []
    for me in [r for r in report["runs"] if r["method"] == "hilore" and r.get("step_s")]:
        budget = me["budget"]
        err = me["grad_err"]["mean"] if me.get("grad_err") else None
        flops = (None if not gc_flops or me.get("recomputed_flops") is None
                 else 1.0 - me["recomputed_flops"] / gc_flops)
        gap = paired.gap_closed(*_three(report, timed(me), "wall_s"))
        gap_cpu = paired.gap_closed(*_three(report, timed(me), "cpu_s"))
        rivals = [_versus(report, me, other) for other in _in_budget(report, me)]
        checks = [d for d in decisive(report) if d["run"] == label(me)]
        met = {
            "peak": me["peak_bytes"] <= budget * gc_peak,
            "grad_err": None if err is None else err <= ERROR_TOLERANCE,
            "flops_avoided": None if flops is None else flops >= FLOPS_AVOIDED,
            "gap_closed": _gap_met(gap), "gap_closed_cpu": _gap_met(gap_cpu),
            "ahead_of_rivals": _all_ahead(rivals, "wall") if rivals else None,
            "ahead_of_rivals_cpu": _all_ahead(rivals, "cpu") if rivals else None,
        }
        out.append({"budget": budget, "peak_ratio": me["peak_bytes"] / gc_peak,
                    "grad_err_mean": err, "flops_avoided": flops, "gap_closed": gap,
                    "gap_closed_cpu": gap_cpu, "rivals": rivals, "decisive": checks,
                    "undecided": [c["rival"] for c in checks if not c["decided"]],
                    "best_rival": next((c["rival"] for c in checks if c["best_rival"]), None),
                    "met": met})
    return out


def _yes(value) -> str:
    return "undecided" if value is None else ("met" if value else "MISSED")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def standing(c: dict[str, Any]) -> str:
    """"ahead (95 % CI 1.02-1.08)", "level (95 % CI ...)", or "level (too few rounds for a
    95 % interval)"."""
    if c["low"] is None:
        return f"{c['verdict']} (too few rounds for a 95 % interval: {c['n']})"
    return f"{c['verdict']} (x{c['median']:.3f}, 95 % CI {c['low']:.3f}-{c['high']:.3f})"


def _gap_text(gap: dict[str, Any]) -> str:
    if gap["median"] is None:
        return "-"
    ci = "" if gap["low"] is None else f", 95 % CI {gap['low']:.2f} to {gap['high']:.2f}"
    return f"{gap['median']:.2f}{ci}"


def targets_text(verdicts: list[dict[str, Any]]) -> str:
    """The verdicts as lines for the bench's table."""
    lines = []
    for v in verdicts:
        met, tag = v["met"], f"hilore@{v['budget']:g}"
        lines.append(
            f"targets, {tag}: peak {v['peak_ratio']:.3f}x GC ({_yes(met['peak'])}); "
            f"step grad err {_num(v['grad_err_mean'], '.4f')} <= {ERROR_TOLERANCE} "
            f"({_yes(met['grad_err'])}); recomputed FLOPs avoided {_num(v['flops_avoided'], '.0%')} "
            f">= {FLOPS_AVOIDED:.0%} ({_yes(met['flops_avoided'])}); gap closed "
            f"{_gap_text(v['gap_closed'])} wall ({_yes(met['gap_closed'])}) / "
            f"{_gap_text(v['gap_closed_cpu'])} cpu ({_yes(met['gap_closed_cpu'])}) >= {GAP_CLOSED}")
        for r in v["rivals"]:
            lines.append(f"  {tag} vs {r['run']}: {standing(r['wall'])} wall; "
                         f"{standing(r['cpu'])} cpu")
        lines.append(f"  {tag}: ahead of all {len(v['rivals'])} in-budget rivals: "
                     f"{_yes(met['ahead_of_rivals'])} wall, {_yes(met['ahead_of_rivals_cpu'])} cpu"
                     + (f"; best in-budget rival: {v['best_rival']}" if v["best_rival"] else "")
                     + (f"; left undecided: {', '.join(v['undecided'])}" if v["undecided"] else
                        "; decisive comparisons decided"))
    return "\n".join(lines)
