"""Launch the trainer as a user would and put runs side by side (``demo`` and ``paired``).

An *arm* is one way of keeping activations for the actor update: ``GC`` (transformers'
gradient checkpointing, no ``"hilore"`` block) or ``HiLoRe`` (the ``"hilore"`` block of
``ds_config_hilore.json``). Both arms of a comparison get the same trainer arguments and
seed, so they start from the same warm start and see the same prompts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from examples.grpo.turns import first_turn

__all__ = ["ARMS", "Arm", "DEMO_ARGS", "PAIRED_ARGS", "launch", "launch_in_turns"]

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    deepspeed_config: Path
    trainer_args: tuple[str, ...] = ()


ARMS = (
    Arm("GC", HERE / "ds_config_gc.json", ("--actor_gradient_checkpointing",)),
    Arm("HiLoRe", HERE / "ds_config_hilore.json"),
)

# NOTE [ The demo's regime ]
# make demo trains where activations matter, and finishes both runs in minutes on a 2-core CPU:
# the count task's answers run to 151-199 tokens, so a microbatch of 8 sequences holds about
# 1,500 tokens, and gradient checkpointing recomputes about 30 % of the update's FLOPs (with
# LoRA the backward computes no weight gradients of the base model, so the forward it repeats
# is a large share; the demo counts it, examples/grpo/flops.py). 2 prompts x 8 completions
# per rank and step, 2 microbatches of 8 per optimizer step, 40 steps: generating the long
# answers takes about as long as the update, and both count against the time. The model is
# qwen2-small's shape (4 layers, hidden 128), warm-started on the task.
DEMO_ARGS = ("--actor_model_name_or_path", "qwen2-count", "--task", "count", "--max_prompt_seq_len", "10",
             "--max_answer_seq_len", "200", "--actor_zero_stage", "2", "--actor_lora_dim", "16",
             "--only_optimize_lora", "--actor_learning_rate", "1e-3",
             "--per_device_generation_batch_size", "2", "--group_size", "8",
             "--per_device_training_batch_size", "8", "--gradient_accumulation_steps", "2",
             "--num_train_steps", "40", "--eval_interval", "10", "--num_eval_prompts", "64",
             "--memory_interval", "20", "--count_flops")

# examples.grpo.paired: the small reversal run (short answers, 16 sequences per microbatch),
# where 3 seeds x 2 arms finish in minutes; it measures what HiLoRe does to learning.
PAIRED_ARGS = ("--actor_model_name_or_path", "qwen2-small", "--actor_zero_stage", "2",
               "--actor_lora_dim", "16", "--only_optimize_lora", "--actor_learning_rate", "1e-3",
               "--per_device_generation_batch_size", "8", "--group_size", "8",
               "--per_device_training_batch_size", "16", "--gradient_accumulation_steps", "4",
               "--num_train_steps", "40", "--eval_interval", "10", "--num_eval_prompts", "128")


def launch(arm: Arm, output_dir: Path, trainer_args: Sequence[str], nprocs: int = 2,
           deepspeed_config: Path | None = None, reuse: bool = False) -> dict:
    """Run the trainer on ``nprocs`` ranks under the deepspeed runner; returns its summary.

    Its output goes to this process's stdout; a failed run ends this process with its exit code.
    ``reuse``: if ``output_dir`` holds a finished run of the same command and ds_config, return
    its summary instead of running again.
    """
    config = Path(deepspeed_config or arm.deepspeed_config)
    args = [*trainer_args, *arm.trainer_args, "--deepspeed_config", str(config), "--output_dir", str(output_dir)]
    key = {"args": args, "nprocs": nprocs, "deepspeed_config": json.loads(config.read_text())}
    stamp = Path(output_dir) / "launch.json"
    if reuse and stamp.is_file() and json.loads(stamp.read_text()) == key:
        print(f"\n=== {arm.name}: reusing the finished run in {output_dir}", flush=True)
        return json.loads((Path(output_dir) / "summary.json").read_text())
    port = _free_port()
    cmd = _command(args, nprocs, port)
    print(f"\n=== {arm.name}: {' '.join(cmd[1:])}", flush=True)
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=_environment(nprocs))
    finally:
        remove_shm_buffers(port)
    if done.returncode != 0:
        sys.exit(f"error: the {arm.name} run failed (exit code {done.returncode}); its output is above.")
    stamp.write_text(json.dumps(key, indent=1))
    return json.loads((Path(output_dir) / "summary.json").read_text())


def launch_in_turns(arms: Sequence[Arm], output_dirs: Sequence[Path], trainer_args: Sequence[str],
                    nprocs: int = 2) -> list[dict]:
    """The runs of ``arms`` started together, each on ``nprocs`` ranks, taking every step in
    turns (NOTE [ Runs in turns ] in turns.py); returns their summaries.

    A run starts once the one before it is set up. Their output lines go to this process's
    stdout, each after its arm's name; a failed run ends the others, then this process.
    """
    folder = Path(output_dirs[0]).parent / "turns"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    ports, pumps = [], []
    stopped = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the runs end with this process
    try:
        for k, (arm, out) in enumerate(zip(arms, output_dirs)):
            args = [*trainer_args, *arm.trainer_args, "--deepspeed_config", str(arm.deepspeed_config),
                    "--output_dir", str(out), "--turns", str(folder), "--turn", f"{k}/{len(arms)}"]
            ports.append(_free_port())
            cmd = _command(args, nprocs, ports[-1])
            print(f"\n=== {arm.name}: {' '.join(cmd[1:])}", flush=True)
            procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=_environment(nprocs), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                          start_new_session=True))
            pumps.append(threading.Thread(target=_pump, args=(procs[-1].stdout, f"[{arm.name}] "), daemon=True))
            pumps[-1].start()
            _wait_for(procs, arms, lambda k=k: (folder / f"ready.{k}").is_file(), awaited=procs[-1])
        first_turn(folder)
        _wait_for(procs, arms, lambda: all(p.poll() is not None for p in procs))
    finally:
        signal.signal(signal.SIGTERM, stopped)
        for proc in procs:  # a run failed, or this process was stopped: end the others, ranks too
            if proc.poll() is None or proc.returncode != 0:
                _end(proc)
        for port in ports:
            remove_shm_buffers(port)
        for pump in pumps:
            pump.join(timeout=10)
    return [json.loads((Path(out) / "summary.json").read_text()) for out in output_dirs]


def _wait_for(procs: list, arms: Sequence[Arm], done, awaited=None) -> None:
    """Until ``done()``; a run that ended with an error, or ``awaited`` ended at all (before it
    was set up), ends this process."""
    while not done():
        for arm, proc in zip(arms, procs):
            code = proc.poll()
            if code is not None and (code != 0 or proc is awaited):
                sys.exit(f"error: the {arm.name} run failed (exit code {code}); its output is above.")
        time.sleep(0.1)


def _pump(stream, prefix: str) -> None:
    """A run's output lines to this process's stdout; drained to the end even if writing fails
    (a full pipe would stop the run, and the other with it, waiting for its turn)."""
    for line in stream:
        try:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


def _end(proc: subprocess.Popen) -> None:
    """The run's process group ended (its launcher and ranks): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # ranks the launcher left behind
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _command(args: Sequence[str], nprocs: int, port: int) -> list[str]:
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs), "--master_port",
            str(port), "--module", "examples.grpo.train", *args]


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves its shared-memory buffers (tens of MiB per rank) in
    /dev/shm when the ranks exit; a launch removes those of its own port."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def _environment(nprocs: int) -> dict[str, str]:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        # one thread per rank: ranks share the cores
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hilore_config_with(changes: dict, path: Path) -> Path:
    """``ds_config_hilore.json`` with keys of its ``"hilore"`` block changed (a value None
    removes the key), written to ``path``."""
    config = json.loads(ARMS[1].deepspeed_config.read_text())
    for key, value in changes.items():
        if value is None:
            config["hilore"].pop(key, None)
        else:
            config["hilore"][key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    return path


# ---------------------------------------------------------------------------------- tables
def fmt(value, spec: str, none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def table(rows: list[tuple[str, ...]]) -> str:
    """A markdown table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])
