"""``hilore bench``: what the report holds and the accounting behind it (never speed).

Two real runs (the bench launching 2 CPU ranks, gloo, DeepSpeed ZeRO-2, on ``tiny``): the
paired mode (3 rounds) and the whole-run mode; every figure the report derives is recomputed
here from the raw per-rank samples it keeps. The rest is pure: flags, data, the stats reading,
the rounds' conductor, paired statistics and the verdicts.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import statistics
import subprocess

import pytest
import torch

from ds_hilore import cli
from ds_hilore.bench import bench, data, options, paired, stats, summary, targets
from ds_hilore.bench import report as report_module
from ds_hilore.bench.methods import METHODS

ROUNDS = 3
TINY = ["bench", "--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--group-size", "4",
        "--grad-accum", "2", "--ranks", "2", "--zero-stage", "2", "--codec-backend", "eager",
        "--threads", "1"]
PAIRED_METHODS = ("nogc", "gc", "static", "hr", "hilore", "hilore_all_r")


def _run(tmp_path_factory, name: str, flags: list[str]) -> dict:
    out = tmp_path_factory.mktemp(name)
    argv = TINY + flags + ["--json", str(out / "b.json"), "--plot", str(out / "b.png")]
    assert cli.main(argv) == 0
    assert (out / "b.png").stat().st_size > 0
    return json.loads((out / "b.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def paired_run(tmp_path_factory):
    return _run(tmp_path_factory, "paired", ["--rounds", str(ROUNDS), "--predict",
                                             "--methods", ",".join(PAIRED_METHODS)])


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    return _run(tmp_path_factory, "whole", ["--run-steps", "6", "--lengths", "16,32",
                                            "--methods", "gc,hilore"])


def _label(row) -> str:
    return row["method"] if row["budget"] is None else f"{row['method']}@{row['budget']:g}"


def _slowest(ranks: list[dict], section: str, index: int, metric: str) -> dict[str, float]:
    every = [r[section][index][metric] for r in ranks]
    return {k: max(e[k] for e in every) for k in every[0]}


# ---------------------------------------------------------------------------------- paired mode
@pytest.mark.distributed
def test_paired_json_holds_every_ranks_samples(paired_run):
    report = paired_run
    ranks = report["samples"]["ranks"]
    assert report["config"]["ranks"] == 2 and report["config"]["zero_stage"] == 2
    assert [r["rank"] for r in ranks] == [0, 1]
    labels = [_label(r) for r in report["runs"]]
    assert labels == ["nogc", "gc", "hilore_all_r", "static@1.1", "hr@1.1", "hilore@1.1"]
    assert report["stop"]["reason"] == "rounds" and len(report["rounds"]) == ROUNDS
    for rank in ranks:
        assert len(rank["rounds"]) == ROUNDS
        for k, entry in enumerate(rank["rounds"]):
            assert set(entry["wall_s"]) == set(entry["cpu_s"]) == set(labels)
            assert all(v > 0 for v in entry["wall_s"].values())
            assert entry["order"] == rank["rounds"][0]["order"][k:] + rank["rounds"][0]["order"][:k]
        assert set(rank["peaks"]) == set(labels) and set(rank["warmup"]) == set(labels)
    for k, entry in enumerate(report["rounds"]):  # a step's time: the slowest rank's
        assert entry["wall_s"] == _slowest(ranks, "rounds", k, "wall_s")
        assert entry["cpu_s"] == _slowest(ranks, "rounds", k, "cpu_s")
        assert entry["step"] == k % report["config"]["batches"]
    for row in report["runs"]:  # a peak: the largest rank's; GC's is the budget's unit
        label = _label(row)
        assert row["peak_bytes"] == max(r["peaks"][label]["peak_bytes"] for r in ranks)
        walls = [e["wall_s"][label] for e in report["rounds"]]
        assert row["step_s"]["median"] == pytest.approx(statistics.median(walls))
        tokens = report["samples"]["shared"]["tokens"]
        assert row["tokens_per_s"]["median"] == pytest.approx(statistics.median(
            tokens[e["step"]] / e["wall_s"][label] for e in report["rounds"]))
    gc = next(r for r in report["runs"] if r["method"] == "gc")
    assert report["gc_peak_bytes"] == gc["peak_bytes"]


@pytest.mark.distributed
def test_paired_verdicts_recomputed_from_the_raw_samples(paired_run):
    report = paired_run
    ranks = report["samples"]["ranks"]

    def times(label, metric):  # per round, the slowest rank's, from every rank's raw samples
        return [max(r["rounds"][k][metric][label] for r in ranks) for k in range(ROUNDS)]

    assert len(report["comparisons"]) == 6 * 5 // 2
    for c in report["comparisons"]:
        for key, metric in (("wall", "wall_s"), ("cpu", "cpu_s")):
            ratios = [b / a for a, b in zip(times(c["a"], metric), times(c["b"], metric))]
            assert c[key]["n"] == ROUNDS
            assert c[key]["median"] == pytest.approx(statistics.median(ratios))
            low, high = _brute_interval([math.log(x) for x in ratios])
            assert (c[key]["low"], c[key]["high"]) == (low, high)  # None, None at 3 rounds
            assert c[key]["verdict"] == "level" and not c[key]["decided"]
    for row in report["runs"]:
        ratios = [g / t for g, t in zip(times("gc", "wall_s"), times(_label(row), "wall_s"))]
        assert row["vs_gc"]["wall"]["median"] == pytest.approx(statistics.median(ratios))
        if row["budget"] is not None:
            assert row["within_budget"] == (row["peak_bytes"] <= row["budget"]
                                            * report["gc_peak_bytes"])
    (verdict,) = report["targets"]
    rivals = {c["rival"] for c in verdict["decisive"]}
    assert {"gc", "static@1.1"} <= rivals and set(verdict["undecided"]) == rivals
    assert report["stop"]["undecided"] == [f"hilore@1.1 vs {r}" for r in verdict["undecided"]]


@pytest.mark.distributed
def test_paired_warm_up_gradients_and_plans(paired_run):
    """Allocators warmed up until two steps showed no warm-up work; exact methods' gradient
    (summed over ranks) equals no checkpointing's bitwise; each allocator's plan names every
    unit; hr packs nothing."""
    report = paired_run
    ranks = report["samples"]["ranks"]
    rows = {_label(r): r for r in report["runs"]}
    units = {f"model.layers.{i}.{kind}" for i in range(2) for kind in ("attn", "mlp")}
    for label, row in rows.items():
        work = ranks[0]["warmup"][label]["work"]
        if METHODS[row["method"]].allocator:
            # the codec's compilation waited for, if at all, in the first step (it runs from attach)
            assert [k for k in work[0] if k != "compile"] == ["profiling"]
            assert work[-2:] == [[], []] and row["warmed"]
            walls = [max(r["warmup"][label]["wall_s"][i] for r in ranks) for i in range(len(work))]
            assert row["warmup_steps"] == len(work)
            assert row["profile_s"] == pytest.approx(sum(walls))
            for actions in row["plans"].values():
                assert set(actions) == units and set(actions.values()) <= set("HLSR")
            assert row["allocator"]["budget_bytes"] > 0
        else:
            assert work == [[]] and row["warmup_steps"] == 1
    for name in ("nogc", "gc", "hr@1.1", "hilore_all_r"):
        assert rows[name]["grad_err"]["max"] == 0.0, name
        assert rows[name]["grad_err_microbatch"]["max"] == 0.0, name
    assert not set(rows["hr@1.1"]["plan_mix"]) & set("LS")
    # a prediction before every forward: once warmed up the steps agree nothing before their
    # forwards, each rank's prediction its own, unless every bucket runs as GC, where a
    # prediction makes every step agree (NOTE [ A steady step agrees nothing before its
    # forwards ] in ds_hilore/plan/steady.py); a forced plan has no scheduler to say
    row = rows["hilore@1.1"]
    assert row["steady_step"] is (not set(row["plans"]) <= set(row["runs_as_gc"])), row
    assert rows["hilore_all_r"]["steady_step"] is None
    assert rows["gc"]["recomputed_flops"] > 0 and rows["nogc"]["recomputed_flops"] == 0
    assert report["profile_s"] == pytest.approx(sum(r["profile_s"] for r in rows.values()
                                                    if METHODS[r["method"]].allocator))


# ---------------------------------------------------------------------------------- whole run
@pytest.mark.distributed
def test_whole_run_accounting(whole_run):
    """Update time = the sum of its steps (each the slowest rank's); warm-up seconds = the sum
    over HiLoRe's warm-up steps (work shown on any rank) of its time minus GC's on the same
    step; the steady ratio is the paired comparison over the steps after the last of them."""
    report = whole_run
    ranks, run = report["samples"]["ranks"], report["run"]
    assert report["stop"]["reason"] == "steps" and len(run["steps"]) == 6
    assert [s["seq_len"] for s in run["steps"]] == run["lengths"]
    assert set(run["lengths"]) <= {16, 32}
    wall = {label: [] for label in run["runs"]}
    warm = []
    for i, step in enumerate(run["steps"]):
        assert step["wall_s"] == _slowest(ranks, "steps", i, "wall_s")
        for label in wall:
            wall[label].append(step["wall_s"][label])
        if any(r["steps"][i]["work"].get("hilore@1.1") for r in ranks):
            warm.append(i)
    assert warm and warm[0] == 0  # nothing warmed beforehand: the first step profiles
    assert run["runs"].keys() == {"nogc", "gc", "hilore@1.1"}
    for label, times in wall.items():
        assert run["runs"][label]["update_s"] == pytest.approx(sum(times))
        assert run["runs"][label]["time_over_gc"] == pytest.approx(sum(times) / sum(wall["gc"]))
    mine = run["runs"]["hilore@1.1"]
    assert mine["warm_up_steps"] == warm
    assert mine["warm_up_s"] == pytest.approx(sum(wall["hilore@1.1"][i] - wall["gc"][i]
                                                  for i in warm))
    after = warm[-1] + 1
    assert mine["steady_from"] == after
    assert mine["steady"] == paired.compare(wall["hilore@1.1"][after:], wall["gc"][after:])
    assert "warm_up_s" not in run["runs"]["gc"]
    text = report_module.run_text(report)
    assert f"warm-up {len(warm)} step(s)" in text


# ---------------------------------------------------------------------------------- flags
def _parsed(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    return parser.parse_args(["--model", "tiny", *flags])


def test_defaults_are_the_decisive_methods_at_one_budget():
    config = options.check_args(_parsed())
    assert config.methods == ("nogc", "gc", "static", "hr", "hilore")
    assert config.budgets == (1.10,) and config.rounds == options.DEFAULT_ROUNDS
    assert (config.device, config.ranks, config.zero_stage) == ("cpu", 2, 2)
    assert (config.layout, config.predict, config.run_steps) == ("shuffled", False, None)
    assert config.elide_zero_rows == "auto"
    assert config.grad_error_tolerance == targets.default_tolerance()
    assert options.Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for flags, setting in ((["--elide-zero-rows", "false"], False),
                           (["--elide-zero-rows", "true"], True),
                           (["--elide-zero-rows", "whole"], "whole")):
        assert options.check_args(_parsed(*flags)).elide_zero_rows == setting
    run = options.check_args(_parsed("--run-steps", "5", "--lengths", "64,128"))
    assert run.run_steps == 5 and run.lengths == (64, 128)
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "--repeats" not in help_text and "--no-elision" not in help_text
    assert "local checkpoint directory" in help_text and "auto,cpu,cuda" in help_text


@pytest.mark.parametrize("flags, words", [
    (["--methods", "nogc,bogus"], ["--methods", "bogus", "allowed", "hilore", "block_h"]),
    (["--model", "no-such-preset"], ["--model no-such-preset", "allowed", "qwen2.5-0.5b"]),
    (["--budgets", "1.1,0.9"], ["--budgets", "0.9", ">= 1.0"]),
    (["--layout", "grouped", "--group-size", "3"], ["--group-size 3", "--micro-batch 4",
                                                    "allowed", "1,2,4"]),
    (["--group-size", "3"], ["--group-size 3", "divisor of 16"]),
    (["--rounds", "zero"], ["--rounds", "allowed", "auto"]),
    (["--rounds", "3", "--run-steps", "4"], ["--rounds with --run-steps", "allowed"]),
    (["--lengths", "64"], ["--lengths", "--run-steps"]),
    (["--run-steps", "4", "--lengths", "4,x"], ["--lengths", "allowed", ">= 8"]),
    (["--run-steps", "0"], ["--run-steps 0", "allowed"]),
    (["--ranks", "0"], ["--ranks 0", "allowed"]),
    (["--device", "cuda"], ["--device cuda", "allowed: cpu"]),
    (["--clip-share", "1.5"], ["--clip-share 1.5", "allowed", "between 0 and 1"]),
    (["--drop-zero-advantage", "--zero-adv-share", "1"], ["--zero-adv-share", "allowed"]),
    (["--grad-error-tolerance", "1.5"], ["--grad-error-tolerance 1.5", "allowed", "0 <= X < 1"]),
    (["--no-model"], ["--model is required", "--report"]),
    (["--report", "/nonexistent/b.json"], ["--report", "not a readable hilore bench report"]),
])
def test_bad_flags_exit_2_with_one_line(capsys, flags, words):
    if "--device" in flags and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
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


@pytest.mark.parametrize("flags, words", [
    (["--repeats", "3"], ["unrecognized arguments: --repeats"]),  # one name per flag: --rounds
    (["--no-elision"], ["unrecognized arguments: --no-elision"]),
    (["--zero-stage", "5"], ["--zero-stage", "invalid choice", "0, 1, 2, 3"]),
    (["--device", "tpu"], ["--device", "'auto', 'cpu', 'cuda'"]),
    (["--layout", "packed"], ["--layout", "'shuffled', 'grouped'"]),
])
def test_argparse_errors_are_one_line_too(capsys, flags, words):
    with pytest.raises(SystemExit) as ended:
        cli.main(["bench", "--model", "tiny", *flags])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    for word in words:
        assert word in err, (word, err)


def test_a_local_checkpoint_directory_is_a_model(tmp_path):
    import transformers

    from ds_hilore.bench import models

    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    assert models.is_model(str(tmp_path / "ckpt")) and not models.is_model(str(tmp_path))
    model = models.build_model(str(tmp_path / "ckpt"), "fp32", "cpu", seed=0, layers=1, lora_r=4)
    assert len(models.lm_of(model).get_decoder().layers) == 1
    assert options.check_args(_parsed()).model == "tiny"
    args = _parsed()
    args.model = str(tmp_path / "ckpt")
    assert options.check_args(args).model == str(tmp_path / "ckpt")


def test_a_checkpoint_directory_the_ranks_could_not_load_is_refused_before_they_start(tmp_path):
    import transformers

    transformers.ViTConfig().save_pretrained(tmp_path / "vit")  # not a causal LM
    transformers.Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4
                             ).save_pretrained(tmp_path / "bare")  # no weights
    for name, expected in [("vit", "holds a 'vit' model, not a causal LM"),
                           ("bare", "no weights there")]:
        args = _parsed()
        args.model = str(tmp_path / name)
        with pytest.raises(options.BenchError, match=expected):
            options.check_args(args)


def test_full_fine_tuning_takes_no_lora_rank():
    assert options.check_args(_parsed("--full", "--lora-r", "0")).lora_r is None
    with pytest.raises(options.BenchError, match="--lora-r 0: allowed: a rank >= 1"):
        options.check_args(_parsed("--lora-r", "0"))


# ---------------------------------------------------------------------------------- data
def _step(**flags) -> tuple[data.Shape, list[dict]]:
    shape = data.Shape(**{"micro_batch": 8, "group_size": 4, "grad_accum": 3, "ranks": 2,
                          "zero_adv_share": 0.5, "clip_share": 0.2, **flags})
    return shape, data.global_step(shape, vocab=100, seq_len=64, seed=5, index=1)


@pytest.mark.parametrize("layout", data.LAYOUTS)
def test_grpo_data_is_what_the_flags_say(layout):
    shape, step = _step(layout=layout)
    again = _step(layout=layout)[1]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(step, again) for k in a)  # pure
    assert len(step) == shape.microbatches == 6
    groups = torch.cat([m["group"] for m in step])
    adv = torch.cat([m["advantages"] for m in step])
    assert sorted(groups.tolist()) == sorted(torch.arange(shape.sequences).div(4, rounding_mode="floor").tolist())
    for m in step:
        assert m["input_ids"].shape == (shape.micro_batch, 64)
        assert m["mask"].shape == m["old_offset"].shape == (shape.micro_batch, 63)
        assert m["mask"][:, :15].sum() == 0 and (m["mask"].sum(1) > 0).all()
        assert (m["old_offset"][m["mask"] == 0] == 0).all()
        assert data.exposure(m) == pytest.approx((m["advantages"].abs() * m["mask"].sum(1)).tolist())
    zero = [k for k in groups.unique() if (adv[groups == k] == 0).all()]
    assert len(zero) == round(shape.zero_adv_share * len(groups.unique()))
    assert all((adv[groups == k] != 0).all() for k in groups.unique() if k not in zero)
    mask = torch.cat([m["mask"] for m in step]).bool()
    ratio = torch.exp(-torch.cat([m["old_offset"] for m in step]))[mask]
    clipped = ((ratio < 1 - data.EPSILON_LOW) | (ratio > 1 + data.EPSILON_HIGH)).sum()
    assert int(clipped) == round(shape.clip_share * int(mask.sum()))
    spans = [len(m["group"].unique()) for m in step]
    if layout == "grouped":  # whole groups in one microbatch
        assert spans == [2] * 6
    else:  # shuffled: a group's completions spread over microbatches
        assert max(spans) > 2
    total, exposed = data.prediction(step)
    assert total == pytest.approx(sum(sum(data.exposure(m)) for m in step))
    assert exposed == sum(1 for m in step if m["advantages"].abs().sum() > 0)
    assert data.rank_microbatches(step, shape, 1) == step[3:]
    assert data.tokens(step) == shape.sequences * 64


def test_grpo_data_filtered_variant_drops_every_zero_advantage():
    shape, full = _step(layout="grouped")
    _, kept = _step(layout="grouped", drop_zero_advantage=True)
    adv = torch.cat([m["advantages"] for m in full])
    got = torch.cat([m["advantages"] for m in kept])
    assert (got != 0).all() and torch.equal(got, adv[adv != 0])
    assert len(kept) == shape.microbatches  # DeepSpeed's accumulation: a fixed count
    assert [len(m["advantages"]) for m in kept] == [4] * 6  # 24 kept over 6, as even as can be


def test_step_lengths_are_seeded_draws_of_the_lengths():
    lengths = data.step_lengths([128, 256, 512], 30, seed=3)
    assert lengths == data.step_lengths([128, 256, 512], 30, seed=3)
    assert set(lengths) == {128, 256, 512}


# ---------------------------------------------------------------------------------- stats
def _plans(**buckets) -> dict:
    return {k: (None if v is None else {"actions": dict(v)}) for k, v in buckets.items()}


def test_step_work_reads_warm_up_off_the_stats():
    keep = {"a": "H", "b": "R"}
    fresh = {"plans": {}, "calibration": {"microbatches": 0, "seconds": 0.0}, "leave_one_out": {}}
    profiling = dict(fresh, plans=_plans(**{"8x32": None}))
    planned = dict(fresh, plans=_plans(**{"8x32": keep}))
    calibrated = dict(planned, calibration={"microbatches": 1, "seconds": 0.2})
    validated = dict(calibrated, leave_one_out={"8x32": {"utilities_s": {}}})
    assert stats.step_work(None, fresh) == []
    assert stats.step_work(None, profiling) == ["profiling"]
    assert stats.step_work(profiling, planned) == ["planning", "leave-one-out"]
    assert stats.step_work(planned, planned) == ["leave-one-out"]  # under way: no entry yet
    assert stats.step_work(planned, planned, validates=False) == []
    assert stats.step_work(planned, calibrated) == ["calibration", "leave-one-out"]
    assert stats.step_work(calibrated, validated) == ["leave-one-out"]  # it ended in this step
    assert stats.step_work(validated, validated) == []
    replanned = dict(validated, plans=_plans(**{"8x32": {"a": "R", "b": "R"}}))
    assert stats.step_work(validated, replanned) == ["planning"]
    all_r = dict(fresh, plans=_plans(**{"8x32": {"a": "R"}}))
    assert stats.step_work(all_r, all_r) == []  # an all-R plan has nothing to validate
    assert stats.step_work(None, dict(validated, warm_up=["calibration"])) == ["calibration"]
    # a bucket still profiled or validated counts for the steps whose lengths fall in it
    two = dict(validated, plans=_plans(**{"8x32": keep, "8x64": None}))
    assert stats.step_work(two, two, lengths=[20]) == []  # 20 -> the 8x32 bucket, done
    assert stats.step_work(two, two, lengths=[33]) == ["profiling"]  # 33 -> 64
    assert stats.step_work(two, two) == ["profiling"]  # lengths unknown: any bucket
    assert stats.step_work(planned, planned, lengths=[64]) == []
    assert stats.step_work(planned, planned, lengths=[32]) == ["leave-one-out"]


# ---------------------------------------------------------------------------------- conductor
def _samples(walls: dict[str, list[float]], peaks: dict[str, int], ranks: int = 2) -> dict:
    """Raw samples of ``len(walls[...])`` paired rounds; rank r's time is the value times
    (1 + r / 100), its peak the value less r."""
    labels = list(walls)
    n = len(next(iter(walls.values())))

    def record(r):
        return {"rank": r, "block_h": {}, "flops": {k: [100, 100] for k in labels},
                "warmup": {k: {"wall_s": [0.5], "cpu_s": [0.5], "work": [[]]} for k in labels},
                "peaks": {k: {"peak_bytes": peaks[k] - r, "activation_peak_bytes": 1} for k in labels},
                "rounds": [{"round": i, "step": 0, "order": labels,
                            "wall_s": {k: walls[k][i] * (1 + r / 100) for k in labels},
                            "cpu_s": {k: walls[k][i] for k in labels}} for i in range(n)]}

    shared = {"runs": labels, "skipped": {}, "notes": {}, "warmed": {}, "hilore": {},
              "tokens": [1000], "phase": "paired rounds",
              "grad_err": {k: {"step": [0.0], "microbatch": [0.0]} for k in labels}}
    return {"phase": "paired rounds", "waiting": n, "ranks": [record(r) for r in range(ranks)],
            "shared": shared}


def _conductor(*flags: str) -> bench.Conductor:
    return bench.Conductor(options.check_args(_parsed(*flags)), None)


def test_the_conductor_stops_the_rounds_when_told_decided_or_out_of_time():
    g = random.Random(3)
    loads = [g.uniform(1.0, 1.5) for _ in range(12)]
    walls = {"nogc": [0.8 * x for x in loads], "gc": [1.2 * x for x in loads],
             "static@1.1": [1.1 * x * g.uniform(0.99, 1.01) for x in loads],
             "hilore@1.1": [1.0 * x * g.uniform(0.99, 1.01) for x in loads]}
    peaks = {"nogc": 300, "gc": 100, "static@1.1": 105, "hilore@1.1": 108}

    def first(n):
        return _samples({k: v[:n] for k, v in walls.items()}, peaks)

    fixed = _conductor("--rounds", "4")
    assert [fixed.word(first(k), k) for k in range(5)] == [True] * 4 + [False]
    assert fixed.stop["reason"] == "rounds"
    auto = _conductor("--rounds", "auto")
    said = [auto.word(first(k), k) for k in range(12)]
    assert said.index(False) == paired.MIN_ROUNDS  # decided once an interval exists
    assert auto.stop == {"reason": "decided", "undecided": []}
    timed = _conductor("--rounds", "auto", "--max-minutes", "0.001")
    assert timed.word(first(0), 0) and not timed.word(first(1), 1)  # one more would pass it
    assert timed.stop["reason"] == "max_minutes"
    stopped = _conductor("--rounds", "10")
    assert stopped.word(first(0), 0)
    stopped.interrupted()  # what the launch calls on SIGINT (it also asks the ranks to stop)
    assert not stopped.word(first(1), 1) and stopped.stop["reason"] == "interrupted"
    assert stopped.document(first(1), final=True)["stop"]["reason"] == "interrupted"
    doc = auto.document(first(6), final=True)  # rank 1 is the slower: its times count
    assert doc["rounds"][0]["wall_s"]["gc"] == pytest.approx(walls["gc"][0] * 1.01)
    assert doc["gc_peak_bytes"] == 100 and doc["stop"]["reason"] == "decided"
    assert summary.slowest([{"a": 1.0, "b": 3.0}, {"a": 2.0, "b": 1.0}]) == {"a": 2.0, "b": 3.0}
    assert summary.slowest([{"a": 1.0, "b": 3.0}, {"a": 2.0}]) == {"a": 2.0}  # b: one rank's only


def test_an_end_the_bench_did_not_ask_for_is_an_interrupt(tmp_path, capsys):
    samples = _samples({"nogc": [], "gc": []}, {"nogc": 2, "gc": 1})
    samples["shared"].update(phase="warming up", interrupted=True)
    conductor = _conductor()
    doc = conductor.document(samples, final=True)
    assert doc["stop"] == {"reason": "interrupted", "undecided": [], "phase": "warming up"}
    path = tmp_path / "b.json"
    assert bench._output(doc, str(path), None) == 1
    assert json.loads(path.read_text())["stop"]["phase"] == "warming up"
    assert "interrupted while warming up, before any timed step" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the update
def test_each_forward_is_preceded_by_its_predicted_exposure():
    """With --predict the update hands HiLoRe |A_i| x response tokens of the next microbatch,
    with the step's total over every rank's microbatches, before that microbatch's forward;
    then engine.backward and engine.step, as a DeepSpeed actor update does."""
    from ds_hilore.bench import engines, models

    model = models.build_model("tiny", "fp32", "cpu", seed=0, lora_r=4)
    shape = data.Shape(micro_batch=4, group_size=2, grad_accum=3, ranks=2, layout="grouped")
    step = data.global_step(shape, vocab=512, seq_len=16, seed=0, index=0)
    events = []

    class Recorder:
        def expect(self, exposure, step_exposure=None, exposed_microbatches=None):
            events.append(("expect", exposure, step_exposure, exposed_microbatches))

    class Engine:  # what train_step calls of a DeepSpeed engine
        module, hilore = model, Recorder()

        def __call__(self, **kwargs):
            events.append(("forward",))
            return model(**kwargs)

        def backward(self, loss):
            events.append(("backward",))
            loss.backward()

        def step(self):
            events.append(("step",))

    mine = data.rank_microbatches(step, shape, 1)
    engines.train_step(engines.Run("hilore", 1.1, engine=Engine()), mine, data.prediction(step))
    total = sum(float((m["advantages"].abs() * m["mask"].sum(1)).sum()) for m in step)
    exposed = sum(1 for m in step if float(m["advantages"].abs().sum()) > 0)
    expected = []
    for m in mine:
        exposure = (m["advantages"].abs() * m["mask"].sum(1)).tolist()
        expected += [("expect", pytest.approx(exposure), pytest.approx(total), exposed),
                     ("forward",), ("backward",), ("step",)]
    assert events == expected


def test_every_method_has_an_engine_config():
    from ds_hilore.bench import engines
    from ds_hilore.config import HiLoReConfig

    config = options.check_args(_parsed("--grad-error-tolerance", "0.004",
                                        "--elide-zero-rows", "whole"))
    for method in METHODS.values():
        cfg = engines.ds_config(config, method, 1.1, block_k=1, layers=2, numel=1000)
        assert cfg["zero_optimization"]["stage"] == 2
        assert cfg["gradient_accumulation_steps"] == config.grad_accum
        if method.engine != "hilore":
            assert "hilore" not in cfg, method.name
            continue
        block = HiLoReConfig(**cfg["hilore"])
        assert block.elide_zero_rows == "whole" and block.grad_error_tolerance == 0.004
        assert ("memory_budget" in cfg["hilore"]) == (method.budgeted and not method.searched)
    block_h = engines.ds_config(config, METHODS["block_h"], 1.1, block_k=1, layers=2)["hilore"]
    assert block_h["force_plan"] == {"*": "R", "model.layers.1.*": "H"}
    assert METHODS["static"].blind and METHODS["hr"].hilore == {"low_precision": "none"}


# ---------------------------------------------------------------------------------- the GPU script
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
    # sequences) and skipped its backward; true elided the zero groups of the mixed step, and
    # the all-zero microbatch with its backward run
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


def test_device_check_refuses_cuda_without_a_device(capsys):
    from ds_hilore.bench import device_check

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert device_check.main(["--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err


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


def test_gpu_script_runs_this_bench_on_one_gpu():
    """Every bench flag the GPU script passes is one the bench has, with one rank on CUDA,
    ZeRO-2, bf16, the paper's model, and the whole-run mode."""
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "bench", "gpu.sh")
    text = open(path, encoding="utf-8").read().replace("\\\n", " ")
    calls = [line.split("ds_hilore.cli bench", 1)[1] for line in text.splitlines()
             if "ds_hilore.cli bench" in line]
    assert len(calls) == 2
    parser = cli.build_parser()
    bench_parser = parser._subparsers._group_actions[0].choices["bench"]
    known = {s for a in bench_parser._actions for s in a.option_strings}
    for call in calls:
        flags = {w for w in call.split() if w.startswith("--")}
        assert flags <= known, flags - known
        for flag in ("--device cuda", "--ranks 1", "--zero-stage 2", "--dtype bf16",
                     "--model qwen2.5-1.5b"):
            assert flag in call
    assert "--run-steps" in calls[1] and "--lengths" in calls[1]


def test_plot_styles_are_distinct_per_method():
    styles = report_module._STYLE[: len(METHODS)]
    assert len(styles) == len(METHODS)  # one style per registered method
    assert len({s[:-1] for s in styles}) == len(styles) and len({s[-1] for s in styles}) == len(styles)


# ---------------------------------------------------------------------------------- statistics
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
    # a time not measured (0, inf, NaN) on either side: no ratio, no verdict, never a crash
    for bad in (0.0, math.inf, math.nan):
        for mine, theirs in ((base[:9] + [bad], slower), (base, slower[:9] + [bad])):
            c = paired.compare(mine, theirs)
            assert c["median"] is None and c["verdict"] == "level" and not c["decided"]


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




def test_a_codec_that_fell_back_to_eager_is_reported():
    """A codec kernel whose compilation failed in the ranks runs eager; the report says which."""
    samples = _samples({"nogc": [1.0], "gc": [1.1]}, {"nogc": 2, "gc": 1})
    samples["shared"]["codec_compile_failures"] = {"int8.encode": "InductorError: no compiler"}
    doc = _conductor().document(samples, final=True)
    assert doc["host"]["codec_compile_failures"] == {"int8.encode": "InductorError: no compiler"}
    line = [x for x in report_module.table(doc).splitlines() if "torch.compile failed" in x]
    assert line and "int8.encode" in line[0]
