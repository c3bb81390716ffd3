"""``hilore bench``: the report's schema and the consistency of what it measured (not speed)."""

from __future__ import annotations

import collections
import json
import math
import os
import random
import statistics
import subprocess
import sys

import pytest
import torch

from ds_hilore import cli
from ds_hilore.bench import data, paired, targets
from ds_hilore.bench import report as report_module
from ds_hilore.bench.methods import METHODS

ROUNDS = 3
EXACT = ("nogc", "gc", "sac", "block_h", "hr", "hilore_all_r", "hilore_all_h")
RUN_KEYS = {"method", "budget", "tokens_per_s", "peak_bytes", "activation_peak_bytes",
            "within_budget", "grad_err", "grad_err_microbatch", "plan_mix", "gap_closed", "cpu_s",
            "recomputed_flops", "skipped", "vs_gc", "timed_as", "plans"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--model", "tiny", "--seq-len", "32", "--micro-batch", "8", "--group-size", "4",
            "--grad-accum", "2", "--rounds", str(ROUNDS), "--budgets", "1.10",
            "--codec-backend", "eager", "--threads", "1",
            "--json", str(out / "b.json"), "--plot", str(out / "b.png")]
    assert cli.main(argv) == 0
    with open(out / "b.json", encoding="utf-8") as handle:
        return json.load(handle), out


def _runs(report, method):
    return [r for r in report["runs"] if r["method"] == method]


def test_schema_and_every_method(bench):
    report, out = bench
    assert set(report) >= {"config", "host", "gc_peak_bytes", "profile_s", "runs", "rounds",
                           "comparisons", "regime", "stop", "targets"}
    assert isinstance(report["gc_peak_bytes"], int) and report["gc_peak_bytes"] > 0
    assert report["profile_s"] > 0  # HiLoRe's warm-up was timed, on its own line
    assert report["host"]["codec_compile_failures"] == {}  # eager: nothing to compile
    assert report["stop"]["reason"] == "rounds"  # not the "running" of a report saved mid-way
    assert (out / "b.png").stat().st_size > 0
    for name, method in METHODS.items():
        rows = _runs(report, name)
        assert len(rows) == 1, name  # one budget: one row per method
        row = rows[0]
        assert RUN_KEYS <= set(row), name
        assert (row["budget"] is None) == (not method.budgeted), name
        if row["skipped"]:
            assert isinstance(row["skipped"], str) and row["skipped"], name
            continue
        t = row["tokens_per_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"], name
        assert row["peak_bytes"] > 0 and row["activation_peak_bytes"] >= 0, name
        assert row["cpu_s"]["median"] > 0, name
        assert row["warmed"] is True, name  # every warm-up ended before its cap
        assert row["grad_err"]["mean"] >= 0 and row["grad_err"]["max"] >= row["grad_err"]["mean"]
    assert set(report["efficiency"]) == {"hilore_all_r_vs_gc", "hilore_all_h_vs_nogc"}
    offload = _runs(report, "offload")[0]
    assert "CPU" in offload["skipped"]  # meaningless on a CPU device
    ds_ac = _runs(report, "ds_ac")[0]
    if ds_ac["skipped"]:  # no DeepSpeed group in this process
        assert "--ds-init" in ds_ac["skipped"]
    else:  # an earlier test of this process started one: ds_ac ran, and it is exact
        assert ds_ac["grad_err"]["max"] == 0.0
    for name in ("nogc", "gc", "sac", "block_h", "all_l", "static", "hr", "hilore"):
        assert not _runs(report, name)[0]["skipped"], name


def test_plans_name_every_unit(bench):
    """Each allocator run's JSON holds its plan per shape bucket, unit by unit: every unit of the
    model, H/L/S/R only, no packing under hr; runs without an allocator hold none."""
    report, _ = bench
    units = {f"model.layers.{i}.{kind}" for i in range(2) for kind in ("attn", "mlp")}  # tiny
    for name in ("static", "hr", "hilore"):
        (row,) = _runs(report, name)
        assert row["plans"], name
        for bucket, actions in row["plans"].items():
            assert set(actions) == units and set(actions.values()) <= set("HLSR"), (name, bucket)
            if name == "hr":
                assert not set(actions.values()) & set("LS")
    for name in ("nogc", "gc", "all_l", "hilore_all_r"):
        assert _runs(report, name)[0]["plans"] is None, name


def test_error_budget_reaches_every_allocator(bench):
    """--grad-error-tolerance is the config's for every HiLoRe allocator (the default when not
    given, said in the report); the table prints it."""
    from ds_hilore.config import HiLoReConfig

    report, _ = bench
    default = HiLoReConfig().grad_error_tolerance
    assert report["config"]["grad_error_tolerance"] == default
    assert f"(grad_error_tolerance): {default:g}" in report_module.table(report)
    assert report_module._tolerance_note(report["config"]) == ""  # the plot's title: default
    assert report_module._tolerance_note({"grad_error_tolerance": 0.004}) == \
        ", grad_error_tolerance 0.004"
    config = dict(report["config"], budget=1.1, grad_error_tolerance=0.004)
    assert report["config"]["elide_zero_rows"] == "auto"
    assert "--elide-zero-rows" not in report_module.table(report)
    for setting, said in ((False, "--elide-zero-rows false"), (True, "--elide-zero-rows true"),
                          ("whole", "--elide-zero-rows whole")):
        saved = dict(report, config=dict(report["config"], elide_zero_rows=setting))
        assert said in report_module.table(saved), setting
    for name in ("static", "hr", "hilore"):
        block = METHODS[name].hilore_config(config)
        assert HiLoReConfig(**block).grad_error_tolerance == 0.004, name
    hilore_methods = [m for m in METHODS.values() if hasattr(m, "hilore_config")]
    assert {"all_l", "block_h", "hilore"} <= {m.name for m in hilore_methods}
    for method in hilore_methods:  # --elide-zero-rows reaches every run that attaches HiLoRe
        for setting in (False, True, "whole"):
            block = method.hilore_config(dict(config, elide_zero_rows=setting, layers_n=2))
            assert HiLoReConfig(**block).elide_zero_rows == setting, (method.name, setting)
        assert HiLoReConfig(**method.hilore_config(dict(config, layers_n=2))).elide_zero_rows == "auto"
        allocators = [run for run in _runs(report, name) if run["allocator"]]
        assert allocators and all(r["allocator"]["risk_budget"] <= default for r in allocators)


def test_memory_and_budgets(bench):
    report, _ = bench
    nogc, gc = _runs(report, "nogc")[0], _runs(report, "gc")[0]
    assert gc["peak_bytes"] == report["gc_peak_bytes"]
    assert nogc["peak_bytes"] >= gc["peak_bytes"]
    assert nogc["activation_peak_bytes"] >= gc["activation_peak_bytes"]
    for row in report["runs"]:
        if row["skipped"] or row["budget"] is None:
            assert row["within_budget"] is None
            continue
        assert row["within_budget"] == (row["peak_bytes"] <= row["budget"] * report["gc_peak_bytes"])
    # NOTE [ One baseline for every run ] (bench/runs.py): the allocators profile in the same
    # process memory whatever their warm-up order, so they plan for one absolute budget (up to
    # the heap's own jitter: 0.01-0.02 % alone, 0.17 % seen once late in a loaded suite);
    # before, each later run's included the earlier runs' optimizer state and gradients (0.3 %
    # apart here)
    budgets = [_runs(report, m)[0]["allocator"]["budget_bytes"] for m in ("static", "hr", "hilore")]
    assert max(budgets) - min(budgets) <= 2e-3 * max(budgets), budgets


def test_gradient_errors(bench):
    """H, R (any mix, any order of storing) and torch's checkpointing recompute the same ops in
    the same order: the gradient equals no checkpointing's bitwise. int8 packing does not."""
    report, _ = bench
    for name in EXACT:
        row = _runs(report, name)[0]
        assert row["grad_err"]["max"] == 0.0, (name, row["grad_err"])  # the step's gradient
        assert row["grad_err_microbatch"]["max"] == 0.0, (name, row["grad_err_microbatch"])
    all_l = _runs(report, "all_l")[0]
    assert 0 < all_l["grad_err"]["max"] < 0.1
    assert all_l["plan_mix"].get("L", 0) > 0
    assert all_l["held_bytes"]["L"] > 0 and all_l["pack_s"] > 0 and all_l["unpack_s"] > 0
    assert "L" not in _runs(report, "hr")[0]["held_bytes"]  # H and R only: nothing packed
    for name in ("static", "hr", "hilore"):  # the allocator's own budget and estimate
        own = _runs(report, name)[0]["allocator"]
        assert own["budget_bytes"] > 0 and 0 <= own["grad_error_est"] <= own["risk_budget"], name
    assert _runs(report, "hilore_all_h")[0]["allocator"] is None  # forced: no allocator


def test_gap_closed_formula(bench):
    report, _ = bench
    tokens = report["config"]["tokens_per_step"]
    t = {r["method"]: tokens / r["tokens_per_s"]["median"]
         for r in report["runs"] if not r["skipped"]}
    assert _runs(report, "nogc")[0]["gap_closed"] == pytest.approx(1.0)
    assert _runs(report, "gc")[0]["gap_closed"] == pytest.approx(0.0, abs=1e-9)
    for row in report["runs"]:
        if row["skipped"]:
            continue
        expected = (t["gc"] - t[row["method"]]) / (t["gc"] - t["nogc"])
        assert math.isclose(row["gap_closed"], expected, rel_tol=1e-6, abs_tol=1e-9), row["method"]


def test_targets_follow_the_rows(bench):
    """The verdict for hilore is recomputed from the rows and rounds it reports on."""
    report, _ = bench
    (verdict,) = report["targets"]
    me, gc = _runs(report, "hilore")[0], _runs(report, "gc")[0]
    assert verdict["budget"] == me["budget"]
    assert verdict["peak_ratio"] == pytest.approx(me["peak_bytes"] / report["gc_peak_bytes"])
    assert verdict["met"]["peak"] == me["within_budget"]
    assert verdict["grad_err_mean"] == me["grad_err"]["mean"]
    assert verdict["flops_avoided"] == pytest.approx(
        1 - me["recomputed_flops"] / gc["recomputed_flops"])
    per_round = [(r["wall_s"]["gc"] - r["wall_s"]["hilore@1.1"])
                 / (r["wall_s"]["gc"] - r["wall_s"]["nogc"])
                 for r in report["rounds"] if r["wall_s"]["gc"] > r["wall_s"]["nogc"]]
    if per_round:
        assert verdict["gap_closed"]["median"] == pytest.approx(statistics.median(per_round))
    fits = {(r["method"] if r["budget"] is None else f"{r['method']}@{r['budget']:g}")
            for r in report["runs"] if not r["skipped"] and r["method"] != "hilore"
            and r["peak_bytes"] <= me["budget"] * report["gc_peak_bytes"]
            and r["grad_err"]["mean"] <= targets.ERROR_TOLERANCE}
    assert {r["run"] for r in verdict["rivals"]} == fits
    # the decisive comparisons: gc, static at this budget, the closest in-budget rival
    rivals = {r["rival"] for r in verdict["decisive"]}
    assert {"gc", "static@1.1"} <= rivals and verdict["best_rival"] in rivals
    # 3 rounds cannot give a 95 % interval: nothing is decided, and the report says so
    assert set(verdict["undecided"]) == rivals
    assert report["stop"] == {"reason": "rounds",
                              "undecided": [f"hilore@1.1 vs {r}" for r in verdict["undecided"]]}


def _brute_interval(logs):
    """The signed-rank interval by enumeration of every sign pattern (independent of the DP)."""
    n = len(logs)
    counts = collections.Counter(sum(r + 1 for r in range(n) if signs >> r & 1)
                                 for signs in range(2 ** n))
    k, cdf = 0, 0.0
    while cdf + counts[k] / 2 ** n <= 0.025 + 1e-12:
        cdf += counts[k] / 2 ** n
        k += 1
    walsh = sorted((logs[i] + logs[j]) / 2 for i in range(n) for j in range(i, n))
    return (None, None) if k < 1 else (math.exp(walsh[k - 1]), math.exp(walsh[-k]))


def test_an_interrupt_ends_the_rounds_and_each_round_was_saved(monkeypatch):
    """SIGINT (what ``timeout`` sends the GPU script's bench) in round 3 ends the rounds: the
    two completed are reported, and each was handed to ``saved`` as it completed."""
    from ds_hilore.bench import frontier

    def one_round(live, index, data, step_index):
        if index == 2:
            raise KeyboardInterrupt
        return {"round": index, "wall_s": {"gc": 1.0}, "cpu_s": {"gc": 1.0}}

    monkeypatch.setattr(frontier, "_one_round", one_round)
    saved = []
    records, stop = frontier._rounds([object()], [[None]], {"rounds": 5, "max_minutes": None},
                                     frontier.Clock(None),
                                     lambda records: {"runs": [], "rounds": list(records)},
                                     lambda report: saved.append(len(report["rounds"])))
    assert [r["round"] for r in records] == [0, 1] and saved == [1, 2]
    assert stop == {"reason": "interrupted", "undecided": []}
    assert "2 paired rounds (interrupted)" in report_module._stop_line(
        {"stop": stop, "rounds": records})


TINY_AUTO = ["bench", "--model", "tiny", "--seq-len", "32", "--micro-batch", "8", "--group-size",
             "4", "--grad-accum", "2", "--budgets", "1.10", "--codec-backend", "eager",
             "--threads", "1", "--methods", "nogc,gc,hr,hilore", "--rounds", "auto"]


def test_max_minutes_bounds_the_whole_bench_not_only_its_rounds(tmp_path):
    """Out of time before the warm-up (a limit of 6 ms): the runs the decisive comparisons need
    are still warmed up and planned, the others dropped with the reason; one round, then the
    bench stops on its minutes."""
    path = tmp_path / "b.json"
    assert cli.main(TINY_AUTO + ["--max-minutes", "0.0001", "--json", str(path)]) == 0
    report = json.loads(path.read_text(encoding="utf-8"))
    rows = {r["method"]: r for r in report["runs"]}
    assert rows["hr"]["skipped"].startswith("not warmed up: --max-minutes 0.0001")
    assert rows["hilore"]["warmed"] is True and rows["hilore"]["plans"]
    assert all(rows[m]["skipped"] is None for m in ("nogc", "gc", "hilore"))
    assert len(report["rounds"]) == 1 and report["stop"]["reason"] == "max_minutes"
    assert set(report["rounds"][0]["wall_s"]) == {"nogc", "gc", "hilore@1.1"}


def test_an_interrupt_in_the_warm_up_saves_what_was_measured(monkeypatch, tmp_path, capsys):
    """SIGINT while HiLoRe warms up: the document says where it stopped, every run's row is
    there (none measured), and the bench exits 1 with one line naming the file."""
    from ds_hilore.bench import frontier

    real = frontier.step

    def step(run, micro_batches, **kwargs):
        if run.method == "hilore" and run.warmup_steps == 1:
            raise KeyboardInterrupt
        return real(run, micro_batches, **kwargs)

    monkeypatch.setattr(frontier, "step", step)
    path = tmp_path / "b.json"
    assert cli.main(TINY_AUTO + ["--json", str(path)]) == 1
    report = json.loads(path.read_text(encoding="utf-8"))
    assert report["stop"] == {"reason": "interrupted", "phase": "warming up", "undecided": []}
    assert report["rounds"] == [] and [r["method"] for r in report["runs"]] == [
        "nogc", "gc", "hr", "hilore"]
    assert all(r["skipped"] == "not measured" for r in report["runs"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"hilore bench: error: interrupted while warming up, before any paired round; "
                   f"what was measured is in {path}")


def test_a_codec_that_fell_back_to_eager_is_reported(monkeypatch):
    """A codec kernel whose compilation failed runs eager; the report says which and why."""
    from ds_hilore.bench import summary
    from ds_hilore.runtime.codecs import CODECS

    kernel = CODECS["int8"].encode
    monkeypatch.setattr(kernel, "failure", "InductorError: no compiler")
    host = summary._host({"device": "cpu"})
    assert host["codec_compile_failures"] == {kernel.name: "InductorError: no compiler"}
    line = [x for x in report_module.table({"gc_peak_bytes": 1, "runs": [], "profile_s": 0.0,
                                            "host": host, "config": {}}).splitlines()
            if "torch.compile failed" in x]
    assert line and kernel.name in line[0]


def test_rounds_hold_every_raw_sample_and_rotate(bench):
    report, _ = bench
    rounds = report["rounds"]
    timed = [r["timed_as"] for r in report["runs"] if not r["skipped"] and not r.get("measured_once")]
    assert len(rounds) == ROUNDS
    for k, record in enumerate(rounds):
        assert sorted(record["order"]) == sorted(timed)
        assert record["order"] == rounds[0]["order"][k:] + rounds[0]["order"][:k]  # rotating
        assert record["step"] == k % report["config"]["batches"]  # same data for every run
        for metric in ("wall_s", "cpu_s"):
            assert set(record[metric]) == set(timed) and all(v > 0 for v in record[metric].values())
    for row in report["runs"]:
        if row["skipped"]:
            continue
        walls = [r["wall_s"][row["timed_as"]] for r in rounds]
        assert row["step_s"]["median"] == pytest.approx(statistics.median(walls))


def test_paired_ratios_and_intervals_recomputed_from_the_samples(bench):
    report, _ = bench
    rounds = report["rounds"]
    labels = {(r["method"] if r["budget"] is None else f"{r['method']}@{r['budget']:g}"):
              r["timed_as"] for r in report["runs"] if not r["skipped"]}
    assert report["comparisons"]
    for c in report["comparisons"]:
        for key, metric in (("wall", "wall_s"), ("cpu", "cpu_s")):
            a, b = labels[c["a"]], labels[c["b"]]
            ratios = [r[metric][b] / r[metric][a] for r in rounds]
            assert c[key]["n"] == ROUNDS
            assert c[key]["median"] == pytest.approx(statistics.median(ratios))
            low, high = _brute_interval([math.log(x) for x in ratios])
            assert (c[key]["low"], c[key]["high"]) == (low, high)  # None, None at 3 rounds
            assert c[key]["verdict"] == "level" and not c[key]["decided"]
    gc = _runs(report, "gc")[0]
    for row in report["runs"]:
        if not row["skipped"]:
            ratios = [r["wall_s"]["gc"] / r["wall_s"][row["timed_as"]] for r in rounds]
            assert row["vs_gc"]["wall"]["median"] == pytest.approx(statistics.median(ratios))
    assert gc["vs_gc"]["wall"]["median"] == 1.0


@pytest.mark.parametrize("seed", range(40))
def test_paired_interval_matches_enumeration_and_verdict_follows_it(seed):
    g = random.Random(seed)
    n = g.randint(1, 12)
    shift = g.choice([0.9, 0.97, 1.0, 1.03, 1.1])
    mine = [g.uniform(0.8, 1.2) for _ in range(n)]  # seconds per step
    theirs = [m * shift * g.uniform(0.95, 1.05) for m in mine]
    c = paired.compare(mine, theirs)
    low, high = _brute_interval([math.log(b / a) for a, b in zip(mine, theirs)])
    assert c["low"] == pytest.approx(low) if low else c["low"] is None
    assert c["high"] == pytest.approx(high) if high else c["high"] is None
    if c["low"] is None or c["low"] <= 1.0 <= c["high"]:  # an interval containing 1 (or none)
        assert c["verdict"] == "level"
    else:
        assert c["verdict"] == ("ahead" if c["low"] > 1 else "behind")


def test_verdicts_on_synthetic_samples_both_ways():
    base = [1.0, 1.1, 0.9, 1.2, 1.05, 0.95, 1.15, 0.85, 1.0, 1.1]  # seconds, a loaded machine
    wobble = [1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99, 1.02, 0.98, 1.0]
    slower = [b * 1.06 * w for b, w in zip(base, wobble)]  # the rival 6 % slower, every round
    ahead = paired.compare(base, slower)
    assert ahead["verdict"] == "ahead" and ahead["low"] > 1 and ahead["decided"]
    behind = paired.compare(slower, base)
    assert behind["verdict"] == "behind" and behind["high"] < 1 and behind["decided"]
    assert behind["low"] == pytest.approx(1 / ahead["high"])
    level = paired.compare(base, [b * w for b, w in zip(base, wobble)])
    assert level["low"] < 1 < level["high"] and level["verdict"] == "level"
    assert paired.verdict(0.99, 1.2) == "level" and paired.verdict(1.0, 1.2) == "level"
    assert paired.verdict(1.001, 1.2) == "ahead" and paired.verdict(0.5, 0.999) == "behind"
    assert paired.verdict(None, None) == "level"
    few = paired.compare(base[:5], slower[:5])  # 5 rounds: no 95 % interval exists
    assert few["low"] is None and few["verdict"] == "level" and not few["decided"]
    assert paired.compare(base[:6], slower[:6])["low"] is not None
    # signed-rank table (n = 10, two-sided 5 %: the 9th smallest of the 55 Walsh averages)
    assert paired._critical_k(10, 0.95) == 9 and paired._critical_k(5, 0.95) == 0


def _fake_report(shift_gc: float, shift_static: float, n: int) -> dict:
    """A report of hilore, gc, nogc and static whose per-round times are fixed multiples."""
    g = random.Random(7)
    rounds = []
    for k in range(n):
        base = g.uniform(1.0, 1.5)  # the machine's load in this round
        wobble = [1 + 0.01 * ((k * 7 + i * 3) % 5 - 2) for i in range(4)]
        wall = {"hilore@1.1": base * wobble[0], "gc": base * shift_gc * wobble[1],
                "nogc": base * 0.8 * wobble[2], "static@1.1": base * shift_static * wobble[3]}
        rounds.append({"round": k, "step": 0, "order": list(wall), "wall_s": wall,
                       "cpu_s": dict(wall)})

    def row(method, budget, peak):
        walls = [r["wall_s"][method if budget is None else f"{method}@{budget:g}"] for r in rounds]
        return {"method": method, "budget": budget, "peak_bytes": peak, "recomputed_flops": 0,
                "timed_as": method if budget is None else f"{method}@{budget:g}",
                "grad_err": {"mean": 0.0, "max": 0.0},
                "step_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)}}

    runs = [row("nogc", None, 200), row("gc", None, 100), row("static", 1.1, 105),
            row("hilore", 1.1, 108)]
    return {"gc_peak_bytes": 100, "rounds": rounds, "runs": runs}


def test_targets_verdicts_on_known_numbers():
    (v,) = targets.targets(_fake_report(shift_gc=1.10, shift_static=1.0, n=10))
    standing = {r["run"]: r["wall"]["verdict"] for r in v["rivals"]}
    assert standing == {"gc": "ahead", "static@1.1": "level"}  # nogc is out of budget (2x GC)
    gc = next(r for r in v["rivals"] if r["run"] == "gc")["wall"]
    assert gc["low"] > 1 and gc["median"] == pytest.approx(1.10, abs=0.03)
    assert v["met"]["peak"] and v["met"]["grad_err"]
    # level with static, but not within +-1 %: more rounds could still tell them apart
    assert v["met"]["ahead_of_rivals"] is None and v["undecided"] == ["static@1.1"]
    assert v["gap_closed"]["low"] <= v["gap_closed"]["median"] <= v["gap_closed"]["high"]
    text = targets.targets_text([v])
    assert "hilore@1.1 vs gc: ahead (x1." in text and "vs static@1.1: level" in text
    assert "95 % CI" in text
    (v,) = targets.targets(_fake_report(shift_gc=1.10, shift_static=1.0, n=4))
    assert all(r["wall"]["verdict"] == "level" for r in v["rivals"])  # too few rounds
    assert v["met"]["ahead_of_rivals"] is None and set(v["undecided"]) == {"gc", "static@1.1"}


def _paired_report(shifts: dict[str, list[float]], loads: list[float], peaks: dict[str, int]) -> dict:
    """A report of paired rounds: run ``m``'s step takes ``loads[k] * shifts[m][k]`` in round k
    (wall and CPU alike); GC's peak is 100, ``peaks`` the runs' own, every error 0."""
    rounds = [{"round": k, "step": 0, "order": list(shifts),
               "wall_s": {m: load * s[k] for m, s in shifts.items()},
               "cpu_s": {m: load * s[k] for m, s in shifts.items()}} for k, load in enumerate(loads)]

    def row(name):
        method, _, budget = name.partition("@")
        walls = sorted(r["wall_s"][name] for r in rounds)
        return {"method": method, "budget": float(budget) if budget else None,
                "peak_bytes": peaks[name], "timed_as": name,
                "grad_err": {"mean": 0.0, "max": 0.0}, "recomputed_flops": 0,
                "step_s": {"median": statistics.median(walls), "min": walls[0], "max": walls[-1]}}

    return {"gc_peak_bytes": 100, "rounds": rounds, "runs": [row(name) for name in peaks]}


def test_a_rival_is_in_budget_only_within_the_runs_error_budget():
    """A rival whose step error passes the run's --grad-error-tolerance (tighter than the
    0.010 target) is not in budget: HiLoRe is held to that tolerance, so is a rival."""
    report = _fake_report(shift_gc=1.10, shift_static=1.0, n=10)
    next(r for r in report["runs"] if r["method"] == "static")["grad_err"] = {"mean": 0.006,
                                                                              "max": 0.006}
    for tolerance, kept in ((None, True), (0.015, True), (0.008, True), (0.005, False)):
        if tolerance is not None:
            report["config"] = {"grad_error_tolerance": tolerance}
        (v,) = targets.targets(report)
        assert ("static@1.1" in {r["run"] for r in v["rivals"]}) is kept, tolerance
        assert targets.rival_tolerance(report) == min(0.010, tolerance or 0.010)


def test_best_rival_is_the_closest_by_paired_rounds_not_the_fastest_median():
    # seven rounds of rising load; hr is 5 % slower than hilore in every round, block_h 20 %
    # slower except in the middle round, which puts block_h's median step below hr's
    shifts = {"hr@1.1": [1.05] * 7, "block_h@1.1": [1.2, 1.2, 1.2, 0.9, 1.2, 1.2, 1.2],
              "gc": [1.5] * 7, "nogc": [0.8] * 7, "hilore@1.1": [1.0] * 7}
    report = _paired_report(shifts, [1, 2, 3, 4, 5, 6, 7], {
        "nogc": 200, "gc": 100, "hr@1.1": 105, "block_h@1.1": 105, "hilore@1.1": 108})
    steps = {r["timed_as"]: r["step_s"]["median"] for r in report["runs"]}
    assert steps["block_h@1.1"] < steps["hr@1.1"]  # the unpaired summary would pick block_h
    (v,) = targets.targets(report)
    assert v["best_rival"] == "hr@1.1"
    # no static in this report; block_h is behind hr in six rounds of seven, not yet decided
    # behind it (which of the two is the best is not known): HiLoRe vs each is decisive
    assert [c["rival"] for c in v["decisive"]] == ["gc", "hr@1.1", "block_h@1.1"]
    assert [c["best_rival"] for c in v["decisive"]] == [False, True, False]
    hr = next(c for c in v["decisive"] if c["rival"] == "hr@1.1")
    assert hr["median"] == pytest.approx(1.05) and hr["verdict"] == "ahead"


@pytest.mark.parametrize("block_h, decisive", [(1.2, False), (1.08, True)])
def test_a_rival_level_with_the_best_one_is_decisive_too(block_h, decisive):
    # hr 5 % slower than hilore every round; block_h either decided behind hr (20 % slower
    # every round) or level with it (1.08 in half the rounds, 1.03 in the other: its paired
    # ratio to hilore, median 1.055, still puts hr closest)
    n = 8
    shifts = {"gc": [1.5] * n, "nogc": [0.8] * n, "hilore@1.1": [1.0] * n, "hr@1.1": [1.05] * n,
              "block_h@1.1": [block_h if block_h > 1.1 else block_h - 0.05 * (k % 2)
                              for k in range(n)]}
    report = _paired_report(shifts, [1 + k for k in range(n)],
                            {name: 200 if name == "nogc" else 105 for name in shifts})
    (v,) = targets.targets(report)
    assert v["best_rival"] == "hr@1.1"
    expected = ["gc", "hr@1.1", "block_h@1.1"] if decisive else ["gc", "hr@1.1"]
    assert [c["rival"] for c in v["decisive"]] == expected


def test_a_steps_flops_count_every_microbatch():
    # FlopCounterMode starts from zero at each entry: a step of three microbatches must report
    # three counts, not the last one's
    import contextlib
    import types

    from ds_hilore.bench import runs, summary

    model = runs.build_model({"dtype": "fp32", "seed": 0, "model": "tiny", "layers": None,
                              "lora_r": 0, "device": "cpu"})
    shape = data.GrpoShape(micro_batch=4, seq_len=16, group_size=4, grad_accum=3,
                           zero_adv_share=0.0, clip_share=0.0)
    (micro_batches,) = data.attach_behaviour(data.grpo_steps(shape, vocab=512, steps=1, seed=0),
                                             lambda ids: runs.logprobs(model, ids), "cpu")
    run = runs.Run("nogc", None, model=model,
                   context=types.SimpleNamespace(step=contextlib.nullcontext, runtime=None))
    runs.step(run, micro_batches, optimize=False, flops=True)
    three = run.microbatch_flops
    runs.step(run, micro_batches[:1], optimize=False, flops=True)
    assert len(three) == 3 and three[0] == run.microbatch_flops[0] > 0
    assert len(set(three)) == 1  # one shape: the same FLOPs each
    # above no checkpointing, microbatch by microbatch; one that runs fewer counts 0
    assert summary.recomputed_flops([15, 4, 12], [10, 10, 10]) == 5 + 0 + 2
    assert summary.recomputed_flops([15, 4], [10, 10, 10]) is None
    assert summary.recomputed_flops(None, [10]) is None


def test_adaptive_rounds_stop_when_decided_or_out_of_time(monkeypatch):
    from ds_hilore.bench import frontier

    full = _fake_report(shift_gc=1.10, shift_static=1.10, n=40)

    def one_round(live, index, data, step_index):
        return full["rounds"][index]

    def provisional(records):
        return dict(full, rounds=records)

    monkeypatch.setattr(frontier, "_one_round", one_round)
    config = {"rounds": "auto", "max_minutes": None}
    records, stop = frontier._rounds([None], [[]], config, frontier.Clock(None), provisional)
    assert stop == {"reason": "decided", "undecided": []}
    assert len(records) == paired.MIN_ROUNDS  # decided as soon as an interval exists
    level = _fake_report(shift_gc=1.10, shift_static=1.0, n=40)  # static level: never decided
    monkeypatch.setattr(frontier, "_one_round", lambda live, i, d, s: level["rounds"][i])
    config = {"rounds": "auto", "max_minutes": 1.0}
    clock = frontier.Clock(1.0)
    clock.begin -= 59.0
    records, stop = frontier._rounds([None], [[]], config, clock,
                                     lambda recs: dict(level, rounds=recs))
    assert stop["reason"] == "max_minutes" and len(records) == 1  # one more round would pass it
    records, stop = frontier._rounds([None], [[]], {"rounds": 8, "max_minutes": None},
                                     frontier.Clock(None), lambda recs: dict(level, rounds=recs))
    assert len(records) == 8 and stop["reason"] == "rounds"


# ---------------------------------------------------------------------------------- data
def _steps(**flags):
    shape = data.GrpoShape(**{"micro_batch": 8, "seq_len": 64, "group_size": 4, "grad_accum": 3,
                              "zero_adv_share": 0.5, "clip_share": 0.2, **flags})
    return shape, data.grpo_steps(shape, vocab=100, steps=3, seed=5)


def test_grpo_data_is_what_the_flags_say():
    shape, steps = _steps()
    again = _steps()[1]
    for step_a, step_b in zip(steps, again):  # pure: same arguments, same tensors
        for a, b in zip(step_a, step_b):
            assert all(torch.equal(a[k], b[k]) for k in a)
    for micro_batches in steps:
        assert len(micro_batches) == shape.grad_accum
        groups = torch.cat([m["group"] for m in micro_batches])
        adv = torch.cat([m["advantages"] for m in micro_batches])
        for m in micro_batches:
            assert m["input_ids"].shape == (shape.micro_batch, shape.seq_len)
            assert m["mask"].shape == m["old_offset"].shape == (shape.micro_batch, shape.seq_len - 1)
            _, sizes = torch.unique_consecutive(m["group"], return_counts=True)
            assert (sizes == shape.group_size).all()  # whole groups inside one microbatch
            prompt = shape.seq_len // 4
            assert m["mask"][:, : prompt - 1].sum() == 0 and (m["mask"].sum(1) > 0).all()
            assert (m["old_offset"][m["mask"] == 0] == 0).all()
            assert data.exposure(m) == pytest.approx((m["advantages"].abs() * m["mask"].sum(1)).tolist())
        n_groups = len(groups.unique())
        zero = [k for k in groups.unique() if (adv[groups == k] == 0).all()]
        assert len(zero) == round(shape.zero_adv_share * n_groups)
        assert all((adv[groups == k] != 0).all() for k in groups.unique() if k not in zero)
        mask = torch.cat([m["mask"] for m in micro_batches]).bool()
        ratio = torch.exp(-torch.cat([m["old_offset"] for m in micro_batches]))[mask]
        clipped = ((ratio < 1 - data.EPSILON_LOW) | (ratio > 1 + data.EPSILON_HIGH)).sum()
        assert int(clipped) == round(shape.clip_share * int(mask.sum()))  # drawn per step
        lengths = mask.sum(1)
        assert len(lengths.unique()) > 1  # varied response lengths


def test_grpo_data_filtered_variant_drops_every_zero_advantage():
    shape, full = _steps()
    _, kept = _steps(drop_zero_advantage=True)
    for step_full, step_kept in zip(full, kept):
        adv = torch.cat([m["advantages"] for m in step_full])
        ids = torch.cat([m["input_ids"] for m in step_full])
        got = torch.cat([m["advantages"] for m in step_kept])
        assert (got != 0).all() and torch.equal(got, adv[adv != 0])
        assert torch.equal(torch.cat([m["input_ids"] for m in step_kept]), ids[adv != 0])
        assert all(len(m["advantages"]) <= shape.micro_batch for m in step_kept)
        assert all(len(m["advantages"]) == shape.micro_batch for m in step_kept[:-1])


@pytest.mark.parametrize("flags, words", [
    (["--methods", "nogc,bogus"], ["bogus", "allowed", "hilore", "block_h"]),
    (["--model", "no-such-preset"], ["no-such-preset", "allowed", "qwen2.5-0.5b"]),
    (["--budgets", "1.1,0.9"], ["--budgets", "0.9", ">= 1.0"]),
    (["--group-size", "3"], ["--group-size 3", "--micro-batch 4", "allowed", "1,2,4"]),
    (["--rounds", "zero"], ["--rounds", "allowed", "auto"]),
    (["--clip-share", "1.5"], ["--clip-share 1.5", "allowed", "between 0 and 1"]),
    (["--drop-zero-advantage", "--zero-adv-share", "1"], ["--zero-adv-share", "allowed"]),
    (["--grad-error-tolerance", "1.5"], ["--grad-error-tolerance 1.5", "allowed", "0 <= X < 1"]),
    (["--no-model"], ["--model is required", "--report"]),
    (["--report", "/nonexistent/b.json"], ["--report", "not a readable hilore bench report"]),
])
def test_bad_flags_exit_2(capsys, flags, words):
    argv = ["bench", "--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--group-size", "2"]
    if "--group-size" in flags:
        argv = argv[:-2]
    if "--model" in flags or flags == ["--no-model"]:
        argv = ["bench", "--seq-len", "32", "--micro-batch", "4", "--group-size", "2"]
        flags = [f for f in flags if f != "--no-model"]
    assert cli.main(argv + flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    for word in words:
        assert word in err, (word, err)


@pytest.mark.slow  # DeepSpeed builds its CPU comm op on first use (a minute or two, once)
def test_ds_ac_with_a_one_rank_group(tmp_path):
    out = tmp_path / "ds.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ds_hilore.cli", "bench", "--model", "tiny", "--seq-len", "32",
         "--micro-batch", "4", "--group-size", "2", "--repeats", "1", "--methods", "nogc,gc,ds_ac",
         "--ds-init",
         "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    row = _runs(report, "ds_ac")[0]
    assert row["skipped"] is None and row["grad_err"]["max"] == 0.0
    assert row["activation_peak_bytes"] <= _runs(report, "nogc")[0]["activation_peak_bytes"]


def test_local_checkpoint_directory(tmp_path):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "local.json"
    argv = ["bench", "--model", str(tmp_path / "ckpt"), "--layers", "1", "--seq-len", "16",
            "--micro-batch", "2", "--group-size", "2", "--repeats", "1",
            "--methods", "nogc,gc,hilore_all_r",
            "--budgets", "1.2", "--threads", "1", "--codec-backend", "eager", "--json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["layers_built"] == 1
    assert {r["method"] for r in report["runs"]} == {"nogc", "gc", "hilore_all_r"}
    assert _runs(report, "hilore_all_r")[0]["grad_err"]["max"] == 0.0


def test_device_check_runs_on_cpu(tmp_path, capsys):
    """The GPU script's exactness and memory check, run here on the CPU (fp32): H and R are
    bitwise equal to GC, and HiLoRe's metered peak is within the budget."""
    from ds_hilore.bench import device_check

    out = tmp_path / "check.json"
    code = device_check.main(["--device", "cpu", "--dtype", "fp32", "--codec-backend", "eager",
                              "--seq-len", "32", "--json", str(out)])
    result = json.loads(out.read_text())
    exact = result["exactness"]
    assert exact["deterministic"] and exact["gc_vs_gc_max_abs"] == 0.0
    for method in ("hilore_all_h", "hilore_all_r"):
        assert exact[method]["max_abs_vs_gc"] == 0.0 and exact[method]["ok"], method
    # elision: every setting exact on a CPU; "whole" elided the all-zero microbatch (8
    # sequences) and skipped its backward; true elided the zero group (4) of each microbatch
    # of the mixed step, and the all-zero microbatch with its backward run
    elision = exact["elision"]
    assert [e["check"] for e in elision.values()] == [True, False, False]
    assert all(e["max_abs_vs_gc"] == 0.0 and e["ok"] for e in elision.values()), elision
    assert [(e["elided_sequences"], e["backward_skipped"]) for e in elision.values()] == \
        [(8, 1), (8, 0), (8, 0)], elision
    memory = result["memory"]
    assert "reserved" not in memory["hilore"]  # CUDA only
    assert memory["allocated_ratio"] == pytest.approx(
        memory["hilore"]["allocated"] / memory["gc"]["allocated"])
    assert memory["allocated_ok"] == (memory["allocated_ratio"] <= 1.10)
    assert code == (0 if result["ok"] else 1)
    printed = capsys.readouterr().out
    assert "hilore_all_r vs GC: max |diff| 0 (ok)" in printed
    assert "elide_zero_rows whole: a microbatch all zero: max |diff| 0, 8 sequences elided, " \
        "1 backward skipped (ok)" in printed


def test_plot_styles_are_distinct_per_method():
    from ds_hilore.bench import report

    styles = report._STYLE[: len(METHODS)]
    assert len(styles) == len(METHODS)  # one style per registered method
    assert len({s[:-1] for s in styles}) == len(styles) and len({s[-1] for s in styles}) == len(styles)


@pytest.mark.parametrize("script", ["gpu.sh", "gpu_wheels.sh"])
def test_gpu_scripts_parse(script):
    """The one-shot GPU scripts cannot run here (no GPU): they must at least parse, and pass
    shellcheck where it is installed."""
    import shutil

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "bench", script)
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    text = open(path, encoding="utf-8").read()
    assert "set -euo pipefail" in text and "torch==" not in text  # never reinstalls torch
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", path], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_each_forward_is_preceded_by_its_predicted_exposure():
    """The bench hands HiLoRe |A_i| x response tokens of the next microbatch (and the step's
    total) through the runtime's public ``expect``, before that microbatch's forward."""
    from ds_hilore.bench import frontier
    from ds_hilore.bench.methods import Context
    from ds_hilore.bench.runs import Run, build_model, step

    config = {"model": "tiny", "layers": None, "full": False, "dtype": "fp32", "device": "cpu",
              "lora_r": 4, "seed": 0, "batches": 1, "seq_len": 16, "micro_batch": 4,
              "group_size": 2, "grad_accum": 3, "zero_adv_share": 0.5, "clip_share": 0.1,
              "drop_zero_advantage": False}
    model = build_model(config)
    (micro_batches,) = frontier.make_steps(model, config)
    events = []

    class Recorder:
        def expect(self, exposure, step_exposure=None, exposed_microbatches=None):
            events.append(("expect", exposure, step_exposure, exposed_microbatches))

        def end_step(self):
            events.append(("end_step",))

    model.register_forward_pre_hook(lambda module, args: events.append(("forward",)))
    step(Run("x", None, model=model, context=Context(runtime=Recorder())), micro_batches,
         optimize=False)
    total = sum(float((m["advantages"].abs() * m["mask"].sum(1)).sum()) for m in micro_batches)
    exposed = sum(1 for m in micro_batches if float(m["advantages"].abs().sum()) > 0)
    expected, zeros = [], 0
    for m in micro_batches:
        exposure = (m["advantages"].abs() * m["mask"].sum(1)).tolist()
        zeros += exposure.count(0.0)
        expected += [("expect", pytest.approx(exposure), pytest.approx(total), exposed),
                     ("forward",)]
    assert events == expected + [("end_step",)]
    assert zeros == 3 * 2  # 3 of the step's 6 groups have A = 0: predicted exactly 0


def test_block_h_k_is_found_against_gc_measured_beside_the_probe(monkeypatch):
    """block_h's k: each probe's peak is compared with GC's peak read while that probe is
    alive (NOTE [ block_h's k, measured against GC in the same memory ]), not with GC's first
    reading, taken before the budgeted runs existed. Fake meter: a peak is the bytes of the
    runs alive plus the run's activations (GC 100, block_h 100 + 20 per stored layer)."""
    from ds_hilore.bench import frontier
    from ds_hilore.bench.runs import Run

    alive = {"bytes": 1300}  # GC's first reading saw 1000: the budgeted runs were made since

    def new_run(method, budget, base, config, extra=None):
        alive["bytes"] += 10  # the probe's own copy and optimizer state
        return Run(method, budget, note=str(extra["block_k"]))

    def close(run):
        alive["bytes"] -= 10

    def measure_peak(run, data, device):
        act = 100 if run.method == "gc" else 100 + 20 * int(run.note)
        return alive["bytes"] + act, act

    monkeypatch.setattr(frontier, "new_run", new_run)
    monkeypatch.setattr(frontier, "close", close)
    monkeypatch.setattr(frontier, "measure_peak", measure_peak)
    monkeypatch.setattr(frontier, "step", lambda run, data: None)
    k, probes = frontier._find_block_k(None, {"layers_n": 8, "device": "cpu"}, 1.10,
                                       Run("gc", None), data=None)
    # beside a probe GC peaks at 1410, so 1.10x allows 1551: 1410 + 20k fits up to k = 7
    assert k == 7  # against GC's first reading (1100 -> 1210) no k would fit: k = 0
    assert probes == [(4, 1490, 1410), (6, 1530, 1410), (7, 1550, 1410), (8, 1570, 1410)]
    assert alive["bytes"] == 1300  # every probe closed


def test_several_reports_side_by_side_say_how_many_runs_agreed(tmp_path, capsys):
    # two runs of one command: static 6 % slower than hilore in the first (decided ahead),
    # as fast in the second (level); GC 10 % slower in both
    first, second = (_fake_report(shift_gc=1.10, shift_static=s, n=10) for s in (1.06, 1.0))
    paths = []
    for name, report in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(report))
        paths.append(str(tmp_path / name))
    text = report_module.across_runs([first, second], paths)
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")
             and not line.startswith("  run ")}
    assert lines["gc"].endswith("=> ahead in every run")
    assert lines["static@1.1"].endswith("=> ahead in 1, level in 1 of 2 runs")
    assert "over budget" in lines["nogc"]  # 2x GC's peak: not a rival within the budget
    static_first = paired.compare(*targets.samples(first, "hilore@1.1", "static@1.1", "wall_s"))
    assert f"ahead x{static_first['median']:.3f} [{static_first['low']:.3f}-" in lines["static@1.1"]
    # the console command: the same text; --plot redraws one report only; an unreadable file
    assert cli.main(["bench", "--report", *paths]) == 0
    assert capsys.readouterr().out.strip() == text
    assert cli.main(["bench", "--report", *paths, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "redraws one report" in err[0]
    assert cli.main(["bench", "--report", paths[0], str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.json: not a readable hilore bench report" in err[0]


def test_elision_flags_reach_the_config():
    import argparse

    from ds_hilore.bench import options

    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    argv = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--group-size", "2"]
    assert options.check_args(parser.parse_args(argv))["elide_zero_rows"] == "auto"
    for flags, setting in ((["--no-elision"], False), (["--elide-zero-rows", "false"], False),
                           (["--elide-zero-rows", "true"], True),
                           (["--elide-zero-rows", "whole"], "whole")):
        config = options.check_args(parser.parse_args(argv + flags))
        assert config["elide_zero_rows"] == setting and \
            type(config["elide_zero_rows"]) is type(setting), flags
