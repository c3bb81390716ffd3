"""Reading a ``hilore bench`` report: the table (with each run's paired speed against GC), the
frontier plot and its paired panel, min-max overlaps, the runtime's efficiency lines, and
``--report`` (a saved report printed again; several reports side by side: ``across_runs``).

NOTE [ Verdicts across runs ]
One run's interval is over its rounds: the load of the machine from round to round. It does not
cover what changes between runs of the same command -- the plan HiLoRe's profile chooses from
timings it measures, the load over the whole run -- and on a shared CPU, where methods differ by
a few percent, two runs can each decide, on opposite sides. ``--report A.json B.json ...``
puts every run's paired verdicts side by side: a comparison is "ahead in every run" only when
each run's interval lies above 1; anything else is said as counts. The runs are not pooled
into one interval: rounds of different runs are not exchangeable, and a handful of runs is
too few for an interval over runs.
"""

from __future__ import annotations

import json
import sys

from ds_hilore.bench import paired
from ds_hilore.bench.targets import (default_tolerance, label, samples, targets, targets_text,
                                    timed)

__all__ = ["BenchReportError", "across_runs", "efficiency", "overlaps", "plot", "show", "table"]

MiB = 1 << 20


class BenchReportError(Exception):
    """A saved report that cannot be read; one line naming the file."""


_ELISION_LINES = {
    False: "--elide-zero-rows false: no HiLoRe run elided a sequence or skipped a backward",
    True: "--elide-zero-rows true: HiLoRe runs elided every sequence with zero loss "
          "coefficients",
    "whole": "--elide-zero-rows whole: HiLoRe runs elided only microbatches whose every "
             "sequence has "
             "zero loss coefficients, their layers' backward skipped"}


def overlaps(report) -> list[tuple[str, str]]:
    def label(r):
        return r["method"] if r["budget"] is None else f"{r['method']}@{r['budget']:g}"

    timed = [r for r in report["runs"] if r.get("tokens_per_s") and not r.get("measured_once")]
    out = []
    for i, a in enumerate(timed):
        for b in timed[i + 1:]:
            ta, tb = a["tokens_per_s"], b["tokens_per_s"]
            if ta["min"] <= tb["max"] and tb["min"] <= ta["max"]:
                out.append((label(a), label(b)))
    return out


def efficiency(report) -> dict[str, float]:
    """HiLoRe's machinery alone: forced all-R vs gc, forced all-H vs nogc (throughput ratios)."""
    med = {(r["method"], r["budget"]): r["tokens_per_s"]["median"]
           for r in report["runs"] if r.get("tokens_per_s")}
    return {f"{forced}_vs_{ref}": med[(forced, None)] / med[(ref, None)]
            for forced, ref in (("hilore_all_r", "gc"), ("hilore_all_h", "nogc"))
            if (forced, None) in med and (ref, None) in med}


def _vs_gc(row) -> str:
    c = (row.get("vs_gc") or {}).get("wall")
    if not c or c["median"] is None:
        return "-"
    if c["low"] is None:
        return f"{c['median']:.3f} (n={c['n']})"
    return f"{c['median']:.3f} [{c['low']:.3f}-{c['high']:.3f}]"


def _regime_line(report) -> str | None:
    reg = report.get("regime")
    if not reg:
        return None
    peak, share = reg.get("nogc_peak_over_gc"), reg.get("gc_recompute_share")
    return (f"regime: no-GC peak {'-' if peak is None else f'{peak:.2f}'}x GC's (paper: >= 1.5), "
            f"GC's recompute {'-' if share is None else f'{share:.0%}'} of its update's FLOPs "
            f"(>= 25 %), {reg['sequences_per_microbatch']} sequences per microbatch (>= 8), "
            f"{report['config'].get('grad_accum', 1)} microbatches per step")


def _stop_line(report) -> str | None:
    stop, rounds = report.get("stop"), len(report.get("rounds", []))
    if not stop:
        return None
    why = {"rounds": "the requested count", "decided": "every decisive comparison decided",
           "max_minutes": "--max-minutes reached", "running": "the bench still running",
           "interrupted": "interrupted"}.get(stop["reason"], stop["reason"])
    left = f"; left undecided: {', '.join(stop['undecided'])}" if stop.get("undecided") else ""
    return f"{rounds} paired rounds ({why}){left}"


def table(report) -> str:
    gc_peak = report["gc_peak_bytes"]
    head = (f"{'method':<14} {'budget':>6} | {'tok/s med':>10} {'min':>9} {'max':>9} | "
            f"{'vs GC paired [95% CI]':>23} | {'peak MiB':>8} {'x GC':>5} {'act MiB':>8} {'fits':>4} | "
            f"{'step err':>9} {'mb err':>9} | {'gap':>6} {'cpu s':>6} {'recomp GF':>9} | mix")
    lines = [head, "-" * len(head)]
    for r in report["runs"]:
        budget = "-" if r["budget"] is None else f"{r['budget']:g}"
        if r.get("skipped"):
            lines.append(f"{r['method']:<14} {budget:>6} | skipped: {r['skipped']}")
            continue
        t = r["tokens_per_s"]
        nan = {"mean": float("nan"), "max": float("nan")}
        ge, gm = r["grad_err"] or nan, r.get("grad_err_microbatch") or nan
        fits = "-" if r["within_budget"] is None else ("yes" if r["within_budget"] else "NO")
        gap = "-" if r["gap_closed"] is None else f"{r['gap_closed']:.2f}"
        rf = "-" if r["recomputed_flops"] is None else f"{r['recomputed_flops'] / 1e9:.2f}"
        mix = "".join(f"{a}{n}" for a, n in (r["plan_mix"] or {}).items()) or "-"
        if (r.get("held_bytes") or {}).get("L"):
            mix += f" L {r['held_bytes']['L'] / MiB:.1f} MiB packed"
        if r.get("note"):
            mix += f" ({r['note']})"
        if r.get("measured_once"):
            mix += " (same run as first budget)"
        if r.get("warmed") is False:
            mix += " (warm-up stopped at its cap, still planning)"
        lines.append(
            f"{r['method']:<14} {budget:>6} | {t['median']:>10.1f} {t['min']:>9.1f} {t['max']:>9.1f} | "
            f"{_vs_gc(r):>23} | {r['peak_bytes'] / MiB:>8.1f} {r['peak_bytes'] / gc_peak:>5.2f} "
            f"{r['activation_peak_bytes'] / MiB:>8.2f} {fits:>4} | {ge['mean']:>9.2e} {gm['mean']:>9.2e} | "
            f"{gap:>6} {r['cpu_s']['median']:>6.2f} {rf:>9} | {mix}")
    lines.append(f"GC peak {gc_peak / MiB:.1f} MiB (whole process); HiLoRe profiling + calibration "
                 f"+ leave-one-out (not in the timed steps): {report['profile_s']:.2f} s")
    tolerance = report.get("config", {}).get("grad_error_tolerance")
    if tolerance is not None:  # reports written before the flag do not say
        lines.append(f"HiLoRe's error budget (grad_error_tolerance): {tolerance:g} of the step's "
                     "gradient")
    elision = report.get("config", {}).get("elide_zero_rows", "auto")
    if elision != "auto":
        lines.append(_ELISION_LINES[elision])
    failed = report.get("host", {}).get("codec_compile_failures")
    if failed:
        lines.append("codec kernels whose torch.compile failed, run eager (L's figures are the "
                     "eager codec's): " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    for line in (_regime_line(report), _stop_line(report)):
        if line:
            lines.append(line)
    for key, ratio in efficiency(report).items():
        forced, ref = key.split("_vs_")
        lines.append(f"runtime efficiency: {forced} runs at {ratio:.2f}x the throughput of {ref}")
    verdicts = targets_text(targets(report))
    if verdicts:
        lines.append(verdicts)
    lines.append("tok/s: tokens per second of the whole step (fwd + loss + bwd per microbatch, "
                 "AdamW); vs GC: median over rounds of t_gc / t in the same round, 95 % interval "
                 "of the signed-rank test (none below 6 rounds); peak: whole process, act: above "
                 "the step's start; fits: peak <= budget x GC peak; step err: ||g - g_nogc|| / "
                 "||g_nogc|| of the step's accumulated gradient, mb err: per microbatch; gap: "
                 "(t_gc - t) / (t_gc - t_nogc) of medians; recomp GF: a step's fwd+bwd GFLOPs "
                 "above nogc's, microbatch by microbatch (FlopCounterMode; one that runs fewer "
                 "counts 0).")
    return "\n".join(lines)


_STYLE = ["C0o", "C1s", "C2D", "C3^", "C4v", "C5<", "C6>", "C7p", "C8P", "C9X", "k*", "mh", "yH"]


def _frontier(ax, report, methods) -> None:
    for i, m in enumerate(methods):
        rows = [r for r in report["runs"] if r["method"] == m and r.get("tokens_per_s")]
        if not rows:
            continue
        color, marker = _STYLE[i % len(_STYLE)][:-1], _STYLE[i % len(_STYLE)][-1]
        xs = [r["peak_bytes"] / MiB for r in rows]
        ys = [r["tokens_per_s"]["median"] for r in rows]
        lo = [r["tokens_per_s"]["median"] - r["tokens_per_s"]["min"] for r in rows]
        hi = [r["tokens_per_s"]["max"] - r["tokens_per_s"]["median"] for r in rows]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=marker, color=color, capsize=3, label=m)
        for r, x, y in zip(rows, xs, ys):
            if r["budget"] is not None:
                ax.annotate(f"{r['budget']:g}", (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    for b in report["config"]["budgets"]:
        ax.axvline(b * report["gc_peak_bytes"] / MiB, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("peak memory, whole process (MiB); dotted: budget x GC peak")
    ax.set_ylabel("tokens / s (median, min-max)")
    ax.legend(fontsize=7, ncol=2)


def _paired_panel(ax, report, methods) -> None:
    rows = [r for r in report["runs"] if (r.get("vs_gc") or {}).get("wall")
            and r["vs_gc"]["wall"]["median"] is not None and not r.get("measured_once")]
    for y, r in enumerate(rows):
        i = methods.index(r["method"])
        color, marker = _STYLE[i % len(_STYLE)][:-1], _STYLE[i % len(_STYLE)][-1]
        c = r["vs_gc"]["wall"]
        err = None if c["low"] is None else [[c["median"] - c["low"]], [c["high"] - c["median"]]]
        ax.errorbar([c["median"]], [y], xerr=err, fmt=marker, color=color, capsize=3)
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["method"] if r["budget"] is None else f"{r['method']}@{r['budget']:g}"
                        for r in rows], fontsize=7)
    ax.set_xlabel("speed vs GC, paired (median, 95 % CI); > 1: faster")


def _tolerance_note(cfg) -> str:
    """", grad_error_tolerance X" where a report's error budget is not HiLoRe's default."""
    tolerance = cfg.get("grad_error_tolerance")
    return ("" if tolerance is None or tolerance == default_tolerance()
            else f", grad_error_tolerance {tolerance:g}")


def plot(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, side) = plt.subplots(1, 2, figsize=(12, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    methods = list(dict.fromkeys(r["method"] for r in report["runs"]))
    _frontier(ax, report, methods)
    _paired_panel(side, report, methods)
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']}, {cfg['micro_batch']}x{cfg['seq_len']}"
                 f"{' x' + str(cfg['grad_accum']) if cfg.get('grad_accum') else ''}, {cfg['dtype']}, "
                 f"{cfg['device']}, {len(report.get('rounds', []))} paired rounds"
                 f"{_tolerance_note(cfg)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def across_runs(reports: list[dict], names: list[str]) -> str:
    """Each ``hilore`` row's paired verdicts by the wall clock in every report, side by side,
    with how many runs said what (NOTE [ Verdicts across runs ])."""
    n = len(reports)
    lines = [f"{n} runs, each compared over its own paired rounds (wall clock): the median ratio",
             "of the rival's step time over hilore's, the 95 % CI of the run's signed-rank test;",
             "'over budget': the rival's peak or error was outside hilore's budget in that run"]
    lines += [f"  run {i + 1}: {name} ({len(r.get('rounds', []))} rounds"
              f"{_tolerance_note(r.get('config', {}))})" for i, (name, r) in enumerate(zip(names, reports))]
    mine = list(dict.fromkeys(label(row) for r in reports for row in r["runs"]
                              if row["method"] == "hilore" and row.get("step_s")))
    rivals = list(dict.fromkeys(label(row) for r in reports for row in r["runs"]
                                if row["method"] != "hilore" and row.get("step_s")))
    timed_rows = [{label(row): row for row in r["runs"] if row.get("step_s")} for r in reports]
    in_budget = [{f"hilore@{v['budget']:g}": {c["run"] for c in v["rivals"]} for v in targets(r)}
                 for r in reports]  # per report: hilore's label -> the rivals within its budget
    for me in mine:
        lines.append(f"{me} vs")
        for rival in rivals:
            cells, said = [], []
            for report, rows, fits in zip(reports, timed_rows, in_budget):
                if me not in rows or rival not in rows:
                    cells.append("-")
                    continue
                c = paired.compare(*samples(report, timed(rows[me]), timed(rows[rival]), "wall_s"))
                said.append(c["verdict"])
                interval = (f" [{c['low']:.3f}-{c['high']:.3f}]" if c["low"] is not None else "")
                cells.append((f"{c['verdict']} x{c['median']:.3f}{interval}"
                              if c["median"] is not None else "no paired rounds")
                             + ("" if rival in fits.get(me, ()) else " over budget"))
            lines.append(f"  {rival:<14} " + " | ".join(cells) + f"  => {_agreement(said, n)}")
    return "\n".join(lines)


def _agreement(said: list[str], n: int) -> str:
    """What ``said`` (one verdict per run that has both rows) adds up to, over ``n`` runs."""
    runs = "runs" if len(said) == n else f"runs with it ({len(said)} of {n})"
    if not said:
        return "in no run"
    if len(set(said)) == 1:
        return f"{said[0]} in every run" if len(said) == n else f"{said[0]} in all {runs}"
    counts = ", ".join(f"{v} in {said.count(v)}" for v in ("ahead", "level", "behind") if v in said)
    return f"{counts} of {len(said)} {runs}"


def _load(report_path: str, alone: bool) -> dict:
    """A saved report, checked by rendering what ``show`` prints of it (``alone``: its table;
    else its part of ``across_runs``)."""
    try:
        with open(report_path, encoding="utf-8") as handle:
            report = json.load(handle)
        if alone:
            table(report)
        else:
            across_runs([report], [report_path])
        return report
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[:1]
        raise BenchReportError(f"--report {report_path}: not a readable hilore bench report "
                               f"({type(error).__name__}{': ' + reason[0][:200] if reason else ''})"
                               ) from None


def show(report_paths: list[str] | str, plot_path: str | None) -> int:
    """``--report``: the table (with the targets) of a saved report, ``--plot`` redraws it;
    several reports: their verdicts side by side (``across_runs``)."""
    paths = [report_paths] if isinstance(report_paths, str) else list(report_paths)
    if len(paths) > 1 and plot_path:
        raise BenchReportError(f"--plot {plot_path}: redraws one report; give --report one file "
                               f"(got {len(paths)})")
    reports = [_load(path, alone=len(paths) == 1) for path in paths]
    print(table(reports[0]) if len(reports) == 1 else across_runs(reports, paths))
    if plot_path:
        plot(reports[0], plot_path)
        print(f"hilore bench: wrote {plot_path}", file=sys.stderr, flush=True)
    return 0
