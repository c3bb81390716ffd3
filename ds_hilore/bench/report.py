"""Reading a ``hilore bench`` report: the table, the frontier plot, overlapping ranges, the
runtime's efficiency lines, and ``--report`` (a saved report printed again)."""

from __future__ import annotations

import json
import sys

from ds_hilore.bench.targets import targets, targets_text

__all__ = ["BenchReportError", "efficiency", "overlaps", "plot", "show", "table"]

MiB = 1 << 20


class BenchReportError(Exception):
    """A saved report that cannot be read; one line naming the file."""


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


def table(report) -> str:
    gc_peak = report["gc_peak_bytes"]
    head = (f"{'method':<14} {'budget':>6} | {'tok/s med':>10} {'min':>9} {'max':>9} | "
            f"{'peak MiB':>8} {'x GC':>5} {'act MiB':>8} {'fits':>4} | {'grad err mean':>13} "
            f"{'max':>9} | {'gap':>6} {'cpu s':>6} {'recomp GF':>9} | mix")
    lines = [head, "-" * len(head)]
    for r in report["runs"]:
        budget = "-" if r["budget"] is None else f"{r['budget']:g}"
        if r.get("skipped"):
            lines.append(f"{r['method']:<14} {budget:>6} | skipped: {r['skipped']}")
            continue
        t, ge = r["tokens_per_s"], r["grad_err"] or {"mean": float("nan"), "max": float("nan")}
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
        lines.append(
            f"{r['method']:<14} {budget:>6} | {t['median']:>10.1f} {t['min']:>9.1f} {t['max']:>9.1f} | "
            f"{r['peak_bytes'] / MiB:>8.1f} {r['peak_bytes'] / gc_peak:>5.2f} "
            f"{r['activation_peak_bytes'] / MiB:>8.2f} {fits:>4} | {ge['mean']:>13.3e} {ge['max']:>9.2e} | "
            f"{gap:>6} {r['cpu_s']['median']:>6.2f} {rf:>9} | {mix}")
    lines.append(f"GC peak {gc_peak / MiB:.1f} MiB (whole process); HiLoRe profiling + calibration "
                 f"+ leave-one-out (not in the timed steps): {report['profile_s']:.2f} s")
    for key, ratio in efficiency(report).items():
        forced, ref = key.split("_vs_")
        lines.append(f"runtime efficiency: {forced} runs at {ratio:.2f}x the throughput of {ref}")
    pairs = overlaps(report)
    if pairs:
        near = [f"{a} ~ {b}" for a, b in pairs if {a, b} & {"gc", "nogc"}]
        lines.append(f"min-max throughput ranges overlap for {len(pairs)} pairs of runs (not "
                     "distinguishable at this repeat count; all in the JSON's \"overlaps\")"
                     + (": with gc / nogc: " + ", ".join(near) if near else ""))
    verdicts = targets_text(targets(report))
    if verdicts:
        lines.append(verdicts)
    lines.append("tok/s: tokens per second of the whole update (fwd + loss + bwd + AdamW); peak: "
                 "whole process, act: above the step's start; fits: peak <= budget x GC peak; grad "
                 "err: ||g - g_nogc|| / ||g_nogc||; gap: (t_gc - t) / (t_gc - t_nogc); recomp GF: "
                 "fwd+bwd GFLOPs above nogc's (FlopCounterMode).")
    return "\n".join(lines)


def plot(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = "osD^v<>pPX*hH"
    methods = list(dict.fromkeys(r["method"] for r in report["runs"]))
    for i, m in enumerate(methods):
        rows = [r for r in report["runs"] if r["method"] == m and r.get("tokens_per_s")]
        if not rows:
            continue
        xs = [r["peak_bytes"] / MiB for r in rows]
        ys = [r["tokens_per_s"]["median"] for r in rows]
        lo = [r["tokens_per_s"]["median"] - r["tokens_per_s"]["min"] for r in rows]
        hi = [r["tokens_per_s"]["max"] - r["tokens_per_s"]["median"] for r in rows]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=markers[i % len(markers)], capsize=3, label=m)
        for r, x, y in zip(rows, xs, ys):
            if r["budget"] is not None:
                ax.annotate(f"{r['budget']:g}", (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    for b in report["config"]["budgets"]:
        ax.axvline(b * report["gc_peak_bytes"] / MiB, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("peak memory, whole process (MiB); dotted: budget x GC peak")
    ax.set_ylabel("tokens / s (median, min-max)")
    cfg = report["config"]
    ax.set_title(f"{cfg['model']}, {cfg['micro_batch']}x{cfg['seq_len']}, {cfg['dtype']}, "
                 f"{cfg['device']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def show(report_path: str, plot_path: str | None) -> int:
    """``--report``: the table (with the targets) of a saved report; ``--plot`` redraws it."""
    try:
        with open(report_path, encoding="utf-8") as handle:
            report = json.load(handle)
        text = table(report)
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[:1]
        raise BenchReportError(f"--report {report_path}: not a readable hilore bench report "
                               f"({type(error).__name__}{': ' + reason[0][:200] if reason else ''})"
                               ) from None
    print(text)
    if plot_path:
        plot(report, plot_path)
        print(f"hilore bench: wrote {plot_path}", file=sys.stderr, flush=True)
    return 0
