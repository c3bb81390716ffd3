"""The memory budget in bytes per rank, from the one of three ways the "hilore" block states it.

* ``memory_budget`` (default 1.10): a multiple of gradient checkpointing's measured per-rank
  peak on the same shape (the whole process: weights, gradients, optimizer state, activations,
  logits), the paper's B_GC;
* ``memory_budget_bytes``: absolute bytes per rank;
* ``memory_fraction``: a fraction of the device's memory per rank (CUDA: the device's total;
  CPU: the memory this process may use -- the machine's or its cgroup's limit -- shared by the
  ranks on this node, NOTE [ Ranks on this node ]).

NOTE [ What the device can give ]
On CUDA the stated budget is clamped to what this process can still allocate: the device's free
memory (``mem_get_info``, after the CUDA context, NCCL's buffers, workspaces and other
processes took theirs) plus what this process's caching allocator holds (allocated, or reserved
but free), less a margin for the allocator's fragmentation and for buffers created later
(``DEVICE_MARGIN`` of the device). Budgets count allocated bytes (``max_memory_allocated``), so
this bound is on the same scale. ``budget_and_bound`` says which bound applied.

NOTE [ Ranks on this node ]
On CPU the ranks of one node share its memory, so ``memory_fraction`` is divided by their
number. Launchers name it differently; the first of these that is set counts:
``LOCAL_WORLD_SIZE`` (torchrun), ``LOCAL_SIZE`` (DeepSpeed's launcher),
``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI's mpirun), ``MPI_LOCALNRANKS`` (MPICH / Hydra).
With none set and more than one rank, the budget assumes one rank per node and says so once
(counting the ranks per host would take a collective of hostnames at the first profile, for a
case the launchers above already cover); set ``LOCAL_WORLD_SIZE`` to correct it.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from ds_hilore._errors import HiLoReError, bug

DEVICE_MARGIN = 0.05  # of the device's total memory, kept free of any plan (CUDA)
# NOTE [ Ranks on this node ]: read in this order, the first one set counts.
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")

logger = logging.getLogger("ds_hilore")


def budget_bytes(config, gc_peak_bytes: int, device: torch.device) -> int:
    """Bytes per rank the plan may reach at its peak."""
    return budget_and_bound(config, gc_peak_bytes, device)[0]


def budget_and_bound(config, gc_peak_bytes: int, device: torch.device) -> tuple[int, str]:
    """(bytes per rank the plan may reach at its peak, the bound that set it): the stated one
    (``describe(config)``) or ``"device"`` when the device cannot give that much
    (NOTE [ What the device can give ])."""
    if config.memory_budget_bytes is not None:
        stated = int(config.memory_budget_bytes)
    elif config.memory_fraction is not None:
        stated = int(config.memory_fraction * device_memory_bytes(device))
    else:
        stated = int(config.memory_budget * gc_peak_bytes)
    available = device_available_bytes(device)
    if available is not None and available < stated:
        return available, "device"
    return stated, describe(config)


def device_available_bytes(device: torch.device) -> int | None:
    """CUDA: the most this process can hold allocated at once (NOTE [ What the device can
    give ]); None elsewhere (the CPU budget is the process's limit, ``device_memory_bytes``)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    if not (0 <= allocated <= reserved and 0 <= free <= total):
        raise bug(f"CUDA memory readings disagree: free {free} of {total}, reserved {reserved}, "
                  f"allocated {allocated}")
    return max(0, free + reserved - int(DEVICE_MARGIN * total))


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
    return total // ranks_on_this_node()


def ranks_on_this_node() -> int:
    """How many ranks share this node's memory (NOTE [ Ranks on this node ])."""
    for name in LOCAL_SIZE_VARIABLES:
        text = os.environ.get(name)
        if text is None:
            continue
        if not text.strip().isdigit() or int(text) < 1:
            raise HiLoReError(f"ds_hilore: the environment variable {name} = {text!r} is not a "
                              f"positive number of ranks on this node (read for hilore.memory_fraction); "
                              f"fix or unset it.")
        return int(text)
    world = _world_size()
    if world > 1:
        assume_one_rank_per_node(world)
    return 1


@functools.cache
def assume_one_rank_per_node(world_size: int) -> None:
    """Say once that no launcher variable told how many ranks share this node."""
    logger.warning("ds_hilore: %d ranks, but none of %s is set: hilore.memory_fraction assumes "
                   "one rank per node, so every rank budgets this node's whole memory. Set "
                   "LOCAL_WORLD_SIZE to the number of ranks per node.", world_size,
                   ", ".join(LOCAL_SIZE_VARIABLES))


def _world_size() -> int:
    """Ranks in the default process group; 1 without one."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_world_size()
    return 1
