"""Reading a ``hilore bench`` report: the table (with each run's paired speed against GC), the
whole run's accounting (``run_text``), the plot (peak memory against speed, and each run's
paired speed against GC), and ``--report`` (a saved report printed again; several reports side
by side: ``across_runs``).

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
from ds_hilore.bench.summary import efficiency
from ds_hilore.bench.targets import (default_tolerance, label, samples, targets, targets_text,
                                    timed)

__all__ = ["BenchReportError", "across_runs", "draw", "plot", "plot_run", "run_text", "show", "table",
           "text"]

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


_LEGEND = (
    "tok/s: tokens per second of the whole step, every rank's tokens (fwd + loss + bwd per "
    "microbatch, the optimizer step), the step's time the slowest rank's; vs GC: median over "
    "rounds of t_gc / t in the same round, 95 % interval of the signed-rank test (none below 6 "
    "rounds); peak: the largest rank's, whole process, act: above the step's start; fits: peak "
    "<= budget x GC peak; step err: ||g - g_nogc|| / ||g_nogc|| of the step's gradient summed "
    "over ranks, mb err: per microbatch; gap: (t_gc - t) / (t_gc - t_nogc) of medians; recomp "
    "GF: a step's fwd+bwd GFLOPs above nogc's, microbatch by microbatch, every rank's "
    "(FlopCounterMode; one that runs fewer counts 0).")


def _mix(r) -> str:
    mix = "".join(f"{a}{n}" for a, n in (r.get("plan_mix") or {}).items()) or "-"
    if (r.get("held_bytes") or {}).get("L"):
        mix += f" L {r['held_bytes']['L'] / MiB:.1f} MiB packed"
    if r.get("note"):
        mix += f" ({r['note']})"
    if r.get("warmed") is False:
        mix += " (warm-up stopped at its cap, still planning)"
    return mix


def _err(errors) -> str:
    return "-" if not errors else f"{errors['mean']:.2e}"


def _row_line(r, gc_peak: int) -> str:
    budget = "-" if r["budget"] is None else f"{r['budget']:g}"
    if r.get("skipped"):
        return f"{r['method']:<14} {budget:>6} | skipped: {r['skipped']}"
    if not r.get("tokens_per_s") or r.get("peak_bytes") is None:
        return f"{r['method']:<14} {budget:>6} | not measured (the bench stopped before)"
    t = r["tokens_per_s"]
    ge, gm = (_err(r.get(k)) for k in ("grad_err", "grad_err_microbatch"))
    fits = "-" if r["within_budget"] is None else ("yes" if r["within_budget"] else "NO")
    gap = "-" if r["gap_closed"] is None else f"{r['gap_closed']:.2f}"
    rf = "-" if r.get("recomputed_flops") is None else f"{r['recomputed_flops'] / 1e9:.2f}"
    return (f"{r['method']:<14} {budget:>6} | {t['median']:>10.1f} {t['min']:>9.1f} "
            f"{t['max']:>9.1f} | {_vs_gc(r):>23} | {r['peak_bytes'] / MiB:>8.1f} "
            f"{r['peak_bytes'] / gc_peak:>5.2f} {r['activation_peak_bytes'] / MiB:>8.2f} "
            f"{fits:>4} | {ge:>9} {gm:>9} | {gap:>6} "
            f"{r['cpu_s']['median']:>6.2f} {rf:>9} | {_mix(r)}")


def _setup_line(report) -> str | None:
    cfg = report.get("config", {})
    if "ranks" not in cfg:  # reports written before the bench ran DeepSpeed engines
        return None
    return (f"{cfg['ranks']} rank(s), DeepSpeed ZeRO-{cfg['zero_stage']}, {cfg['device']}, "
            f"{cfg['dtype']}; data laid out {cfg['layout']}"
            + (", A = 0 completions dropped" if cfg.get("drop_zero_advantage") else "")
            + ("; exposure predicted before each forward (--predict)" if cfg.get("predict")
               else "; no exposure predicted (a plain actor update)"))


def _notes(report) -> list[str]:
    """The lines under the table: setup, error budget, elision, codec fallbacks, regime,
    rounds, the machinery's efficiency."""
    cfg = report.get("config", {})
    lines = [_setup_line(report)]
    tolerance = cfg.get("grad_error_tolerance")
    if tolerance is not None:  # reports written before the flag do not say
        lines.append(f"HiLoRe's error budget (grad_error_tolerance): {tolerance:g} of the step's "
                     "gradient")
    if cfg.get("elide_zero_rows", "auto") != "auto":
        lines.append(_ELISION_LINES[cfg["elide_zero_rows"]])
    failed = report.get("host", {}).get("codec_compile_failures")
    if failed:
        lines.append("codec kernels whose torch.compile failed, run eager (L's figures are the "
                     "eager codec's): " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    lines += [_regime_line(report), _stop_line(report)]
    for key, ratio in efficiency(report).items():
        forced, ref = key.split("_vs_")
        lines.append(f"runtime efficiency: {forced} runs at {ratio:.2f}x the throughput of {ref}")
    return [line for line in lines if line]


def table(report) -> str:
    """The paired mode's table, the lines under it, HiLoRe's targets and the legend."""
    gc_peak = report["gc_peak_bytes"]
    head = (f"{'method':<14} {'budget':>6} | {'tok/s med':>10} {'min':>9} {'max':>9} | "
            f"{'vs GC paired [95% CI]':>23} | {'peak MiB':>8} {'x GC':>5} {'act MiB':>8} {'fits':>4} | "
            f"{'step err':>9} {'mb err':>9} | {'gap':>6} {'cpu s':>6} {'recomp GF':>9} | mix")
    lines = [head, "-" * len(head)] + [_row_line(r, gc_peak) for r in report["runs"]]
    if gc_peak:
        lines.append(f"GC peak {gc_peak / MiB:.1f} MiB (whole process); HiLoRe profiling + "
                     f"calibration + leave-one-out (not in the timed steps): "
                     f"{report['profile_s']:.2f} s")
    lines += _notes(report)
    verdicts = targets_text(targets(report)) if gc_peak else ""
    if verdicts:
        lines.append(verdicts)
    lines.append(_LEGEND)
    return "\n".join(lines)


def run_text(report) -> str:
    """The whole run (``--run-steps``): per run its update time against GC's and, for HiLoRe's
    allocators, the warm-up's steps and seconds and the steady paired ratio
    (NOTE [ The whole run's accounting ] in summary.py)."""
    run, cfg = report["run"], report["config"]
    steps = run["steps"]
    lines = [f"whole run: {len(steps)} of {cfg['run_steps']} optimizer steps of every run, from "
             f"fresh engines, lengths {sorted(set(run['lengths']))} (each step the slowest "
             "rank's time)", _setup_line(report) or ""]
    for name, r in run["runs"].items():
        ratio = ("-" if not r["time_over_gc"] else  # speed over GC's, as every other ratio
                 f"x{1 / r['time_over_gc']:.3f} vs GC (its time {r['time_over_gc']:.3f}x GC's)")
        line = f"  {name:<16} update {r['update_s']:8.2f} s = {ratio}"
        if "warm_up_s" in r:
            steady = r["steady"]
            line += (f"; warm-up {len(r['warm_up_steps'])} step(s), {r['warm_up_s']:+.2f} s "
                     f"against GC on the same steps; steady from step {r['steady_from']}: "
                     + ("-" if steady["median"] is None else
                        f"x{steady['median']:.3f} vs GC" + (
                            "" if steady["low"] is None else
                            f" (95 % CI {steady['low']:.3f}-{steady['high']:.3f}, "
                            f"{steady['verdict']})")))
        lines.append(line)
    lines.append("update: the sum of the run's step times; x vs GC: GC's update time over its "
                 "(one run: no interval); "
                 "warm-up: the steps whose HiLoRe stats show profiling, planning, calibration or "
                 "leave-one-out, and the sum over them of the run's time minus GC's; steady: "
                 "median over the later steps of t_gc / t, with the signed-rank interval.")
    return "\n".join(line for line in lines if line)


_STYLE = ["C0o", "C1s", "C2D", "C3^", "C4v", "C5<", "C6>", "C7p", "C8P", "C9X", "k*", "mh", "yH"]


def _style(methods: list[str], method: str) -> tuple[str, str]:
    style = _STYLE[methods.index(method) % len(_STYLE)]
    return style[:-1], style[-1]


def _name(r) -> str:
    """A run as a plot labels it: "hilore, budget 1.1x GC"."""
    return r["method"] if r["budget"] is None else f"{r['method']}, budget {r['budget']:g}x GC"


def _frontier(ax, report, methods) -> None:
    """Peak memory against speed, one point per run (its min-max over rounds as a bar), named
    in the legend (no text on the points: runs close together would overlap)."""
    for r in report["runs"]:
        if not r.get("tokens_per_s") or r.get("peak_bytes") is None:
            continue
        color, marker = _style(methods, r["method"])
        t = r["tokens_per_s"]
        ax.errorbar([r["peak_bytes"] / MiB], [t["median"]], capsize=3, color=color, fmt=marker,
                    yerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]], label=_name(r),
                    markerfacecolor="none" if r["budget"] is None else color)
    for b in report["config"]["budgets"]:
        ax.axvline(b * report["gc_peak_bytes"] / MiB, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("peak memory, whole process (MiB); dotted: each budget x GC's peak")
    ax.set_ylabel("tokens / s (median over rounds, min-max)")
    ax.legend(fontsize=8, loc="best")


def _paired_panel(ax, report, methods) -> None:
    rows = [r for r in report["runs"] if ((r.get("vs_gc") or {}).get("wall") or {}).get("median")
            is not None]
    for y, r in enumerate(rows):
        color, marker = _style(methods, r["method"])
        c = r["vs_gc"]["wall"]
        err = None if c["low"] is None else [[c["median"] - c["low"]], [c["high"] - c["median"]]]
        ax.errorbar([c["median"]], [y], xerr=err, fmt=marker, color=color, capsize=3)
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_name(r) for r in rows], fontsize=8)
    ax.set_ylim(-0.5, len(rows) - 0.5)
    ax.set_xlabel("speed vs GC, paired by round (median, 95 % CI)")


def _tolerance_note(cfg) -> str:
    """", grad_error_tolerance X" where a report's error budget is not HiLoRe's default."""
    tolerance = cfg.get("grad_error_tolerance")
    return ("" if tolerance is None or tolerance == default_tolerance()
            else f", grad_error_tolerance {tolerance:g}")


def _title(report) -> str:
    cfg = report["config"]
    ranks = f", {cfg['ranks']} rank(s), ZeRO-{cfg['zero_stage']}" if "ranks" in cfg else ""
    return (f"{cfg['model']}: {cfg['micro_batch']} sequences of {cfg['seq_len']} tokens per "
            f"microbatch, {cfg.get('grad_accum', 1)} microbatches per rank and step{ranks}, "
            f"{cfg['dtype']} on {cfg['device']}\n{len(report.get('rounds', []))} paired rounds"
            f"{_tolerance_note(cfg)}")


def plot(report, path: str) -> None:
    """The paired mode's plot: peak memory against speed, and each run's paired speed against
    GC with its interval, beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(report["runs"])
    fig, (ax, side) = plt.subplots(1, 2, figsize=(13, max(5.5, 0.35 * rows + 2)),
                                   gridspec_kw={"width_ratios": [3, 2]})
    methods = list(dict.fromkeys(r["method"] for r in report["runs"]))
    _frontier(ax, report, methods)
    _paired_panel(side, report, methods)
    fig.suptitle(_title(report), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_run(report, path: str) -> None:
    """The whole run's plot: each run's step times in order, its warm-up steps marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = report["run"]
    steps = run["steps"]
    fig, ax = plt.subplots(figsize=(12, 5))
    methods = list(run["runs"])
    for name in methods:
        color, marker = _style(methods, name)
        ax.plot(range(len(steps)), [s["wall_s"][name] for s in steps], color=color,
                marker=marker, markersize=4, linewidth=1, label=name)
        warm = run["runs"][name].get("warm_up_steps") or []
        ax.plot(warm, [steps[i]["wall_s"][name] for i in warm], linestyle="none", marker="o",
                markersize=10, markerfacecolor="none", color=color)
    ax.set_xlabel("optimizer step (circled: the run's warm-up steps)")
    ax.set_ylabel("step time, slowest rank (s)")
    ax.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']}: the whole run, {len(steps)} steps, lengths "
                 f"{sorted(set(run['lengths']))}, {cfg['ranks']} rank(s), ZeRO-"
                 f"{cfg['zero_stage']}, {cfg['dtype']} on {cfg['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def text(report) -> str:
    """What the bench prints of a report: the whole run's accounting, or the paired table."""
    return run_text(report) if "run" in report else table(report)


def draw(report, path: str) -> None:
    """The report's plot (``plot_run`` or ``plot``) at ``path``."""
    (plot_run if "run" in report else plot)(report, path)


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
            text(report)
        elif "run" in report:
            raise ValueError("a whole-run report (--run-steps); several reports side by side "
                             "are paired-mode reports")
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
    print(text(reports[0]) if len(reports) == 1 else across_runs(reports, paths))
    if plot_path:
        draw(reports[0], plot_path)
        print(f"hilore bench: wrote {plot_path}", file=sys.stderr, flush=True)
    return 0
