"""``hilore bench``: the report's schema and the consistency of what it measured (not speed)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from ds_hilore import cli
from ds_hilore.bench import targets
from ds_hilore.bench.methods import METHODS

EXACT = ("nogc", "gc", "sac", "block_h", "hr", "hilore_all_r", "hilore_all_h")
RUN_KEYS = {"method", "budget", "tokens_per_s", "peak_bytes", "activation_peak_bytes",
            "within_budget", "grad_err", "plan_mix", "gap_closed", "cpu_s", "recomputed_flops",
            "skipped"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--repeats", "1",
            "--budgets", "1.10", "--codec-backend", "eager", "--threads", "1",
            "--json", str(out / "b.json"), "--plot", str(out / "b.png")]
    assert cli.main(argv) == 0
    with open(out / "b.json", encoding="utf-8") as handle:
        return json.load(handle), out


def _runs(report, method):
    return [r for r in report["runs"] if r["method"] == method]


def test_schema_and_every_method(bench):
    report, out = bench
    assert set(report) >= {"config", "host", "gc_peak_bytes", "profile_s", "runs"}
    assert isinstance(report["gc_peak_bytes"], int) and report["gc_peak_bytes"] > 0
    assert report["profile_s"] > 0  # HiLoRe's warm-up was timed, on its own line
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
        assert row["grad_err"]["mean"] >= 0 and row["grad_err"]["max"] >= row["grad_err"]["mean"]
    assert set(report["efficiency"]) == {"hilore_all_r_vs_gc", "hilore_all_h_vs_nogc"}
    assert all(len(pair) == 2 for pair in report["overlaps"])
    offload = _runs(report, "offload")[0]
    assert "CPU" in offload["skipped"]  # meaningless on a CPU device
    ds_ac = _runs(report, "ds_ac")[0]
    if ds_ac["skipped"]:  # no DeepSpeed group in this process
        assert "--ds-init" in ds_ac["skipped"]
    else:  # an earlier test of this process started one: ds_ac ran, and it is exact
        assert ds_ac["grad_err"]["max"] == 0.0
    for name in ("nogc", "gc", "sac", "block_h", "all_l", "static", "hr", "hilore"):
        assert not _runs(report, name)[0]["skipped"], name


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


def test_gradient_errors(bench):
    """H, R (any mix, any order of storing) and torch's checkpointing recompute the same ops in
    the same order: the gradient equals no checkpointing's bitwise. int8 packing does not."""
    report, _ = bench
    for name in EXACT:
        row = _runs(report, name)[0]
        assert row["grad_err"]["max"] == 0.0, (name, row["grad_err"])
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
    """The verdict for hilore is recomputed from the rows it reports on."""
    report, _ = bench
    (verdict,) = report["targets"]
    me, gc = _runs(report, "hilore")[0], _runs(report, "gc")[0]
    assert verdict["budget"] == me["budget"]
    assert verdict["peak_ratio"] == pytest.approx(me["peak_bytes"] / report["gc_peak_bytes"])
    assert verdict["met"]["peak"] == me["within_budget"]
    assert verdict["grad_err_mean"] == me["grad_err"]["mean"]
    assert verdict["flops_avoided"] == pytest.approx(
        1 - me["recomputed_flops"] / gc["recomputed_flops"])
    assert verdict["gap_closed"] == pytest.approx(me["gap_closed"])
    fits = {(r["method"] if r["budget"] is None else f"{r['method']}@{r['budget']:g}")
            for r in report["runs"] if not r["skipped"] and r["method"] != "hilore"
            and r["peak_bytes"] <= me["budget"] * report["gc_peak_bytes"]
            and r["grad_err"]["mean"] <= targets.ERROR_TOLERANCE}
    assert {r["run"] for r in verdict["rivals"]} == fits


def test_report_reprints_a_saved_run(bench, capsys, tmp_path):
    report, out = bench
    assert cli.main(["bench", "--report", str(out / "b.json"), "--plot", str(tmp_path / "p.png")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("method") and "targets, hilore@1.1: peak" in printed
    assert (tmp_path / "p.png").stat().st_size > 0


def _row(method, budget, tps, cpu, peak, err=0.0, flops=0):
    step = [1000 / x for x in tps]
    return {"method": method, "budget": budget, "peak_bytes": peak, "recomputed_flops": flops,
            "grad_err": {"mean": err, "max": err},
            "tokens_per_s": {"median": tps[1], "min": tps[0], "max": tps[2]},
            "step_s": {"median": step[1], "min": step[2], "max": step[0]},
            "cpu_s": {"median": cpu[1], "min": cpu[0], "max": cpu[2]}}


def test_targets_verdicts_on_known_numbers():
    runs = [_row("nogc", None, (190, 200, 210), (4.6, 4.8, 5.0), 150, flops=0),
            _row("gc", None, (140, 150, 160), (6.0, 6.2, 6.4), 100, flops=100),
            _row("sac", None, (150, 170, 185), (5.4, 5.6, 5.8), 105, flops=10),  # ahead
            _row("all_l", 1.1, (100, 300, 400), (3.0, 3.1, 3.2), 100, err=0.02),  # error: out
            _row("block_h", 1.1, (170, 180, 200), (5.0, 5.2, 5.4), 108),  # inside the spread
            _row("hilore", 1.1, (180, 190, 195), (5.0, 5.1, 5.2), 109, err=0.004, flops=30)]
    (v,) = targets.targets({"gc_peak_bytes": 100, "runs": runs})
    assert v["met"]["peak"] and v["met"]["grad_err"] and v["met"]["flops_avoided"]
    assert v["flops_avoided"] == pytest.approx(0.7)
    assert v["gap_is_real"] and v["gap_closed"] == pytest.approx((1000 / 150 - 1000 / 190)
                                                                 / (1000 / 150 - 1000 / 200))
    assert v["gap_closed_cpu"] == pytest.approx((6.2 - 5.1) / (6.2 - 4.8))
    standing = {r["run"]: (r["wall"], r["cpu"]) for r in v["rivals"]}
    assert standing == {"gc": ("ahead", "ahead"), "sac": ("ahead", "ahead"),
                        "block_h@1.1": ("inside_spread", "inside_spread")}  # nogc: 1.5x GC
    assert v["met"]["ahead_of_rivals"] is False
    assert "inside the spread of block_h@1.1" in targets.targets_text([v])
    runs[-1]["peak_bytes"] = 111
    runs[1]["tokens_per_s"]["min"] = 120  # GC's slowest step below no-GC's fastest: no real gap
    runs[1]["step_s"]["max"] = 1000 / 120
    runs[1]["step_s"]["min"] = 1000 / 200
    (v,) = targets.targets({"gc_peak_bytes": 100, "runs": runs})
    assert v["met"]["peak"] is False and v["met"]["gap_closed"] is None


@pytest.mark.parametrize("flags, words", [
    (["--methods", "nogc,bogus"], ["bogus", "allowed", "hilore", "block_h"]),
    (["--model", "no-such-preset"], ["no-such-preset", "allowed", "qwen2.5-0.5b"]),
    (["--budgets", "1.1,0.9"], ["0.9", ">= 1.0"]),
    (["--no-model"], ["--model is required", "--report"]),
    (["--report", "/nonexistent/b.json"], ["--report", "not a readable hilore bench report"]),
])
def test_bad_flags_exit_2(capsys, flags, words):
    argv = ["bench", "--model", "tiny", "--seq-len", "32", "--micro-batch", "4"]
    if "--model" in flags or flags == ["--no-model"]:
        argv = ["bench", "--seq-len", "32", "--micro-batch", "4"]
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
         "--micro-batch", "4", "--repeats", "1", "--methods", "nogc,gc,ds_ac", "--ds-init",
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
            "--micro-batch", "2", "--repeats", "1", "--methods", "nogc,gc,hilore_all_r",
            "--budgets", "1.2", "--threads", "1", "--codec-backend", "eager", "--json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["layers_built"] == 1
    assert {r["method"] for r in report["runs"]} == {"nogc", "gc", "hilore_all_r"}
    assert _runs(report, "hilore_all_r")[0]["grad_err"]["max"] == 0.0
