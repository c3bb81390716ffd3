"""GRPO training with DeepSpeed and ds_hilore, in the style of DeepSpeed-Chat's step 3.

Each step every rank samples prompts of the task, generates ``--group_size`` completions of
each (``model.generate``, checkpointing off), scores them, and updates the actor on them
with the GRPO loss of ``ds_hilore.grpo``. The actor is wrapped by ``ds_hilore.initialize``:
with a ``"hilore"`` block in the ds_config HiLoRe is its activation checkpointing, without
one it is plain DeepSpeed (add ``--actor_gradient_checkpointing`` for transformers' GC).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module examples.grpo.train \\
        --deepspeed_config examples/grpo/ds_config_hilore.json --actor_lora_dim 16 \\
        --only_optimize_lora --output_dir output/grpo_hilore
    DS_ACCELERATOR=cpu mpirun -np 2 python -m examples.grpo.train --deepspeed_config ...

Run from the repository root (``deepspeed ... examples/grpo/train.py`` works as well).
Writes under ``--output_dir``: ``metrics.jsonl``, ``summary.json``, ``grpo.png``, the warm
start cache (``warm_start/``) and DeepSpeed checkpoints (``checkpoints/``, ``--save_interval``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import NoReturn

if __package__ in (None, ""):  # run as a script: import `examples.grpo` from the repository root,
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # not this folder's modules as top-level ones

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_hilore  # noqa: E402
from examples.grpo.arguments import UsageError, parse_args  # noqa: E402
from examples.grpo.flops import count_update_flops  # noqa: E402
from examples.grpo.model import PRESETS, add_lora, load_actor  # noqa: E402
from examples.grpo.report import Report  # noqa: E402
from examples.grpo.rollout import evaluate, make_rollout, set_checkpointing  # noqa: E402
from examples.grpo.task import Task, load_task  # noqa: E402
from examples.grpo.turns import Turns  # noqa: E402
from examples.grpo.update import actor_update, gradient_error  # noqa: E402
from examples.grpo.warm_start import prepare_actor  # noqa: E402

# raised inside DeepSpeed's ZeRO optimizer on every run; not this script's to fix
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


@dataclasses.dataclass
class Run:
    """Everything the training loop needs."""

    args: object
    task: Task
    tokenizer: object
    engine: object  # the actor's DeepSpeed engine (engine.hilore: HiLoRe's runtime or None)
    reference: object | None  # frozen reference engine (beta > 0)
    report: Report
    rank: int
    world_size: int
    start_step: int  # last step already done (a resumed run)
    checkpointing: bool  # gradient checkpointing (or HiLoRe) is on for the update


# ---------------------------------------------------------------------------------- setup
def setup(args) -> Run:
    deepspeed.init_distributed(distributed_port=args.master_port)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _share_cpu_cores()
    _check_resume(args)
    try:
        task = load_task(args.data_path, args.reward, args.task or "reverse")
    except ValueError as error:
        raise UsageError(str(error)) from None
    device = deepspeed.get_accelerator().current_device_name()
    path, _ = prepare_actor(args.actor_model_name_or_path, args.seed, task, args.warm_start_dir, device)
    actor, tokenizer = load_actor(path)
    _check_vocabulary(args, task, tokenizer)
    torch.manual_seed(_seed(args.seed, "init"))  # LoRA's initial weights
    if args.actor_lora_dim:
        actor = add_lora(actor, args.actor_lora_dim, args.actor_lora_module_name, args.only_optimize_lora)
    actor.train()  # from_pretrained returns eval mode, where transformers skips checkpointing
    if args.actor_gradient_checkpointing:
        set_checkpointing(actor, True)
    # was: deepspeed.initialize(...) -- a "hilore" block makes HiLoRe the actor's checkpointing
    engine, *_ = ds_hilore.initialize(model=actor, config=ds_config(args), distributed_port=args.master_port,
                                      model_parameters=[p for p in actor.parameters() if p.requires_grad])
    reference = make_reference(path, args) if args.beta > 0 else None
    start_step = resume(engine, args) if args.resume else 0
    report = Report(args.output_dir, args.num_train_steps, start_step, active=rank == 0)
    checkpointing = args.actor_gradient_checkpointing or engine.hilore is not None
    return Run(args, task, tokenizer, engine, reference, report, rank, world_size, start_step, checkpointing)


def _share_cpu_cores() -> None:
    """On a CPU, ranks on one machine share its cores: without OMP_NUM_THREADS each rank's
    torch would start a thread per core, and their spinning threads slow every rank down
    many times over."""
    if deepspeed.get_accelerator().device_name() == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def ds_config(args) -> dict:
    """The ``--deepspeed_config`` file with the command line's batch sizes, ZeRO stage,
    learning rate and dtype written into it (DeepSpeed-Chat sets these from arguments too)."""
    config = json.loads(Path(args.deepspeed_config).read_text())
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = args.per_device_training_batch_size
    config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    config.setdefault("zero_optimization", {})["stage"] = args.actor_zero_stage
    optimizer = config.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
    optimizer.setdefault("params", {})["lr"] = args.actor_learning_rate
    config["bf16"] = {"enabled": args.dtype == "bf16"}
    config["fp16"] = {"enabled": args.dtype == "fp16"}
    config.setdefault("steps_per_print", 10**9)
    return config


def make_reference(path, args):
    """The frozen reference policy (the actor before training) as an inference engine."""
    model, _ = load_actor(path)
    model.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": args.per_device_training_batch_size,
              "zero_optimization": {"stage": 3 if args.actor_zero_stage == 3 else 0},
              "bf16": {"enabled": args.dtype == "bf16"}, "fp16": {"enabled": args.dtype == "fp16"},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def _check_vocabulary(args, task: Task, tokenizer) -> None:
    if args.actor_model_name_or_path not in PRESETS:
        return
    vocab = tokenizer.get_vocab()
    missing = sorted({c for c in task.characters if c not in vocab})
    if missing:
        raise UsageError(f"--data_path holds characters the presets' tokenizer lacks ({''.join(missing)!r}); "
                         "use printable ASCII, or a local model directory with its own tokenizer.")


# ---------------------------------------------------------------------------------- checkpoints
def checkpoint_dir(args) -> Path:
    return Path(args.output_dir) / "checkpoints"


def _check_resume(args) -> None:
    if args.resume and not (checkpoint_dir(args) / "latest").is_file():
        raise UsageError(f"--resume: no checkpoint in {checkpoint_dir(args)}; start without --resume "
                         "(and with --save_interval N to write checkpoints).")


def save(run: Run, step: int) -> None:
    """A DeepSpeed checkpoint (HiLoRe's state rides in it); every rank calls it."""
    run.engine.save_checkpoint(str(checkpoint_dir(run.args)), tag=f"step{step}", client_state={"step": step})


def resume(engine, args) -> int:
    """Load the latest checkpoint; returns the step it was taken after. Data and sampling are
    seeded by (seed, step, rank), so the resumed run continues the same trajectory."""
    _, client_state = engine.load_checkpoint(str(checkpoint_dir(args)))
    return int(client_state["step"])


# ---------------------------------------------------------------------------------- train
def train(run: Run) -> dict | None:
    """The training loop; returns the FLOP count of the last step's update (``--count_flops``).
    With ``--turns`` each phase runs in this run's turn (NOTE [ Runs in turns ] in turns.py)."""
    args = run.args
    turns = Turns(args.turns, *args.turn)
    turns.ready()
    with turns.turn(0):
        if run.start_step == 0:
            run.report.log({"step": 0, "total_steps": args.num_train_steps, "held_out_reward": held_out_reward(run)})
    rollout = None
    for step in range(run.start_step + 1, args.num_train_steps + 1):
        with turns.turn(step):
            record, rollout = train_step(run, step)
            run.report.log(record)
            if args.save_interval and (step % args.save_interval == 0 or step == args.num_train_steps):
                save(run, step)
    with turns.turn(args.num_train_steps + 1):
        if not args.count_flops or rollout is None:
            return None
        return count_update_flops(run.engine, rollout, args, run.checkpointing)  # NOTE [ Counting FLOPs after training ]


def train_step(run: Run, step: int) -> tuple[dict, object]:
    """Rollout, update, (evaluation); returns the step's record and its rollout."""
    args, engine = run.args, run.engine
    start = time.perf_counter()
    torch.manual_seed(_seed(args.seed, "sampling", step, run.rank))  # generate's sampling
    rollout = make_rollout(engine, run.reference, run.tokenizer, run.task, args, step, run.rank,
                           run.checkpointing)
    measure = (engine.hilore is not None and args.grad_error_interval and step % args.grad_error_interval == 0
               and args.actor_zero_stage < 3)  # ZeRO-3: parameters are partitioned, gradients too
    grad_error = gradient_error(engine, rollout, args) if measure else None
    metered = step == 1 or (args.memory_interval > 0 and step % args.memory_interval == 0)
    update = actor_update(engine, rollout, args, meter_memory=metered)
    evaluated = step % args.eval_interval == 0 or step == args.num_train_steps
    record = _record(run, step, rollout, update, metered)
    record.update(held_out_reward=held_out_reward(run) if evaluated else None, grad_error_measured=grad_error,
                  trainable_sha256=trainable_digest(engine.module),  # bitwise comparisons of runs
                  step_s=time.perf_counter() - start)
    return record, rollout


def _record(run: Run, step: int, rollout, update, metered: bool) -> dict:
    """The step's numbers, summed or averaged over ranks (HiLoRe's counts: rank 0's)."""
    sums = _all_reduce([float(rollout.rewards.sum()), len(rollout), update.loss, update.kl,
                        update.clip_fraction, update.tokens, update.cpu_seconds], dist.ReduceOp.SUM)
    seconds = _all_reduce([update.seconds], dist.ReduceOp.MAX)[0]  # the slowest rank
    world = run.world_size
    record = {"step": step, "total_steps": run.args.num_train_steps, "train_reward": sums[0] / sums[1],
              "loss": sums[2] / world, "kl": sums[3] / world, "clip_fraction": sums[4] / world,
              "update_tokens": int(sums[5]), "update_s": seconds, "update_cpu_s": sums[6], "metered": metered,
              "update_tokens_per_s": None if metered else sums[5] / seconds,
              "update_tokens_per_cpu_s": None if metered else sums[5] / sums[6],
              "peak_bytes": _gather(update.peak_bytes) if metered else None,
              "peak_delta_bytes": _gather(update.peak_delta) if metered else None, "grad_error_est": None}
    if update.hilore is not None:
        stats = run.engine.hilore.stats  # the last optimizer step's
        record.update(update.hilore, warm_up=_summed_dicts(_gather(update.hilore["warm_up"])),
                      grad_error_est=stats.get("grad_error_est"),
                      packed_rel_error_max=stats.get("packed_rel_error_max"))
    return record


def held_out_reward(run: Run) -> float:
    total, count = evaluate(run.engine, run.tokenizer, run.task, run.args, run.rank, run.world_size,
                            run.checkpointing)
    total, count = _all_reduce([total, count], dist.ReduceOp.SUM)
    return total / count


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:7], "big")


def _all_reduce(values: list[float], op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _summed_dicts(dicts: list[dict]) -> dict:
    """Every rank's warm-up work, kind by kind: a step is steady only when no rank learned."""
    out: dict = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = out.get(key, 0) + value
    return out


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---------------------------------------------------------------------------------- cleanup
def cleanup(run: Run, flops: dict | None = None) -> None:
    """Summary and plot (rank 0), each rank's result file (``--result_dir``), then a barrier and
    the process groups destroyed: a gloo process group left alive can abort the process in C++
    as the interpreter exits. ``flops``: ``train``'s count, into the summary."""
    engine = run.engine
    hilore = engine.hilore.config if engine.hilore is not None else None
    extra = {"deepspeed_config": run.args.deepspeed_config, "world_size": run.world_size,
             "hilore": hilore is not None, "force_plan": hilore.force_plan if hilore else None,
             "memory_budget": hilore.memory_budget if hilore else None, "flops": flops,
             "sequences_per_microbatch": run.args.per_device_training_batch_size,
             "trainable_sha256": trainable_digest(engine.module)}
    summary = run.report.finish(extra)
    if run.args.result_dir is not None:  # read by tests (tests/launch.py)
        result = {"rank": run.rank, "summary": summary, "trainable_sha256": extra["trainable_sha256"]}
        Path(run.args.result_dir, f"rank{run.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def trainable_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the trainable parameters (whole on every rank under ZeRO 0-2)."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        run = setup(args)
    except UsageError as error:
        _exit_with(error)
    flops = train(run)
    cleanup(run, flops)


def _exit_with(error: UsageError) -> NoReturn:
    """One line on the first rank (the others exit quietly): no traceback for a bad argument."""
    rank = next((os.environ[k] for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK") if k in os.environ), "0")
    if rank == "0":
        print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
