"""``hilore bench``: the report's schema and the consistency of what it measured (not speed)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from ds_hilore import cli
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


@pytest.mark.parametrize("flags, words", [
    (["--methods", "nogc,bogus"], ["bogus", "allowed", "hilore", "block_h"]),
    (["--model", "no-such-preset"], ["no-such-preset", "allowed", "qwen2.5-0.5b"]),
    (["--budgets", "1.1,0.9"], ["0.9", ">= 1.0"]),
])
def test_bad_flags_exit_2(capsys, flags, words):
    argv = ["bench", "--model", "tiny", "--seq-len", "32", "--micro-batch", "4"]
    if "--model" in flags:
        argv = ["bench", "--seq-len", "32", "--micro-batch", "4"]
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
