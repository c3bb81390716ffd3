"""``make demo``'s conclusions (examples/grpo/accounting.py, demo.py, figure.py, flops.py),
recomputed from synthetic per-step records of two runs: the paired per-step ratio and its
interval over the steady steps, the whole run's sums, HiLoRe's warm-up cost, the peaks against
the budget, the quality check, the figure, and the FLOP share counted on a tiny model. No
timing is asserted: the times below are made up.
"""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from ds_hilore.bench import paired
from examples.grpo import accounting, demo
from examples.grpo.figure import plot
from examples.grpo.flops import count_update_flops, recompute_share, recomputed

MiB = 1 << 20
STEPS = 12
WARM = {1: {"profiling": 4, "planning": 1}, 2: {"leave-one-out": 2}}  # HiLoRe learned in steps 1-2
METERED = {1, 6}  # both runs metered memory in these steps


def _records(times: list[float], hilore: bool, digest: str = "same") -> list[dict]:
    out = [{"step": 0, "total_steps": STEPS, "held_out_reward": 0.5}]
    for step, seconds in enumerate(times, 1):
        r = {"step": step, "train_reward": 0.5 + step / 100, "update_s": seconds, "metered": step in METERED,
             "update_tokens_per_s": None if step in METERED else 1000 / seconds,
             "held_out_reward": 0.5 + step / 50 if step % 6 == 0 else None,
             "trainable_sha256": f"{digest}{step}"}
        if hilore:
            r["warm_up"] = WARM.get(step, {})
        out.append(r)
    return out


def _summary(peaks: list[int], hilore: bool, flops: dict) -> dict:
    return {"held_out_before": 0.5, "held_out_after": 0.74, "peak_bytes_per_rank": peaks,
            "memory_budget": 1.10 if hilore else None, "sequences_per_microbatch": 8, "flops": flops,
            "actions": {"H": 10, "L": 0, "R": 30, "E": 2} if hilore else None}


GC_TIMES = [3.0, 2.0, 2.1, 1.9, 2.2, 2.5, 2.0, 2.3, 2.1, 1.8, 2.4, 2.0]
HL_TIMES = [9.0, 3.0, 1.9, 1.7, 2.0, 2.6, 1.8, 2.0, 1.9, 1.7, 2.1, 1.9]
GC_FLOPS = {"update_flops": 300e9, "no_checkpointing_flops": 210e9, "recomputed_flops": 90e9,
            "recompute_share": 0.3, "tokens_per_microbatch": 1800.0}
HL_FLOPS = {"update_flops": 240e9, "no_checkpointing_flops": 210e9, "recomputed_flops": 30e9,
            "recompute_share": 0.125, "tokens_per_microbatch": 1800.0}


@pytest.fixture
def numbers():
    return accounting.account(_records(GC_TIMES, False), _records(HL_TIMES, True),
                              _summary([200 * MiB, 210 * MiB], False, GC_FLOPS),
                              _summary([216 * MiB, 220 * MiB], True, HL_FLOPS))


def test_the_per_step_ratio_pairs_the_steady_unmetered_steps_by_index(numbers):
    steady = [s for s in range(1, STEPS + 1) if s not in WARM and s not in METERED]
    p = numbers["per_step"]
    assert p["steps"] == steady == [3, 4, 5, 7, 8, 9, 10, 11, 12]
    expected = paired.compare([HL_TIMES[s - 1] for s in steady], [GC_TIMES[s - 1] for s in steady])
    assert {k: p[k] for k in expected} == expected
    assert p["median"] == pytest.approx(sorted(GC_TIMES[s - 1] / HL_TIMES[s - 1] for s in steady)[4])
    assert p["low"] <= p["median"] <= p["high"] and p["n"] == 9


def test_the_whole_run_sums_every_step_and_charges_the_warm_up_to_hilore(numbers):
    w = numbers["whole_run"]
    assert w["gc_s"] == pytest.approx(sum(GC_TIMES)) and w["hilore_s"] == pytest.approx(sum(HL_TIMES))
    assert w["speedup"] == pytest.approx(sum(GC_TIMES) / sum(HL_TIMES))
    assert w["warm_up_steps"] == [1, 2]
    assert w["warm_up_cost_s"] == pytest.approx((9.0 - 3.0) + (3.0 - 2.0))


def test_peaks_are_compared_rank_by_rank_and_the_largest_against_the_budget(numbers):
    p = numbers["peaks"]
    assert p["ratio"] == pytest.approx([216 / 200, 220 / 210]) and p["memory_budget"] == 1.10
    assert p["largest_ratio"] == pytest.approx(220 / 210) and p["within"] is True
    over = accounting.peaks(_summary([100 * MiB], False, {}), _summary([111 * MiB], True, {}))
    assert over["within"] is False
    # the budget is a multiple of GC's peak agreed over ranks, the largest: a rank whose own
    # GC peak is lower may hold more than 1.10x of it
    uneven = accounting.peaks(_summary([240 * MiB, 210 * MiB], False, {}),
                              _summary([237 * MiB, 237 * MiB], True, {}))
    assert uneven["ratio"][1] > 1.10 and uneven["within"] is True
    assert uneven["largest_ratio"] == pytest.approx(237 / 240)


def test_the_quality_check_tells_a_bitwise_trajectory_from_one_that_differs(numbers):
    q = numbers["quality"]
    assert q["bitwise"] and q["same_after"] and q["gc_after"] == q["hilore_after"] == 0.74
    differs = accounting.quality(_records(GC_TIMES, False), _records(HL_TIMES, True, digest="other"),
                                 _summary([], False, {}), _summary([], True, {}))
    assert not differs["bitwise"]


def test_the_regime_is_gc_recompute_share_and_what_hilore_avoids(numbers):
    r = numbers["regime"]
    assert r["gc_recompute_share"] == 0.3 and r["sequences_per_microbatch"] == 8
    assert r["recompute_avoided"] == pytest.approx(1 - 30 / 90)
    assert accounting.regime(_summary([], False, None), _summary([], True, None))["recompute_avoided"] is None


def test_too_few_steady_steps_give_no_interval_and_say_level():
    times = [2.0, 2.0, 1.0]
    out = accounting.per_step(accounting.paired_steps(_records(times, False), _records(times, True)))
    assert out["steps"] == [3] and out["low"] is None and out["verdict"] == "level"


def test_the_demo_writes_its_summary_and_a_figure_from_the_two_runs(tmp_path, numbers):
    dirs = {}
    for name, times, peaks, flops in (("GC", GC_TIMES, [200 * MiB] * 2, GC_FLOPS),
                                      ("HiLoRe", HL_TIMES, [216 * MiB] * 2, HL_FLOPS)):
        d = dirs[name] = tmp_path / name.lower()
        d.mkdir()
        records = _records(times, name == "HiLoRe")
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (d / "summary.json").write_text(json.dumps(_summary(peaks, name == "HiLoRe", flops)))
    out = demo.conclude(dirs, tmp_path, seconds=300.0)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["per_step"]["median"] == numbers["per_step"]["median"] and saved["minutes"] == 5.0
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out["figure"] == str(tmp_path / "demo.png")
    printed = demo.text(out)
    for piece in ("whole run", "GC time / HiLoRe time", "30 %", "budget 1.10x",
                  "the same trajectory, bitwise", "2 steps", "10/0/30/2", "5.0 min"):
        assert piece in printed


def test_the_figure_takes_runs_without_throughput_or_warm_up(tmp_path):
    records = [{"step": 0, "held_out_reward": 0.5}, {"step": 1, "train_reward": 0.4, "update_tokens_per_s": None}]
    path = plot(records, records, tmp_path / "sub" / "x.png")
    assert path.is_file() and path.stat().st_size > 0


# ---------------------------------------------------------------------------------- FLOPs
def test_recomputed_flops_count_what_a_microbatch_runs_above_no_checkpointing():
    assert recomputed([130, 100, 90], [100, 100, 100]) == 30  # a skipped backward counts 0
    assert recompute_share({"update_flops": 200, "recomputed_flops": 50}) == 0.25
    assert recompute_share(None) is None and recompute_share({"update_flops": 0}) is None
    with pytest.raises(ValueError, match="count the same ones"):
        recomputed([1, 2], [1])


def _tiny_actor():
    import transformers

    from examples.grpo.model import add_lora
    from examples.grpo.rollout import set_checkpointing

    config = transformers.Qwen2Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = add_lora(transformers.Qwen2ForCausalLM(config), 4, "layers.", only_optimize_lora=True)
    model.train()
    set_checkpointing(model, True)
    return model


def _tiny_rollout(n: int = 4, prompt: int = 6, completion: int = 10):
    from examples.grpo.rollout import Rollout

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (n, prompt + completion), generator=g)
    mask = torch.ones(n, completion, dtype=torch.bool)
    return Rollout(ids, torch.ones_like(ids), prompt, mask, torch.rand(n, generator=g),
                   torch.tensor([1.0, -1.0, 0.5, -0.5]), -torch.rand(n, completion, generator=g), None)


def test_gc_recomputes_a_share_of_the_update_flops_and_training_state_is_left_alone():
    model = _tiny_actor()
    engine = types.SimpleNamespace(module=model, hilore=None, device=torch.device("cpu"))
    args = types.SimpleNamespace(per_device_training_batch_size=2, gradient_accumulation_steps=2,
                                 loss_type="grpo", drop_zero_rows=False, beta=0.0, epsilon=0.2, epsilon_high=None,
                                 max_answer_seq_len=10)
    before = [p.detach().clone() for p in model.parameters()]
    gc = count_update_flops(engine, _tiny_rollout(), args, checkpointing=True)
    assert model.get_base_model().is_activation_checkpointing  # the run's checkpointing restored
    assert gc["microbatches"] == 2 and gc["sequences_per_microbatch"] == 2 and gc["tokens_per_microbatch"] == 32
    assert gc["update_flops"] - gc["no_checkpointing_flops"] == gc["recomputed_flops"] > 0
    assert 0.15 < gc["recompute_share"] < 0.5  # LoRA: the forward again, of a backward without weight gradients
    none = count_update_flops(engine, _tiny_rollout(), args, checkpointing=False)
    assert none["recomputed_flops"] == 0 and math.isclose(none["update_flops"], gc["no_checkpointing_flops"])
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not model.get_base_model().is_activation_checkpointing  # that run had none


# ---------------------------------------------------------------------------------------------
# NOTE [ Runs in turns ] (examples/grpo/turns.py): two processes, each phase in turns
# ---------------------------------------------------------------------------------------------
def _take_turns(folder: str, arm: int, log: str) -> None:
    import time

    from examples.grpo.turns import Turns

    turns = Turns(folder, arm, 2)
    turns.ready()
    for phase in range(4):
        with turns.turn(phase):
            with open(log, "a") as f:
                f.write(f"begin {phase} {arm}\n")
            time.sleep(0.02)  # a phase's work: the other run must not begin meanwhile
            with open(log, "a") as f:
                f.write(f"end {phase} {arm}\n")


def test_runs_in_turns_take_every_phase_one_after_the_other(tmp_path):
    import multiprocessing

    from examples.grpo.turns import first_turn

    log = tmp_path / "log"
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_take_turns, args=(str(tmp_path), arm, str(log))) for arm in (1, 0)]
    for p in procs:
        p.start()
    first_turn(tmp_path)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    want = [f"{what} {phase} {arm}" for phase in range(4) for arm in (0, 1) for what in ("begin", "end")]
    assert log.read_text().split("\n")[:-1] == want
    assert sorted(x.name for x in tmp_path.glob("ready.*")) == ["ready.0", "ready.1"]


@pytest.mark.parametrize("argv,message", [
    (["--turn", "2/2"], r"--turn '2/2': expected ARM/ARMS with 0 <= ARM < ARMS"),
    (["--turns", "no/such/folder"], r"--turns no/such/folder: runs in turns start from step 0"),
])
def test_runs_in_turns_refuse_a_bad_place_or_folder(argv, message):
    from examples.grpo.arguments import UsageError, parse_args

    with pytest.raises(UsageError, match=message):
        parse_args(["--actor_model_name_or_path", "qwen2-small", *argv])
