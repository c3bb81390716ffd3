"""Two-constraint multiple-choice knapsack (memory, risk), solved by dynamic programming.

The activation-recovery allocator picks, for every decoder layer (a *group*), exactly one
*option*: a joint action for the layer's units, e.g. ``("H", "R")``. Each option saves some
seconds per microbatch (its utility, possibly negative), keeps some bytes alive (memory) and
adds some estimated gradient error (risk). :func:`solve` maximises the total utility subject to
total memory <= ``memory_budget`` and total risk <= ``risk_budget``.

Every group must contain a zero option (memory 0, risk 0: recompute everything), so picking
it everywhere is always feasible and :func:`solve` always has an answer.

Why rounding up keeps feasibility: the budgets are cut into bins of width
``budget / bins`` and every option costs ``ceil(cost / width)`` bins, computed exactly (integer
arithmetic for memory, :class:`fractions.Fraction` for the float risks). A choice whose bins
sum to at most ``bins`` then has ``sum(cost) <= width * sum(ceil(cost / width)) <= budget`` in
exact arithmetic, so the returned solution is feasible in the real problem, never "almost".

What rounding up costs: solutions that fit only thanks to the slack lost to rounding are missed.
:func:`solve` measures that loss by solving again with costs rounded *down*. Every solution
feasible in the real problem is feasible there, so that relaxation's optimum is an upper bound
on the real optimum; ``Solution.bound`` is the gap between the two, and the real optimum lies in
``[utility, utility + bound]``. When every cost is a whole number of bins (e.g. a memory budget
of at most ``memory_bins`` bytes) both roundings agree, the DP is exact and ``bound`` is 0.
When the relaxation's optimum fits the real budgets (checked in exact arithmetic), it reaches
that upper bound: it is the real optimum, and it is returned, with ``bound`` 0. This recovers
what rounding up loses where the budget is nearly spent, e.g. a risk budget of 0.015 in 64
bins and six packed units of 0.00246 each (11 bins rounded up, 66 > 64; 0.01476 exactly).

Caps (optional, one per group): the memory model of a backward, where what a group keeps is
released when its own backward has run. ``caps[g]`` bounds the bytes kept by the groups before
``g`` plus the chosen option's ``own`` bytes (what it adds at its own backward: by default its
whole ``memory``), while ``memory_budget`` bounds the total. Binned like the costs: prefix and
own bytes rounded up, the cap down, so a choice that fits its bins fits its caps exactly; the
rounded-down relaxation keeps every real solution (floor sums never exceed the real ones), so
``bound`` keeps its meaning.

Example::

    zero = Option(("R", "R"), 0.0, 0, 0.0)
    layer = [zero, Option(("H", "R"), 2.0, 100, 0.0), Option(("L", "R"), 1.5, 30, 0.01)]
    sol = solve([layer, layer], memory_budget=150, risk_budget=0.05)
    sol.choice    # -> (1, 2): one layer stored in high precision, one in low precision
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

__all__ = ["Option", "Solution", "brute_force", "solve"]

_TIE_RTOL = 1e-12  # utilities closer than this (relative to the largest total) count as equal
_BRUTE_FORCE_LIMIT = 1_000_000  # combinations brute_force will enumerate before refusing
_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Option:
    """One choice for one group.

    Attributes:
        label: What the caller gets back, e.g. ``("H", "R")``; never inspected here.
        utility: Seconds saved per microbatch (higher is better); may be negative.
        memory: Bytes kept alive, an int >= 0.
        risk: Estimated relative gradient error added, a finite float >= 0.
        own: Bytes that count against the option's own group's cap (see the module's
            docstring), an int in [0, memory]; None: ``memory``.
    """

    label: Any
    utility: float
    memory: int
    risk: float
    own: int | None = None

    @property
    def own_bytes(self) -> int:
        return self.memory if self.own is None else self.own


@dataclass(frozen=True)
class Solution:
    """The chosen option per group and the exact totals of that choice.

    Attributes:
        choice: Index of the chosen option in each group, in group order.
        utility: Exact (undiscretised) sum of the chosen utilities (``math.fsum``).
        memory: Exact sum of the chosen memories, in bytes.
        risk: Exact (``math.fsum``) sum of the chosen risks.
        bound: Upper bound on the utility lost to discretisation: the real optimum lies in
            ``[utility, utility + bound]`` (up to float rounding of the sums). 0 when exact.
    """

    choice: tuple[int, ...]
    utility: float
    memory: int
    risk: float
    bound: float


def solve(groups: Sequence[Sequence[Option]], memory_budget: int, risk_budget: float,
          memory_bins: int = 256, risk_bins: int = 64,
          caps: Sequence[int | None] | None = None) -> Solution:
    """Maximise total utility under a memory and a risk budget, one option per group.

    Costs are rounded up to whole bins (so the answer is feasible in the real problem); options
    that alone exceed a budget are never chosen. Ties: among choices whose utilities agree to
    within ``1e-12`` of the largest possible total, the lower total risk wins, then the lower
    total memory, then the lexicographically smallest ``choice``. Runs in
    ``O(groups * options * memory_bins * risk_bins)``, twice when the bins are not exact (once
    more with costs rounded down, to compute ``bound``; that relaxation's choice is returned
    instead when it fits the real budgets: then it is the exact optimum).

    Args:
        groups: One sequence of :class:`Option` per group; each must contain an option with
            memory 0 and risk 0.
        memory_budget: Total bytes allowed, an int >= 0.
        risk_budget: Total risk allowed, >= 0; ``math.inf`` leaves risk unconstrained.
        memory_bins: Number of memory bins (>= 1). An integer budget smaller than this is
            binned per byte instead, which is exact and no larger.
        risk_bins: Number of risk bins (>= 1).
        caps: None, or one entry per group: an int >= 0 bounding the memory of the groups
            before it plus its chosen option's ``own`` bytes, or None (no cap there).

    Returns:
        The :class:`Solution`: chosen indices, their exact totals and the discretisation bound.

    Raises:
        ValueError: A group has no zero option (the message names the group index), an option
            or budget is malformed (negative, non-finite, non-integer memory, ``own`` outside
            [0, memory]), a cap is malformed or ``caps`` has not one entry per group, or a bin
            count is below 1.

    Example::

        zero = Option("R", 0.0, 0, 0.0)
        sol = solve([[zero, Option("H", 1.0, 8, 0.0)]], memory_budget=10, risk_budget=0.0)
        sol.choice, sol.utility, sol.bound   # -> ((1,), 1.0, 0.0)
    """
    groups, memory_budget, risk_budget = _validate(groups, memory_budget, risk_budget)
    caps = _validate_caps(caps, len(groups))
    for name, bins in (("memory_bins", memory_bins), ("risk_bins", risk_bins)):
        if not isinstance(bins, (int, np.integer)) or bins < 1:
            raise ValueError(f"{name} must be an int >= 1, got {bins!r}")
    if len(groups) * memory_budget > _INT64_MAX:
        raise ValueError(f"memory_budget {memory_budget} x {len(groups)} groups overflows int64")
    # Memory is integral: more bins than bytes buys nothing, and one bin per byte is exact.
    n_mem = min(int(memory_bins), memory_budget)
    # A zero budget admits only zero-cost options, an infinite one constrains nothing: either
    # way the dimension collapses to a single state (and no division by the budget happens).
    n_risk = 0 if risk_budget == 0 or math.isinf(risk_budget) else int(risk_bins)
    tol = _tolerance(groups, memory_budget, risk_budget)

    cap_bins = [None if c is None else (n_mem if not memory_budget else
                                        min(n_mem, c * n_mem // memory_budget)) for c in caps]
    up = _bin_costs(groups, memory_budget, risk_budget, n_mem, n_risk, round_up=True)
    choice = _dp(groups, up, n_mem, n_risk, tol, cap_bins)
    best = _solution(groups, choice, bound=0.0)

    down = _bin_costs(groups, memory_budget, risk_budget, n_mem, n_risk, round_up=False)
    if down == up:  # every cost is a whole number of bins: the DP above was exact
        return best
    relaxed = _solution(groups, _dp(groups, down, n_mem, n_risk, tol, cap_bins), bound=0.0)
    if _fits(groups, relaxed.choice, memory_budget, risk_budget, caps):
        return relaxed  # an upper bound of the real optimum that fits is the real optimum
    return Solution(best.choice, best.utility, best.memory, best.risk,
                    bound=max(0.0, relaxed.utility - best.utility))


def brute_force(groups: Sequence[Sequence[Option]], memory_budget: int,
                risk_budget: float, caps: Sequence[int | None] | None = None) -> Solution:
    """Exact optimum by enumerating every combination (tests and tiny instances only).

    Same validation and tie rule as :func:`solve`; feasibility (``caps`` included) is checked
    on the exact sums.

    Args:
        groups: One sequence of :class:`Option` per group, each with a zero option.
        memory_budget: Total bytes allowed, an int >= 0.
        risk_budget: Total risk allowed, >= 0 (``math.inf``: unconstrained).

    Returns:
        The optimal :class:`Solution`, with ``bound`` 0.0.

    Raises:
        ValueError: As :func:`solve`, or when there are more than 1,000,000 combinations.

    Example::

        zero = Option("R", 0.0, 0, 0.0)
        brute_force([[zero, Option("H", 1.0, 8, 0.5)]], 10, 0.25).choice   # -> (0,)
    """
    groups, memory_budget, risk_budget = _validate(groups, memory_budget, risk_budget)
    caps = _validate_caps(caps, len(groups))
    if math.prod(len(g) for g in groups) > _BRUTE_FORCE_LIMIT:
        raise ValueError(f"brute_force refuses more than {_BRUTE_FORCE_LIMIT} combinations")
    tol = _tolerance(groups, memory_budget, risk_budget)
    best_choice, best_key = None, None
    for choice in itertools.product(*(range(len(g)) for g in groups)):
        picked = [g[i] for g, i in zip(groups, choice)]
        memory = sum(o.memory for o in picked)
        if memory > memory_budget or not _risk_fits([o.risk for o in picked], risk_budget) \
                or not _caps_fit(picked, caps):
            continue
        key = (_dp_order_sum([o.utility for o in picked]),
               _dp_order_sum([o.risk for o in picked]), memory)
        # Strict improvement only, so the first (lexicographically smallest) optimum stays.
        if best_key is None or _better(*key, *best_key, tol):
            best_choice, best_key = choice, key
    return _solution(groups, best_choice, bound=0.0)


def _validate(groups: Sequence[Sequence[Option]], memory_budget: int,
              risk_budget: float) -> tuple[list[list[Option]], int, float]:
    # Reject bad input here, so the DP can assume non-negative finite costs and a zero option;
    # budgets come back as plain int / float (numpy scalars would overflow or upset Fraction).
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, np.integer)) \
            or memory_budget < 0:
        raise ValueError(f"memory_budget must be an int >= 0 (bytes), got {memory_budget!r}")
    if not isinstance(risk_budget, (int, float, np.number)) or math.isnan(risk_budget) \
            or risk_budget < 0:
        raise ValueError(f"risk_budget must be a number >= 0 (or math.inf), got {risk_budget!r}")
    checked = []
    for g, group in enumerate(groups):
        group = list(group)
        for i, o in enumerate(group):
            _validate_option(o, f"group {g} option {i}")
        if not any(o.memory == 0 and o.risk == 0 for o in group):
            raise ValueError(f"group {g} has no zero option (memory 0 and risk 0, i.e. recompute "
                             f"everything); add one so that a feasible choice always exists")
        checked.append(group)
    return checked, int(memory_budget), float(risk_budget)


def _validate_caps(caps: Sequence[int | None] | None, n_groups: int) -> list[int | None]:
    if caps is None:
        return [None] * n_groups
    caps = list(caps)
    if len(caps) != n_groups:
        raise ValueError(f"caps has {len(caps)} entries for {n_groups} groups; one per group")
    for g, c in enumerate(caps):
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0):
            raise ValueError(f"caps[{g}] must be None or an int >= 0 (bytes), got {c!r}")
    return [None if c is None else int(c) for c in caps]


def _caps_fit(picked: Sequence[Option], caps: Sequence[int | None]) -> bool:
    """Every group's cap holds: the memory before it plus its option's own bytes."""
    before = 0
    for o, cap in zip(picked, caps):
        if cap is not None and before + o.own_bytes > cap:
            return False
        before += int(o.memory)
    return True


def _validate_option(o: Any, where: str) -> None:
    if not isinstance(o, Option):
        raise ValueError(f"{where} is not an Option: {o!r}")
    if isinstance(o.memory, bool) or not isinstance(o.memory, (int, np.integer)) or o.memory < 0:
        raise ValueError(f"{where} ({o.label!r}): memory must be an int >= 0, got {o.memory!r}")
    if not math.isfinite(o.risk) or o.risk < 0:
        raise ValueError(f"{where} ({o.label!r}): risk must be finite and >= 0, got {o.risk!r}")
    if not math.isfinite(o.utility):
        raise ValueError(f"{where} ({o.label!r}): utility must be finite, got {o.utility!r}")
    if o.own is not None and (isinstance(o.own, bool) or not isinstance(o.own, (int, np.integer))
                              or not 0 <= o.own <= o.memory):
        raise ValueError(f"{where} ({o.label!r}): own must be None or an int in [0, memory], "
                         f"got {o.own!r}")


def _fits_alone(o: Option, memory_budget: int, risk_budget: float) -> bool:
    return o.memory <= memory_budget and o.risk <= risk_budget


def _tolerance(groups: list[list[Option]], memory_budget: int, risk_budget: float) -> float:
    # Scale by the largest total |utility| any choice can reach, so ties mean the same thing
    # for seconds or milliseconds; shared by solve and brute_force so they break ties alike.
    scale = sum(max((abs(o.utility) for o in g if _fits_alone(o, memory_budget, risk_budget)),
                    default=0.0) for g in groups)
    return _TIE_RTOL * scale


def _better(u, r, m, best_u, best_r, best_m, tol):
    """Whether (u, r, m) beats (best_u, best_r, best_m); works on scalars and numpy arrays."""
    tie = abs(u - best_u) <= tol
    return (u > best_u + tol) | (tie & ((r < best_r) | ((r == best_r) & (m < best_m))))


def _bin_costs(groups: list[list[Option]], memory_budget: int, risk_budget: float,
               n_mem: int, n_risk: int, round_up: bool) -> list[list[tuple[int, int, int] | None]]:
    """Per group and option: (memory bins, risk bins, own bins), or None for options dropped."""
    costs = []
    for group in groups:
        row = []
        for o in group:
            if not _fits_alone(o, memory_budget, risk_budget):
                row.append(None)  # can never be part of a feasible choice
                continue
            # Exact rational arithmetic: a float risk on the bin grid must not gain a bin (or
            # lose one, which would break feasibility) through rounding of risk * bins / budget.
            mem = Fraction(int(o.memory) * n_mem, memory_budget) if n_mem else 0
            own = Fraction(int(o.own_bytes) * n_mem, memory_budget) if n_mem else 0
            risk = Fraction(float(o.risk)) * n_risk / Fraction(risk_budget) if n_risk else 0
            rnd = math.ceil if round_up else math.floor
            row.append((rnd(mem), rnd(risk), rnd(own)))
        costs.append(row)
    return costs


def _dp(groups: list[list[Option]], costs: list[list[tuple[int, int, int] | None]], n_mem: int,
        n_risk: int, tol: float, cap_bins: list[int | None]) -> tuple[int, ...]:
    """Best choice when the chosen bins must sum to at most (n_mem, n_risk) and every group's
    prefix plus own bins to at most its cap.

    Backward over groups, the table f[m, r] holds the best (utility, risk, memory) reachable by
    groups g.. with m memory bins and r risk bins left. Going backward lets the forward
    reconstruction from the full budget take the smallest optimal index at each group, which
    yields the lexicographically smallest optimal choice, as brute_force does. That
    reconstruction reaches group g with the bins of the groups before it spent: n_mem - m, so
    a cap is a lower bound on m (states below it stay -inf: never on a chosen path, since
    all-zero, which spends nothing, fits every cap).
    """
    shape = (n_mem + 1, n_risk + 1)
    f_u, f_r, f_m = np.zeros(shape), np.zeros(shape), np.zeros(shape, dtype=np.int64)
    picks = []
    for group, row, cap in zip(reversed(groups), reversed(costs), reversed(cap_bins)):
        n_u, n_r, n_m = np.full(shape, -np.inf), np.zeros(shape), np.zeros(shape, np.int64)
        pick = np.full(shape, -1, dtype=np.int32)
        for i, (o, cost) in enumerate(zip(group, row)):
            if cost is None or cost[0] > n_mem or cost[1] > n_risk:
                continue
            cm, cr, co = cost
            # States with at least (cm, cr) left -- and, under a cap, with the bins spent before
            # plus this option's own within it -- can take this option; without caps every
            # state is filled by the zero option, which costs no bins.
            low = cm if cap is None else max(cm, n_mem - cap + co)
            if low > n_mem:
                continue
            src = (slice(low - cm, n_mem + 1 - cm), slice(0, n_risk + 1 - cr))
            dst = (slice(low, None), slice(cr, None))
            with np.errstate(invalid="ignore"):  # -inf (capped) states compare as unreachable
                c_u, c_r, c_m = o.utility + f_u[src], o.risk + f_r[src], o.memory + f_m[src]
                better = _better(c_u, c_r, c_m, n_u[dst], n_r[dst], n_m[dst], tol)
            for table, cand in ((n_u, c_u), (n_r, c_r), (n_m, c_m)):
                table[dst][better] = cand[better]
            pick[dst][better] = i
        f_u, f_r, f_m = n_u, n_r, n_m
        picks.append(pick)
    picks.reverse()
    choice, m, r = [], n_mem, n_risk
    for pick, row in zip(picks, costs):
        i = int(pick[m, r])
        choice.append(i)
        m, r = m - row[i][0], r - row[i][1]
    return tuple(choice)


def _dp_order_sum(values: Sequence[float]) -> float:
    # The DP adds group g onto the total of groups g+1..; summing in the same order makes
    # brute_force's tie comparisons bit-identical to the DP's.
    total = 0.0
    for v in reversed(values):
        total = v + total
    return total


def _fits(groups: list[list[Option]], choice: tuple[int, ...], memory_budget: int,
          risk_budget: float, caps: list[int | None]) -> bool:
    """Whether ``choice`` fits both budgets and the caps in exact arithmetic (as
    ``brute_force`` checks)."""
    picked = [g[i] for g, i in zip(groups, choice)]
    return sum(int(o.memory) for o in picked) <= memory_budget and \
        _risk_fits([o.risk for o in picked], risk_budget) and _caps_fit(picked, caps)


def _risk_fits(risks: Sequence[float], risk_budget: float) -> bool:
    # fsum is correctly rounded, hence monotone: an exact sum above the budget rounds to at
    # least the budget, so only a rounded sum equal to it needs the exact rational check.
    total = math.fsum(risks)
    if total != risk_budget:
        return total < risk_budget
    return sum(Fraction(float(r)) for r in risks) <= Fraction(risk_budget)


def _solution(groups: list[list[Option]], choice: tuple[int, ...], bound: float) -> Solution:
    picked = [g[i] for g, i in zip(groups, choice)]
    return Solution(choice=tuple(int(i) for i in choice),
                    utility=math.fsum(o.utility for o in picked),
                    memory=int(sum(int(o.memory) for o in picked)),
                    risk=math.fsum(o.risk for o in picked), bound=bound)
