"""The GRPO example (examples/grpo): task and reward, arguments, the warm-start cache, and short
2-rank ZeRO-2 LoRA runs launched as a user would launch them.

The runs (tiny preset, 3 steps): gradient checkpointing; HiLoRe with force_plan "H" and a
checkpoint after step 2; and that run resumed from its step-2 checkpoint. HiLoRe's H and
transformers' GC are both exact, and every sample is seeded by (seed, step, rank), so the three
trajectories -- rewards, losses, held-out rewards, final LoRA weights -- are equal bitwise.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.grpo import model as model_module
from examples.grpo.arguments import UsageError, parse_args
from examples.grpo.task import (
    CountTask,
    JsonlTask,
    ReverseTask,
    char_match,
    exact_match,
    load_task,
)
from examples.grpo.warm_start import cache_dir, cache_key, prepare_actor
from tests.launch import REPO_ROOT, run_distributed

GC_CONFIG = "examples/grpo/ds_config_gc.json"
HILORE_CONFIG = REPO_ROOT / "examples/grpo/ds_config_hilore.json"


# ---------------------------------------------------------------------------------- reward
@pytest.mark.parametrize("reward", [char_match, exact_match])
def test_a_correct_answer_scores_one_and_malformed_output_zero(reward):
    assert reward("dcba", "dcba") == 1.0
    for malformed in (None, "", 17, b"dcba"):  # no <eos> (None), empty, not text
        assert reward(malformed, "dcba") == 0.0


def test_char_match_gives_partial_credit_per_position():
    assert char_match("dcbx", "dcba") == 0.75
    assert char_match("dcb", "dcba") == 0.75  # a missing character counts as a wrong one
    assert char_match("dcbaa", "dcba") == 0.8  # so does an extra one
    assert char_match("xxxx", "dcba") == 0.0
    assert char_match("dcab", "dcba") == 0.5
    assert exact_match("dcbx", "dcba") == 0.0


# ---------------------------------------------------------------------------------- task
def test_reverse_task_is_seeded_and_answers_are_reversals():
    task = ReverseTask()
    a = task.sample(random.Random(3), 50)
    assert a == task.sample(random.Random(3), 50)
    for e in a:
        assert e.prompt.endswith("=") and e.answer == e.prompt[:-1][::-1]
        assert task.min_len <= len(e.answer) <= task.max_len and set(e.answer) <= set(task.alphabet)
    assert task.held_out(20) == task.held_out(20)


@pytest.mark.parametrize("task", [ReverseTask(), CountTask()])
def test_held_out_prompts_never_appear_in_training(task):
    train = {e.prompt for e in task.sample(random.Random(0), 5000, "train")}
    held_out = {e.prompt for e in task.held_out(500)}
    assert len(held_out) > 400 and not train & held_out


def test_count_task_writes_out_three_digit_arithmetic_sequences_of_long_answers():
    task = CountTask()
    a = task.sample(random.Random(3), 200)
    assert a == task.sample(random.Random(3), 200)
    longest_prompt, longest_answer = task.longest
    for e in a:
        first, rest = e.prompt[:-1].split("+")
        step, last = map(int, rest.split(":"))
        terms = [int(t) for t in e.answer.split(" ")]
        assert terms[0] == int(first) and terms[-1] == last and all(b - a == step for a, b in zip(terms, terms[1:]))
        assert all(100 <= t <= 999 for t in terms) and task.min_terms <= len(terms) <= task.max_terms
        assert len(e.prompt) <= longest_prompt and 151 <= len(e.answer) <= longest_answer == 199
        assert set(e.prompt + e.answer) <= set(task.characters)
    assert char_match(a[0].answer[:-1] + "x", a[0].answer) == 1 - 1 / len(a[0].answer)  # one digit wrong


def test_jsonl_task_splits_by_prompt_and_names_its_reward(tmp_path):
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(200)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task(str(path), "char_match")
    assert isinstance(task, JsonlTask) and task.reward == "char_match"
    train, held = task.split("train"), task.split("held_out")
    assert len(train) + len(held) == 200 and held and not {e.prompt for e in train} & {e.prompt for e in held}


@pytest.mark.parametrize("content, reward, message", [
    (None, None, "no such file"),
    ('{"prompt": "a"}\n', None, "line 1"),
    ('{"prompt": "a", "answer": "b"}\n', "bleu", "known: char_match, exact_match"),
])
def test_bad_data_ends_with_a_message_that_says_what_to_fix(tmp_path, content, reward, message):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_task(str(path), reward)


# ---------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("argv, message", [
    (["--actor_model_name_or_path", "qwen9-huge"], "neither a local directory nor a built-in preset"),
    (["--group_size", "1"], "--group_size 1: must be 2 or more"),
    (["--deepspeed_config", "nowhere.json"], "--deepspeed_config nowhere.json: no such file"),
    (["--data_path", "nowhere.jsonl"], "--data_path nowhere.jsonl: no such file"),
    (["--per_device_training_batch_size", "48"], "not a multiple of"),
    (["--drop_zero_rows", "--beta", "0.1"], "--drop_zero_rows needs --beta 0"),
    (["--only_optimize_lora"], "needs LoRA"),
    (["--task", "count"], "--max_answer_seq_len 10: --task count's answers run to 199 tokens"),
    (["--task", "count", "--max_answer_seq_len", "200", "--max_prompt_seq_len", "8"], "raise it to 10"),
    (["--task", "count", "--data_path", "README.md"], "pass one of them"),
    (["--epsilon", "-1"], "--epsilon -1.0: the clip range must be a finite number >= 0"),
    (["--epsilon_high", "nan"], "--epsilon_high nan: the upper clip must be"),
    (["--beta", "nan"], "--beta nan: the KL coefficient must be"),
    (["--actor_learning_rate", "-1"], "--actor_learning_rate -1.0: the learning rate must be"),
])
def test_bad_arguments_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_args(argv)


def test_a_bad_argument_ends_the_trainer_with_one_line_and_no_traceback():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-m", "examples.grpo.train", "--group_size", "1"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2
    ours = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: --group_size 1: must be 2 or more (GRPO compares the completions of one "
                    "prompt with each other)."]
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------- warm start
@pytest.fixture
def quick_preset(monkeypatch):
    """The tiny preset with a 2-step warm start (the cache logic does not care how long)."""
    preset = model_module.Preset("qwen2", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                 warm_start_steps=2, warm_start_batch=4, warm_start_lr=1e-3)
    monkeypatch.setitem(model_module.PRESETS, "test-quick", preset)
    return "test-quick"


def test_warm_start_cache_is_keyed_by_preset_seed_and_task(quick_preset):
    task = ReverseTask()
    base = cache_key(quick_preset, 0, task)
    others = [cache_key("qwen2-tiny", 0, task), cache_key(quick_preset, 1, task),
              cache_key(quick_preset, 0, ReverseTask(max_len=9)),
              cache_key(quick_preset, 0, ReverseTask(alphabet="xyz")), cache_key(quick_preset, 0, CountTask())]
    dirs = {cache_dir("c", k) for k in [base, *others]}
    assert len(dirs) == 6  # every change gives its own directory


def test_warm_start_is_built_once_and_rebuilt_when_its_key_changes(tmp_path, quick_preset):
    task = ReverseTask()
    threads = torch.get_num_threads()
    path, built = prepare_actor(quick_preset, 0, task, tmp_path)
    assert built and (path / "cache_key.json").is_file() and (path / "config.json").is_file()
    assert torch.get_num_threads() == threads  # NOTE [ The warm start on every core ]: given back
    stamp = (path / "config.json").stat().st_mtime_ns
    again, built_again = prepare_actor(quick_preset, 0, task, tmp_path)
    assert again == path and not built_again and (path / "config.json").stat().st_mtime_ns == stamp
    other, built_other = prepare_actor(quick_preset, 1, task, tmp_path)  # another seed
    assert other != path and built_other
    assert json.loads((other / "cache_key.json").read_text())["seed"] == 1
    model, tokenizer = model_module.load_actor(str(path))
    assert model.config.num_hidden_layers == 1 and tokenizer.decode(tokenizer("ab=")["input_ids"]) == "ab="


def test_a_local_directory_is_used_as_it_is(tmp_path):
    assert prepare_actor(str(tmp_path), 0, ReverseTask(), tmp_path / "cache") == (tmp_path, False)


# ---------------------------------------------------------------------------------- 2-rank runs
RUN_ARGS = ["--actor_model_name_or_path", "qwen2-tiny", "--actor_zero_stage", "2",
            "--actor_lora_dim", "4", "--only_optimize_lora", "--actor_learning_rate", "3e-3",
            "--per_device_generation_batch_size", "2", "--group_size", "4",
            "--per_device_training_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--max_answer_seq_len", "8", "--num_train_steps", "3", "--eval_interval", "2",
            "--num_eval_prompts", "8", "--seed", "5"]
DETERMINISTIC = ("trainable_sha256", "train_reward", "held_out_reward", "loss", "update_tokens", "clip_fraction")


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """GC; HiLoRe all-H with a checkpoint after step 2; HiLoRe resumed from that checkpoint."""
    root = tmp_path_factory.mktemp("grpo_runs")
    shared = [*RUN_ARGS, "--warm_start_dir", str(root / "warm_start")]
    gc_dir, hilore_dir, resumed_dir = root / "gc", root / "hilore", root / "resumed"
    gc = run_distributed("examples/grpo/train.py", [*shared, "--deepspeed_config", GC_CONFIG, "--count_flops",
                                                    "--actor_gradient_checkpointing", "--output_dir", gc_dir],
                         timeout=600)
    config = json.loads(HILORE_CONFIG.read_text())
    config["hilore"]["force_plan"] = "H"  # exact: bitwise the GC run
    hilore_config = root / "hilore.json"
    hilore_config.write_text(json.dumps(config))
    hilore_args = [*shared, "--deepspeed_config", hilore_config, "--grad_error_interval", "1", "--count_flops"]
    # the HiLoRe run through DeepSpeed's runner, as the example's README launches it; the
    # others start their ranks directly (NOTE [ Three ways to start ranks ] in tests/launch.py)
    hilore = run_distributed("examples/grpo/train.py", [*hilore_args, "--save_interval", "2",
                                                        "--output_dir", hilore_dir],
                             launcher="deepspeed", timeout=600)
    shutil.copytree(hilore_dir, resumed_dir)  # as if the run had been interrupted after step 2
    (resumed_dir / "checkpoints" / "latest").write_text("step2")
    resumed = run_distributed("examples/grpo/train.py", [*hilore_args, "--resume", "--output_dir", resumed_dir],
                              timeout=600)
    return {"gc": (gc_dir, gc), "hilore": (hilore_dir, hilore), "resumed": (resumed_dir, resumed)}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_short_run_logs_rewards_stats_jsonl_and_a_plot(runs):
    for name, (output_dir, ranks) in runs.items():
        records = _records(output_dir)
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        assert records[0]["held_out_reward"] is not None
        for r in records[1:]:
            assert math.isfinite(r["loss"]) and 0.0 <= r["train_reward"] <= 1.0
            assert r["update_tokens"] > 0
        assert records[1]["peak_bytes"] is not None and len(records[1]["peak_bytes"]) == 2
        assert [r["metered"] for r in records[1:]] == [True, False, False]  # step 1 only
        summary = json.loads((output_dir / "summary.json").read_text())
        flops = summary["flops"]  # --count_flops: one step of 2 micro-batches of 4, both ranks
        assert flops["microbatches"] == 4 and flops["sequences_per_microbatch"] == 4 == summary["sequences_per_microbatch"]
        assert flops["update_flops"] > 0 and flops["no_checkpointing_flops"] > 0
        if name == "gc":  # recomputes on top of the update (HiLoRe may run less: a microbatch
            assert flops["update_flops"] >= flops["no_checkpointing_flops"]  # of zeros skips)
        assert Path(summary["png"]).is_file() and summary["held_out_after"] == records[3]["held_out_reward"]
        assert ranks[0]["trainable_sha256"] == ranks[1]["trainable_sha256"]  # ZeRO-2 keeps ranks in step
    hilore = _records(runs["hilore"][0]) + _records(runs["resumed"][0])[3:]
    units, micro_batches = 2 * 2, 2  # 2 layers x (attn, mlp); 8 rollouts in micro-batches of 4
    for r in hilore[1:]:
        # every unit stored (H), or elided (E) in a micro-batch whose advantages are all 0
        a = r["actions"]
        assert a["H"] + a["E"] == units * micro_batches and a["L"] == a["R"] == 0
        assert r["bytes"]["H"] > 0 and r["recomputed_units"] == 0 and r["recompute_s"] == 0.0
        assert r["grad_error_measured"] == 0.0  # all-H is exact
        assert isinstance(r["warm_up"], dict)  # every rank's warm-up work, kind by kind
    assert all("actions" not in r and "warm_up" not in r for r in _records(runs["gc"][0]))
    gc_flops = json.loads((runs["gc"][0] / "summary.json").read_text())["flops"]
    assert 0.15 < gc_flops["recompute_share"] < 0.5 and gc_flops["recomputed_flops"] > 0
    hilore_flops = json.loads((runs["hilore"][0] / "summary.json").read_text())["flops"]
    assert hilore_flops["recomputed_flops"] == 0  # all H: nothing recomputed
    assert json.loads((runs["hilore"][0] / "summary.json").read_text())["memory_budget"] == 1.10


@pytest.mark.distributed
@pytest.mark.slow
def test_hilore_all_h_trajectory_is_bitwise_the_gc_trajectory(runs):
    gc, hilore = _records(runs["gc"][0]), _records(runs["hilore"][0])
    for a, b in zip(gc, hilore):
        assert {k: a.get(k) for k in DETERMINISTIC} == {k: b.get(k) for k in DETERMINISTIC}
    assert runs["gc"][1][0]["trainable_sha256"] == runs["hilore"][1][0]["trainable_sha256"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_resumed_run_continues_the_same_trajectory(runs):
    hilore, resumed = _records(runs["hilore"][0]), _records(runs["resumed"][0])
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]  # steps 0-2 kept from before the interruption
    assert {k: hilore[3].get(k) for k in DETERMINISTIC} == {k: resumed[3].get(k) for k in DETERMINISTIC}
    assert runs["hilore"][1][0]["trainable_sha256"] == runs["resumed"][1][0]["trainable_sha256"]
