"""Command-line arguments, named as DeepSpeed-Chat's step 3 (``main.py``) names them.

``parse_args`` checks everything it can before any model is built, and ends a bad command
with one line that says what to change (``UsageError``), not a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Sequence

from ds_hilore.grpo.losses import LOSS_TYPES

from .model import PRESETS
from .task import REWARDS, TASKS
from .turns import parse_turn

__all__ = ["UsageError", "parse_args"]

DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_DS_CONFIG = Path(__file__).with_name("ds_config_gc.json")


class UsageError(ValueError):
    """A bad argument; the message is one line that names the argument and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="examples.grpo.train",
                                description="GRPO with DeepSpeed and ds_hilore (DeepSpeed-Chat step 3 style).")
    model = p.add_argument_group("actor")
    model.add_argument("--actor_model_name_or_path", default="qwen2-small",
                       help=f"a local checkpoint directory, or a built-in preset: {', '.join(PRESETS)} "
                            "(built from a transformers config and warm-started, no downloads)")
    model.add_argument("--actor_zero_stage", type=int, default=2, help="ZeRO stage 0-3")
    model.add_argument("--actor_gradient_checkpointing", action="store_true",
                       help="transformers' gradient checkpointing; with a \"hilore\" block in the "
                            "ds_config HiLoRe is the checkpointing instead")
    model.add_argument("--actor_lora_dim", type=int, default=0, help="LoRA rank; 0 = no LoRA")
    model.add_argument("--actor_lora_module_name", default="layers.",
                       help="LoRA on linear layers whose name contains this (comma-separated)")
    model.add_argument("--only_optimize_lora", action="store_true", help="train the LoRA weights only")
    model.add_argument("--actor_learning_rate", type=float, default=1e-3)
    model.add_argument("--dtype", default="fp32", choices=DTYPES)

    data = p.add_argument_group("data and reward")
    data.add_argument("--data_path", default=None,
                      help='JSONL of {"prompt", "answer"} rows; default: the built-in reversal task')
    data.add_argument("--reward", default=None, choices=list(REWARDS),
                      help="reward function (default: char_match for the built-in task, exact_match for a file)")
    data.add_argument("--task", default=None, choices=list(TASKS),
                      help="built-in task (default: reverse): reverse a string of 4-7 letters, or count -- "
                           "write out an arithmetic sequence of 38-50 terms (answers of 151-199 tokens)")
    data.add_argument("--max_prompt_seq_len", type=int, default=16, help="prompt tokens (longer prompts: error)")
    data.add_argument("--max_answer_seq_len", type=int, default=10, help="completion tokens generated at most")

    grpo = p.add_argument_group("GRPO")
    grpo.add_argument("--num_train_steps", type=int, default=40, help="rollout + update steps")
    grpo.add_argument("--per_device_generation_batch_size", type=int, default=8, help="prompts per rank per step")
    grpo.add_argument("--group_size", type=int, default=8, help="completions per prompt (G)")
    grpo.add_argument("--per_device_training_batch_size", type=int, default=16, help="sequences per micro-batch")
    grpo.add_argument("--gradient_accumulation_steps", type=int, default=1)
    grpo.add_argument("--ppo_epochs", type=int, default=1, help="passes over each step's rollouts")
    grpo.add_argument("--loss_type", default="grpo", choices=list(LOSS_TYPES))
    grpo.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 adds a frozen reference engine")
    grpo.add_argument("--epsilon", type=float, default=0.2, help="clip range of the ratio")
    grpo.add_argument("--epsilon_high", type=float, default=None,
                      help="upper clip (default: --epsilon); cispo's cap of the ratio, required there")
    grpo.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of rollouts")
    grpo.add_argument("--drop_zero_rows", action="store_true",
                      help="drop sequences with advantage 0 before the forward (beta must be 0)")

    run = p.add_argument_group("run")
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--output_dir", default="output/grpo")
    run.add_argument("--warm_start_dir", default=None,
                     help="cache of warm-started presets (default: OUTPUT_DIR/warm_start)")
    run.add_argument("--deepspeed_config", default=str(DEFAULT_DS_CONFIG),
                     help="ds_config (optimizer, ZeRO, an optional \"hilore\" block); the arguments "
                          "above override its batch sizes, ZeRO stage, learning rate and dtype "
                          "(default: %(default)s, no HiLoRe)")
    run.add_argument("--eval_interval", type=int, default=10, help="held-out reward every N steps")
    run.add_argument("--num_eval_prompts", type=int, default=128, help="held-out prompts (all ranks)")
    run.add_argument("--memory_interval", type=int, default=0,
                     help="measure peak memory of the update on step 1 and every N steps (0: step 1 only); "
                          "measured steps are left out of the throughput")
    run.add_argument("--grad_error_interval", type=int, default=0,
                     help="measure the update's relative gradient error against no checkpointing every "
                          "N steps (0: off; ZeRO 0-2)")
    run.add_argument("--count_flops", action="store_true",
                     help="after the last step, count one update's FLOPs with the run's checkpointing and "
                          "without (FlopCounterMode): the share it recomputes, in the summary")
    run.add_argument("--save_interval", type=int, default=0, help="DeepSpeed checkpoint every N steps (0: off)")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUTPUT_DIR")
    run.add_argument("--result_dir", default=None, help="also write each rank's summary here (tests)")
    run.add_argument("--turns", default=None,
                     help="a folder shared with other runs started at once: the runs take each step "
                          "in turns (make demo; NOTE [ Runs in turns ] in examples/grpo/turns.py)")
    run.add_argument("--turn", default="0/1", help="with --turns: this run's place ARM/ARMS, e.g. 0/2")
    run.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    run.add_argument("--master_port", type=int, default=29500, help="port of rank 0 (mpirun)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check; raises ``UsageError`` with a one-line message."""
    args = build_parser().parse_args(argv)
    check(args)
    if args.warm_start_dir is None:
        args.warm_start_dir = os.path.join(args.output_dir, "warm_start")
    return args


def check(args: argparse.Namespace) -> None:
    """Everything that can be wrong before a model exists."""
    name = args.actor_model_name_or_path
    if name not in PRESETS and not Path(name).is_dir():
        raise UsageError(f"--actor_model_name_or_path {name!r} is neither a local directory nor a "
                         f"built-in preset; presets: {', '.join(PRESETS)}.")
    _check_ds_config(args.deepspeed_config)
    if args.data_path is not None and not Path(args.data_path).is_file():
        raise UsageError(f"--data_path {args.data_path}: no such file; pass a JSONL file of "
                         '{"prompt": ..., "answer": ...} rows, or leave it out for the built-in task.')
    _at_least(args, 2, "group_size", "GRPO compares the completions of one prompt with each other")
    if LOSS_TYPES[args.loss_type].surrogate.needs_epsilon_high and args.epsilon_high is None:
        raise UsageError(f"--loss_type {args.loss_type} caps the ratio at --epsilon_high (the absolute "
                         "cap; TRL and ScaleRL recommend 5.0): pass it.")
    for key in ("num_train_steps", "per_device_generation_batch_size", "per_device_training_batch_size",
                "gradient_accumulation_steps", "ppo_epochs", "max_prompt_seq_len", "max_answer_seq_len",
                "num_eval_prompts", "eval_interval"):
        _at_least(args, 1, key)
    for key in ("actor_lora_dim", "save_interval", "memory_interval", "grad_error_interval"):
        _at_least(args, 0, key)
    _check_lengths(args)
    if args.actor_zero_stage not in (0, 1, 2, 3):
        raise UsageError(f"--actor_zero_stage {args.actor_zero_stage}: use 0, 1, 2 or 3.")
    if args.only_optimize_lora and args.actor_lora_dim == 0:
        raise UsageError("--only_optimize_lora needs LoRA: set --actor_lora_dim to 1 or more.")
    rollouts = args.per_device_generation_batch_size * args.group_size
    minibatch = args.per_device_training_batch_size * args.gradient_accumulation_steps
    if rollouts % minibatch:
        raise UsageError(
            f"each rank generates --per_device_generation_batch_size x --group_size = {rollouts} sequences "
            f"per step, not a multiple of --per_device_training_batch_size x --gradient_accumulation_steps "
            f"= {minibatch}; change one so that the minibatch divides the rollouts.")
    for key, what in (("beta", "the KL coefficient"), ("epsilon", "the clip range"),
                      ("epsilon_high", "the upper clip"), ("actor_learning_rate", "the learning rate")):
        value = getattr(args, key)
        if value is not None and not 0 <= value < math.inf:  # NaN too
            raise UsageError(f"--{key} {value}: {what} must be a finite number >= 0.")
    if args.drop_zero_rows and args.beta != 0:
        raise UsageError("--drop_zero_rows needs --beta 0: with a KL term a sequence with advantage 0 "
                         "still has a gradient.")
    if not args.temperature > 0:
        raise UsageError(f"--temperature {args.temperature}: must be > 0.")
    try:
        args.turn = parse_turn(args.turn)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.turns is not None and (args.resume or not Path(args.turns).is_dir()):
        raise UsageError(f"--turns {args.turns}: runs in turns start from step 0 (no --resume) and share "
                         "an existing folder; create it first.")


def _check_lengths(args: argparse.Namespace) -> None:
    """The built-in task's prompts and answers must fit the lengths (one token a character)."""
    if args.data_path is not None:
        if args.task is not None:
            raise UsageError(f"--task {args.task} names a built-in task, --data_path replaces it: pass one of them.")
        return
    name = args.task or "reverse"
    prompt, answer = TASKS[name]().longest
    if prompt > args.max_prompt_seq_len:
        raise UsageError(f"--max_prompt_seq_len {args.max_prompt_seq_len}: --task {name}'s prompts run to "
                         f"{prompt} tokens; raise it to {prompt}.")
    if answer + 1 > args.max_answer_seq_len:  # + <eos>
        raise UsageError(f"--max_answer_seq_len {args.max_answer_seq_len}: --task {name}'s answers run to {answer} "
                         f"tokens and an end of sequence; raise it to {answer + 1} (a cut answer scores 0).")


def _check_ds_config(path: str) -> None:
    if not Path(path).is_file():
        raise UsageError(f"--deepspeed_config {path}: no such file; pass a ds_config JSON such as "
                         "examples/grpo/ds_config_gc.json or examples/grpo/ds_config_hilore.json.")
    try:
        json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UsageError(f"--deepspeed_config {path} is not valid JSON ({error}); fix the file.") from None


def _at_least(args: argparse.Namespace, low: int, key: str, why: str = "") -> None:
    value = getattr(args, key)
    if value < low:
        reason = f" ({why})" if why else ""
        raise UsageError(f"--{key} {value}: must be {low} or more{reason}.")
