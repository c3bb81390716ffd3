"""plan/knapsack.py: the DP against brute force on random instances (always feasible, never
better than the true optimum, within its reported bound; exactly equal, choice included, when
every cost is a whole number of bins), the tie rule, rejection of bad input, and a full-size run.
"""

import math

import numpy as np
import pytest

from ds_hilore.plan.knapsack import Option, Solution, brute_force, solve

ZERO = Option("R", 0.0, 0, 0.0)


def _random_groups(rng, risk_of, utility_of, max_memory):
    """1-5 groups of 1-5 random options plus the zero option at a random position."""
    groups = []
    for g in range(int(rng.integers(1, 6))):
        group = [Option((g, i), utility_of(), int(rng.integers(0, max_memory + 1)), risk_of())
                 for i in range(int(rng.integers(1, 6)))]
        group.insert(int(rng.integers(0, len(group) + 1)), ZERO)
        groups.append(group)
    return groups


def _assert_feasible(groups, sol, memory_budget, risk_budget):
    picked = [g[i] for g, i in zip(groups, sol.choice)]
    assert len(sol.choice) == len(groups)
    assert sol.memory == sum(o.memory for o in picked) <= memory_budget
    assert sol.risk == math.fsum(o.risk for o in picked) <= risk_budget
    assert sol.utility == math.fsum(o.utility for o in picked)
    assert sol.bound >= 0.0


def test_random_instances_feasible_and_within_bound():
    # Coarse bins and continuous costs: the DP misses optima that need the rounding slack, and
    # the bound must account for exactly that.
    rng = np.random.default_rng(0)
    gaps = 0
    for _ in range(200):
        memory_budget = int(rng.integers(0, 60))
        risk_budget = float(rng.choice([0.0, rng.uniform(0.0, 1.0)]))
        groups = _random_groups(rng, lambda: float(rng.choice([0.0, rng.uniform(0, 0.6)])),
                                lambda: float(rng.uniform(-1.0, 3.0)), max_memory=40)
        sol = solve(groups, memory_budget, risk_budget, memory_bins=8, risk_bins=4)
        exact = brute_force(groups, memory_budget, risk_budget)
        _assert_feasible(groups, sol, memory_budget, risk_budget)
        assert sol.utility <= exact.utility + 1e-12
        assert exact.utility <= sol.utility + sol.bound + 1e-9
        if sol.bound == 0.0:  # exact: rounding lost nothing, or the relaxation's optimum fit
            assert sol.utility >= exact.utility - 1e-9
        gaps += exact.utility > sol.utility + 1e-9
    assert gaps > 0  # the instances do exercise the rounding loss, not only easy cases


def test_random_instances_exact_when_costs_are_whole_bins():
    # Integer utilities (many exact ties), memory budgets that fit in the bins (one bin per
    # byte), risks on the bin grid with a dyadic width (exact float sums): DP == brute force,
    # choice included, which checks the whole tie rule.
    rng = np.random.default_rng(1)
    for _ in range(200):
        memory_budget = int(rng.integers(0, 17))
        risk_bins = 8
        risk_budget = float(rng.integers(0, 4)) / 4
        groups = _random_groups(
            rng, lambda: float(rng.integers(0, 6)) * risk_budget / risk_bins,
            lambda: float(rng.integers(-2, 5)), max_memory=12)
        sol = solve(groups, memory_budget, risk_budget, memory_bins=16, risk_bins=risk_bins)
        assert sol == brute_force(groups, memory_budget, risk_budget)
        assert sol.bound == 0.0
        _assert_feasible(groups, sol, memory_budget, risk_budget)


def test_equal_utility_prefers_lower_risk_then_lower_memory():
    by_risk = [ZERO, Option("risky", 1.0, 1, 0.2), Option("safe", 1.0, 5, 0.1)]
    assert solve([by_risk], 10, 1.0).choice == (2,)
    by_memory = [ZERO, Option("big", 1.0, 5, 0.1), Option("small", 1.0, 1, 0.1)]
    assert solve([by_memory], 10, 1.0).choice == (2,)
    same = [ZERO, Option("first", 1.0, 1, 0.1), Option("second", 1.0, 1, 0.1)]
    assert solve([same, same], 10, 1.0).choice == (1, 1) == brute_force([same, same], 10,
                                                                       1.0).choice
    # 0.1 + 0.2 = 0.30000000000000004 > 0.3, yet within the tolerance: a tie, lower risk wins.
    groups = [[ZERO, Option("a", 0.1, 1, 0.1)],
              [ZERO, Option("b", 0.2, 1, 0.1), Option("a and b", 0.3, 2, 0.0)]]
    assert solve(groups, 2, 1.0).choice == (0, 2) == brute_force(groups, 2, 1.0).choice


def test_group_without_zero_option_is_rejected_by_index():
    groups = [[ZERO], [ZERO, Option("H", 1.0, 1, 0.0)], [Option("H", 1.0, 0, 0.1)]]
    for fn in (solve, brute_force):
        with pytest.raises(ValueError, match="group 2 has no zero option"):
            fn(groups, 10, 1.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(groups=[[ZERO, Option("x", 1.0, -1, 0.0)]]), "memory must be an int >= 0"),
    (dict(groups=[[ZERO, Option("x", 1.0, 1.5, 0.0)]]), "memory must be an int >= 0"),
    (dict(groups=[[ZERO, Option("x", 1.0, 1, -0.1)]]), "risk must be finite"),
    (dict(groups=[[ZERO, Option("x", math.nan, 1, 0.1)]]), "utility must be finite"),
    (dict(memory_budget=-1), "memory_budget"),
    (dict(risk_budget=-0.5), "risk_budget"),
    (dict(memory_bins=0), "memory_bins"),
    (dict(risk_bins=0), "risk_bins"),
])
def test_malformed_input_is_rejected(kwargs, match):
    args = dict(groups=[[ZERO]], memory_budget=10, risk_budget=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        solve(**args)


def test_negative_utility_options_are_never_chosen():
    rng = np.random.default_rng(2)
    groups = [[Option(i, -float(rng.uniform(0.0, 1.0)), int(rng.integers(0, 3)), 0.0)
               for i in range(6)] + [ZERO] for _ in range(6)]
    groups += [[ZERO, Option("zero utility, costs memory", 0.0, 1, 0.0)]]
    sol = solve(groups, 100, 1.0)
    assert sol.choice == (6,) * 6 + (0,) and sol.utility == 0.0 and sol.memory == 0


def test_rounding_up_rejects_what_fits_only_when_rounded_down():
    # Bin width 2.5 bytes: 6 + 5 bytes = 2 + 2 bins rounded down (fits 4 bins), but 11 > 10.
    groups = [[ZERO, Option("a", 1.0, 6, 0.0)], [ZERO, Option("b", 1.0, 5, 0.0)]]
    sol = solve(groups, 10, 0.0, memory_bins=4)
    assert sol.utility == 1.0 and sol.memory <= 10
    # Same on risk: width 0.25, 0.3 + 0.2 = 1 + 0 bins rounded down, but 0.5 > 0.4.
    groups = [[ZERO, Option("a", 1.0, 0, 0.3)], [ZERO, Option("b", 1.5, 0, 0.2)]]
    sol = solve(groups, 0, 0.4, risk_bins=2)
    assert sol.choice == (0, 1) and sol.risk <= 0.4


def test_rounding_loss_is_reported_in_bound():
    # 6 + 5 bytes cost 3 + 2 ceil-bins of 2.5 bytes > 4: the DP takes one; the rounded-down
    # relaxation (2 + 2 bins) takes both, which do not fit (11 > 10): bound covers its unit.
    groups = [[ZERO, Option("a", 1.0, 6, 0.0)], [ZERO, Option("b", 1.0, 5, 0.0)]]
    sol = solve(groups, 10, 0.0, memory_bins=4)
    assert sol.utility == 1.0 and sol.bound == 1.0
    assert brute_force(groups, 10, 0.0).utility == 1.0


def test_a_relaxed_optimum_that_fits_is_returned_exact():
    # 3 + 6 bytes fit in 10, but cost 2 + 3 ceil-bins of 2.5 bytes > 4: rounding up takes one;
    # the rounded-down relaxation takes both, and they fit: that is the exact optimum.
    groups = [[ZERO, Option("a", 1.0, 3, 0.0)], [ZERO, Option("b", 1.0, 6, 0.0)]]
    sol = solve(groups, 10, 0.0, memory_bins=4)
    assert sol == brute_force(groups, 10, 0.0) and sol.utility == 2.0 and sol.bound == 0.0
    # The same on risk, as in a nearly spent risk budget: six units of 0.00246 in 0.015 cost
    # 11 ceil-bins of 0.015 / 64 each (66 > 64), yet fit (0.01476).
    unit = [ZERO, Option("L", 1.0, 0, 0.00246)]
    sol = solve([unit] * 7, 0, 0.015)
    assert sol.choice.count(1) == 6 and sol.risk <= 0.015 and sol.bound == 0.0
    assert sol == brute_force([unit] * 7, 0, 0.015)


def test_zero_and_infinite_budgets():
    groups = [[ZERO, Option("mem", 2.0, 5, 0.0), Option("risk", 3.0, 0, 0.5)]] * 3
    assert solve(groups, 0, 0.0) == Solution((0, 0, 0), 0.0, 0, 0.0, 0.0)
    assert solve(groups, 100, 0.0).choice == (1, 1, 1)  # only risk-free options usable
    assert solve(groups, 0, 10.0).choice == (2, 2, 2)  # only memory-free options usable
    assert solve(groups, 0, math.inf).choice == (2, 2, 2)
    assert solve(groups, 7, 0.5).choice == (0, 1, 2) == brute_force(groups, 7, 0.5).choice
    assert solve([], 10, 1.0) == Solution((), 0.0, 0, 0.0, 0.0)


def test_full_size_instance():
    # 28 layers x 12 joint actions at the default 256 x 64 bins, byte-sized costs.
    rng = np.random.default_rng(3)
    groups = [[ZERO] + [Option(i, float(rng.uniform(-0.01, 0.05)),
                               int(rng.integers(0, 2**28)), float(rng.uniform(0, 0.02)))
                        for i in range(11)] for _ in range(28)]
    memory_budget, risk_budget = 2**31, 0.1
    sol = solve(groups, memory_budget, risk_budget)
    _assert_feasible(groups, sol, memory_budget, risk_budget)
    assert sol.utility > 0.0


def _random_caps(rng, groups, memory_budget):
    """A cap (or None) per group, and options whose own bytes are part of their memory."""
    capped = []
    for group in groups:
        capped.append([o if o.memory == 0 or rng.random() < 0.3 else
                       Option(o.label, o.utility, o.memory, o.risk, int(rng.integers(0, o.memory + 1)))
                       for o in group])
    caps = [None if rng.random() < 0.25 else int(rng.integers(0, memory_budget + 20))
            for _ in groups]
    return capped, caps


def _assert_caps_hold(groups, sol, caps):
    before = 0
    for g, (group, i) in enumerate(zip(groups, sol.choice)):
        o = group[i]
        if caps[g] is not None:
            assert before + o.own_bytes <= caps[g], (g, before, o, caps[g])
        before += o.memory


def test_caps_random_instances_against_brute_force():
    # Caps on what the groups before a group keep plus its option's own bytes (the backward's
    # memory model): coarse bins stay feasible and within the bound; whole bins are exact.
    rng = np.random.default_rng(4)
    binding = 0
    for _ in range(300):
        memory_budget = int(rng.integers(0, 60))
        groups = _random_groups(rng, lambda: 0.0, lambda: float(rng.uniform(-1.0, 3.0)),
                                max_memory=40)
        groups, caps = _random_caps(rng, groups, memory_budget)
        exact = brute_force(groups, memory_budget, 0.0, caps=caps)
        _assert_caps_hold(groups, exact, caps)
        sol = solve(groups, memory_budget, 0.0, memory_bins=8, caps=caps)
        _assert_feasible(groups, sol, memory_budget, 0.0)
        _assert_caps_hold(groups, sol, caps)
        assert sol.utility <= exact.utility + 1e-12
        assert exact.utility <= sol.utility + sol.bound + 1e-9
        whole = solve(groups, memory_budget, 0.0, memory_bins=max(memory_budget, 1), caps=caps)
        assert whole.utility == pytest.approx(exact.utility, abs=1e-9) and whole.bound == 0.0
        binding += exact.utility < brute_force(groups, memory_budget, 0.0).utility - 1e-9
    assert binding > 20  # the caps do change the optimum on many instances


def test_a_group_whose_own_bytes_are_free_is_kept_last():
    # Three layers of 10 bytes, 20 of budget at the end of the forward, 10 at each backward;
    # keeping a layer adds nothing at its own backward (own 0): the last is kept beyond the
    # others' 10 (the layers before it are alive at its backward), and one of those (the
    # tie rule: the lexicographically smallest choice)
    layer = [ZERO, Option("H", 1.0, 10, 0.0, own=0)]
    sol = solve([layer] * 3, 20, 0.0, caps=[10, 10, 10])
    assert sol.choice == (0, 1, 1) and sol.memory == 20
    assert sol == brute_force([layer] * 3, 20, 0.0, caps=[10, 10, 10])
    # without own bytes off (own = memory), the caps bound the prefix including the layer
    heavy = [ZERO, Option("H", 1.0, 10, 0.0)]
    assert solve([heavy] * 3, 20, 0.0, caps=[10, 10, 10]).memory == 10


@pytest.mark.parametrize("kwargs, match", [
    (dict(caps=[5, 5]), "one per group"),
    (dict(caps=[-1]), r"caps\[0\]"),
    (dict(caps=[1.5]), r"caps\[0\]"),
    (dict(groups=[[ZERO, Option("x", 1.0, 4, 0.0, own=5)]]), "own must be"),
    (dict(groups=[[ZERO, Option("x", 1.0, 4, 0.0, own=-1)]]), "own must be"),
])
def test_malformed_caps_are_rejected(kwargs, match):
    args = dict(groups=[[ZERO]], memory_budget=10, risk_budget=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        solve(**args)
    with pytest.raises(ValueError, match=match):
        brute_force(**args)
