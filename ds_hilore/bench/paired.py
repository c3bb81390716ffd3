"""Paired comparisons of ``hilore bench`` rounds: ratios, intervals and verdicts (plain functions).

Every round runs every method once, back to back, on the same microbatches, so the methods of
one round see nearly the same machine load. A comparison of method ``a`` against method ``b``
therefore works on the per-round ratios ``t_b / t_a`` (above 1: ``a`` is faster), never on
unpaired summaries of each method's own spread.

NOTE [ Paired intervals: the signed-rank inversion ]
The 95 % interval of a comparison is the distribution-free interval of the Wilcoxon signed-rank
test, inverted (Hodges-Lehmann; Hollander & Wolfe, "Nonparametric Statistical Methods", 3.2):
on the log-ratios d_i, sort the n(n+1)/2 Walsh averages (d_i + d_j) / 2, i <= j, and take the
k-th smallest and k-th largest, where k is the largest integer with P(W+ <= k - 1) <= 2.5 % under
the exact null distribution of the signed-rank statistic W+ (counted, not approximated). The
interval is exact for any continuous, symmetric distribution of the log-ratios, needs no seed
(the same samples always give the same interval) and does not pretend to certainty with few
rounds: below 6 rounds no 95 % interval exists (the most extreme outcome has probability
2 / 2^n > 5 %), and the comparison is reported "level" and undecided. The point estimate shown
is the median paired ratio; the Hodges-Lehmann estimate (median of the Walsh averages) is kept
alongside it.

Verdicts: "ahead" only when the whole interval lies above 1, "behind" when it lies below 1,
"level" otherwise. A comparison is *decided* when its interval excludes 1, or when it lies inside
[1 / (1 + LEVEL_MARGIN), 1 + LEVEL_MARGIN] (level within 1 %): more rounds would not change what
it says.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

__all__ = ["CONFIDENCE", "LEVEL_MARGIN", "MIN_ROUNDS", "compare", "gap_closed", "location_interval",
           "paired_ratios", "verdict"]

CONFIDENCE = 0.95
LEVEL_MARGIN = 0.01  # an interval inside +-1 % of 1 decides "level"
MIN_ROUNDS = 6  # the fewest rounds that can give a 95 % signed-rank interval


def paired_ratios(mine: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """Per-round ``theirs[i] / mine[i]`` (step times: above 1, ``mine`` is faster)."""
    if len(mine) != len(theirs):
        raise ValueError(f"paired samples differ in length ({len(mine)} vs {len(theirs)})")
    return [b / a if a > 0 else math.nan for a, b in zip(mine, theirs)]  # no time: no ratio


@lru_cache(maxsize=None)
def _signed_rank_cdf(n: int) -> tuple[float, ...]:
    """P(W+ <= w) for w = 0 .. n(n+1)/2 under the null: counts of subsets of {1..n} by sum."""
    top = n * (n + 1) // 2
    counts = [1] + [0] * top
    for rank in range(1, n + 1):
        for w in range(top, rank - 1, -1):
            counts[w] += counts[w - rank]
    total, running, out = 2 ** n, 0, []
    for c in counts:
        running += c
        out.append(running / total)
    return tuple(out)


def _critical_k(n: int, confidence: float) -> int:
    """Largest k with P(W+ <= k - 1) <= (1 - confidence) / 2; 0 when none exists."""
    cdf, tail = _signed_rank_cdf(n), (1.0 - confidence) / 2
    k = 0
    while k < len(cdf) and cdf[k] <= tail + 1e-12:
        k += 1
    return k


def location_interval(values: Sequence[float], confidence: float = CONFIDENCE
                      ) -> tuple[float | None, float | None, float | None]:
    """(Hodges-Lehmann estimate, low, high) of the centre of ``values`` by the signed-rank
    inversion (NOTE [ Paired intervals: the signed-rank inversion ]); low/high None when the
    sample is too small for an interval at ``confidence``."""
    xs = [float(v) for v in values if math.isfinite(v)]
    n = len(xs)
    if n == 0:
        return None, None, None
    walsh = sorted((xs[i] + xs[j]) / 2 for i in range(n) for j in range(i, n))
    estimate = statistics.median(walsh)
    k = _critical_k(n, confidence)
    if k < 1:
        return estimate, None, None
    return estimate, walsh[k - 1], walsh[len(walsh) - k]


def verdict(low: float | None, high: float | None) -> str:
    """"ahead" (interval above 1), "behind" (below 1) or "level" (contains 1, or no interval)."""
    if low is None or high is None:
        return "level"
    if low > 1.0:
        return "ahead"
    if high < 1.0:
        return "behind"
    return "level"


def decided(low: float | None, high: float | None, margin: float = LEVEL_MARGIN) -> bool:
    """The interval excludes 1, or lies within ``margin`` of 1 on both sides."""
    if low is None or high is None:
        return False
    return verdict(low, high) != "level" or (low >= 1 / (1 + margin) and high <= 1 + margin)


def compare(mine: Sequence[float], theirs: Sequence[float],
            confidence: float = CONFIDENCE) -> dict[str, Any]:
    """``mine`` against ``theirs`` (per-round step times): the median paired ratio
    ``theirs / mine``, its interval, the verdict and whether it is decided."""
    ratios = paired_ratios(mine, theirs)
    if not ratios or any(not (0 < r < math.inf) for r in ratios):  # a time not measured
        return {"n": len(ratios), "median": None, "hodges_lehmann": None, "low": None,
                "high": None, "verdict": "level", "decided": False}
    hl, lo, hi = location_interval([math.log(r) for r in ratios], confidence)
    low, high = (None, None) if lo is None else (math.exp(lo), math.exp(hi))
    return {"n": len(ratios), "median": statistics.median(ratios), "hodges_lehmann": math.exp(hl),
            "low": low, "high": high, "verdict": verdict(low, high), "decided": decided(low, high)}


def gap_closed(mine: Sequence[float], gc: Sequence[float], nogc: Sequence[float],
               confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Share of the GC -> no-GC gap closed, per round ``(t_gc - t) / (t_gc - t_nogc)``: its
    median and the signed-rank interval of its centre (rounds where GC was not slower than
    no-GC are left out: the gap is undefined there)."""
    per_round = [(g - t) / (g - n) for t, g, n in zip(mine, gc, nogc) if g > n]
    if not per_round:
        return {"n": 0, "median": None, "low": None, "high": None}
    _, low, high = location_interval(per_round, confidence)
    return {"n": len(per_round), "median": statistics.median(per_round), "low": low, "high": high}
