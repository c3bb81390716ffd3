"""The supervised warm start of a built-in preset, cached under ``--warm_start_dir``.

A randomly initialised model gives every completion of a prompt the same (zero) reward, so
every GRPO advantage is 0 and there is nothing to learn. A short seeded supervised run on the
task's training split first teaches the format and part of the task, leaving room for GRPO.
Its result is a checkpoint directory (model and tokenizer, ``save_pretrained``) in
``<warm_start_dir>/<digest of cache_key>``; any change to what shapes it (preset, seed, task,
this procedure's version) gives another digest, hence a fresh build.

    path = prepare_actor(args, task)   # rank 0 builds once, every rank then loads `path`
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from .model import PRESETS, build_preset
from .task import Example, Task

__all__ = ["cache_key", "prepare_actor", "warm_start"]

VERSION = 1  # bump when the procedure below changes what it produces


def cache_key(preset: str, seed: int, task: Task) -> dict:
    """Everything that shapes the warm-started checkpoint."""
    return {"version": VERSION, "preset": preset, "preset_fields": vars(PRESETS[preset]).copy(),
            "seed": seed, "task": task.key, "transformers": transformers.__version__}


def cache_dir(root: str | os.PathLike, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / digest


def prepare_actor(preset_or_path: str, seed: int, task: Task, root: str | os.PathLike,
                  device: torch.device | str = "cpu") -> tuple[Path, bool]:
    """The directory to load the actor from, and whether this call built it.

    A local directory is returned as it is. For a preset, rank 0 builds the warm start unless
    the cache holds it; the other ranks wait for it (NOTE [ Waiting for the warm start ]).
    """
    if preset_or_path not in PRESETS:
        return Path(preset_or_path), False
    path = cache_dir(root, cache_key(preset_or_path, seed, task))
    built = False
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (path / "cache_key.json").is_file():
        with _every_core(device):
            warm_start(preset_or_path, seed, task, path, device)
        built = True
    elif rank != 0:
        _wait_for(path / "cache_key.json")
    if dist.is_initialized():
        dist.barrier()
    return path, built


def _wait_for(stamp: Path, poll_s: float = 0.5) -> None:
    """NOTE [ Waiting for the warm start ]
    A barrier of the gloo process group gives up after its timeout (10 minutes), and on a busy
    machine a warm start can take longer. The other ranks wait for the checkpoint's last file
    instead (they load it from the same folder, so they see it), then meet rank 0 at a barrier.
    If rank 0 fails, the launcher ends them."""
    while not stamp.is_file():
        time.sleep(poll_s)


@contextlib.contextmanager
def _every_core(device: torch.device | str):
    """NOTE [ The warm start on every core ]
    On a CPU each rank runs on its share of the cores (OMP_NUM_THREADS), but while rank 0
    builds the warm start the other ranks only wait at a barrier (a blocking read, no spinning):
    rank 0 takes every core of the machine for it, and gives them back before training."""
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(max(threads, os.cpu_count() or 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def warm_start(preset: str, seed: int, task: Task, path: Path, device: torch.device | str = "cpu") -> None:
    """Train preset ``preset`` from scratch on the task's answers and save it to ``path``."""
    spec = PRESETS[preset]
    model, tokenizer = build_preset(preset, seed)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr)
    rng = random.Random(seed)
    start = time.perf_counter()
    for step in range(spec.warm_start_steps):
        ids, labels = _batch(tokenizer, task.sample(rng, spec.warm_start_batch, "train"))
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"warm start of {preset}: {spec.warm_start_steps} supervised steps, last loss "
          f"{loss.item():.3f}, {time.perf_counter() - start:.0f} s -> {path}", flush=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "cache_key.json").write_text(json.dumps(cache_key(preset, seed, task), indent=1, sort_keys=True))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # a reader never sees a half-written checkpoint


def _batch(tokenizer, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + answer + <eos>, padded on the right; the loss sees the answer and <eos> only."""
    rows, prompt_lens = [], []
    for e in examples:
        prompt = tokenizer(e.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(e.answer, add_special_tokens=False)["input_ids"]
        rows.append(prompt + answer + [tokenizer.eos_token_id])
        prompt_lens.append(len(prompt))
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # (B, T)
    labels = torch.full((len(rows), width), -100)  # (B, T) -100: no loss
    for i, (row, n) in enumerate(zip(rows, prompt_lens)):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, n:len(row)] = torch.tensor(row[n:])
    return ids, labels
