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
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["ARMS", "Arm", "DEMO_ARGS", "launch"]

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    deepspeed_config: Path
    trainer_args: tuple[str, ...] = ()


ARMS = (
    Arm("GC", HERE / "ds_config_gc.json", ("--actor_gradient_checkpointing",)),
    Arm("HiLoRe", HERE / "ds_config_hilore.json"),
)

# The demo's run: a 4-layer Qwen2-shaped preset, LoRA, ZeRO-2, 2 ranks; sized so that both
# arms together finish in minutes on a 2-core CPU and the held-out reward visibly rises.
DEMO_ARGS = ("--actor_model_name_or_path", "qwen2-small", "--actor_zero_stage", "2",
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
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs), "--master_port",
           str(port), "--module", "examples.grpo.train", *args]
    print(f"\n=== {arm.name}: {' '.join(cmd[1:])}", flush=True)
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=_environment(nprocs))
    finally:
        remove_shm_buffers(port)
    if done.returncode != 0:
        sys.exit(f"error: the {arm.name} run failed (exit code {done.returncode}); its output is above.")
    stamp.write_text(json.dumps(key, indent=1))
    return json.loads((Path(output_dir) / "summary.json").read_text())


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


def mib(values) -> str:
    return "n/a" if not values else " / ".join(f"{v / MiB:.0f}" for v in values)


def actions(summary: dict) -> str:
    a = summary.get("actions")
    return "- (GC)" if not a else f"{a['H']}/{a['L']}/{a['R']}/{a['E']}"


def grad_error(summary: dict) -> str:
    if not summary.get("hilore"):
        return "0 (exact)"
    error = summary.get("grad_error_measured_mean")
    a = summary.get("actions") or {}
    return "0 (exact: no L)" if a.get("L") == 0 else fmt(error, ".4f")


def table(rows: list[tuple[str, ...]]) -> str:
    """A markdown table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])
