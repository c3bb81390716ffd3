"""The memory budget in bytes per rank, from the one of three ways the "hilore" block states it.

* ``memory_budget`` (default 1.10): a multiple of gradient checkpointing's measured per-rank
  peak on the same shape (the whole process: weights, gradients, optimizer state, activations,
  logits), the paper's B_GC;
* ``memory_budget_bytes``: absolute bytes per rank;
* ``memory_fraction``: a fraction of the device's memory per rank (CUDA: the device's total;
  CPU: the memory this process may use -- the machine's or its cgroup's limit -- shared by the
  ranks on this node).
"""

from __future__ import annotations

import os

import torch


def budget_bytes(config, gc_peak_bytes: int, device: torch.device) -> int:
    """Bytes per rank the plan may reach at its peak."""
    if config.memory_budget_bytes is not None:
        return int(config.memory_budget_bytes)
    if config.memory_fraction is not None:
        return int(config.memory_fraction * device_memory_bytes(device))
    return int(config.memory_budget * gc_peak_bytes)


def describe(config) -> str:
    """How the budget was stated, for messages: ``memory_budget = 1.1`` etc."""
    for key in ("memory_budget_bytes", "memory_fraction"):
        if getattr(config, key) is not None:
            return f"hilore.{key} = {getattr(config, key)}"
    return f"hilore.memory_budget = {config.memory_budget}"


def device_memory_bytes(device: torch.device) -> int:
    """Memory one rank may use: the CUDA device's total, or on CPU the process's limit (machine
    or cgroup, the smaller) divided among this node's ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
