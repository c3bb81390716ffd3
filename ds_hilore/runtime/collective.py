"""``runtime.collective``: every rank takes the same decisions, over torch.distributed.

NOTE [ One decision for every rank ]
Under several ranks, what a rank recomputes, gathers or keeps must be what every other rank
does: a recompute under ZeRO-3 or FSDP gathers the layer's parameters (a collective), so a
unit recomputed on one rank only issues gathers the others never match (gloo: "collective
mismatch"; NCCL: a hang, or shards of same-shaped weights paired wrongly). So every decision
taken from one rank's numbers (a shape bucket, a profile, a plan, which units go to R, an
elision, a layer's split) goes through this object: rank 0 decides from statistics reduced
over ranks and broadcasts, or every rank takes the max. The runtime makes one at attach
whenever torch.distributed is initialized with several ranks -- ``ds_hilore.initialize`` and
``ds_hilore.attach`` alike (DDP, FSDP, or a script's own data parallelism) -- so every rank
must attach at the same point.

The values agreed on are host values (lists of numbers, pickled objects). Reduced over an
accelerator's group (NCCL) they would be copied to the device and back, and the copy back
waits for every kernel queued before it: each agreement would drain the device's queue. So
where the default group's backend is not a CPU one, host values go over a gloo group made
once, at attach (a collective: every rank attaches together); on gloo or MPI the default group
carries them. A whole tensor (a gradient summed over ranks) stays on its device and its group.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TorchDistCollective", "collective_for_attach"]

_HOST_BACKENDS = ("gloo", "mpi")  # reduce CPU tensors without an accelerator's queue
_ACTIONS = "HLRE"  # broadcast_actions' codes


def collective_for_attach() -> "TorchDistCollective | None":
    """The collective of a runtime attached now: one when torch.distributed is initialized
    with several ranks (NOTE [ One decision for every rank ]), else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return TorchDistCollective()


class TorchDistCollective:
    """``runtime.collective`` over torch.distributed: every rank executes the same plan.

    Rank 0 of the group decides (from all-reduced statistics) and broadcasts the action
    vector; ZeRO-3 and FSDP gathers are collectives, so ranks with different plans would hang.
    Every method is a collective: all ranks must call it, in the same order, with lists of
    the same length. Making one is a collective too where the group's backend is not a CPU
    one (NCCL): host values then go over a gloo group made here (NOTE [ One decision for
    every rank ]).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group  # None = the default (world) group: whole tensors go over it
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.host_group = group if dist.get_backend(group) in _HOST_BACKENDS else \
            dist.new_group(ranks=dist.get_process_group_ranks(group) if group is not None else None,
                           backend="gloo")
        self.device = "cpu"  # where the host values are reduced

    def broadcast_actions(self, actions: list[str]) -> list[str]:
        """Rank 0's ``actions`` (one of "HLRE" each, as many on every rank) on every rank; other
        ranks' input is ignored. One broadcast of their codes (an object's takes two)."""
        codes = torch.tensor([_ACTIONS.index(a) for a in actions], dtype=torch.int64)
        if _TRACE:
            _trace(self.rank, f"broadcast_actions n={len(actions)}")
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(codes, src=source, group=self.host_group)
        return [_ACTIONS[c] for c in codes.tolist()]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank."""
        box = [obj if self.rank == 0 else None]
        if _TRACE:
            _trace(self.rank, "broadcast_object")
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=source, group=self.host_group)
        return box[0]

    def all_reduce_max_float(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks (float64)."""
        return self._all_reduce(values, torch.float64, dist.ReduceOp.MAX)

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise max over ranks."""
        return self._all_reduce(values, torch.int64, dist.ReduceOp.MAX)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        return self._all_reduce(values, torch.float64, dist.ReduceOp.SUM)

    def all_reduce_sum_tensor(self, tensor: torch.Tensor) -> None:
        """``tensor`` summed over ranks, in place (a whole gradient: no list of floats): an
        accelerator's tensor on its own device where the group's backend reduces there (NCCL),
        anything else on the host."""
        on_host = tensor.device.type == "cpu" or self.host_group is self.group
        moved = tensor.cpu() if on_host else tensor
        dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=self.host_group if on_host else self.group)
        if moved is not tensor:
            tensor.copy_(moved)

    def _all_reduce(self, values: list, dtype: torch.dtype, op: Any) -> list:
        """``values`` reduced by ``op`` (MAX or SUM) over ranks: gathered, then reduced here in
        rank order (NOTE [ Host values gathered ]); a long list by an all-reduce."""
        tensor = torch.tensor(list(values), dtype=dtype)  # (n,) on the host
        if _TRACE:
            _trace(self.rank, f"all_reduce {op} {dtype} n={len(values)}")
        if len(values) > _GATHER_MAX:
            dist.all_reduce(tensor, op=op, group=self.host_group)
            return tensor.tolist()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.host_group)
        if op == dist.ReduceOp.MAX:
            return torch.stack(parts).amax(0).tolist()  # (world, n) -> (n,): any order
        total = parts[0]
        for part in parts[1:]:  # rank by rank: a sum's order is the ranks', on any CPU
            total = total + part
        return total.tolist()


# NOTE [ Host values gathered ]
# The host values ranks agree on are short lists (a microbatch's flags and risks, a profile's
# numbers): their cost is the collective's latency, not its bytes. Gloo reduces even a few
# numbers in several rounds of messages: an all-reduce of 24 float64 between 2 processes took
# 1.0-2.0 ms on a 2-core CPU, an all-gather of the same 0.5 ms and a broadcast 0.4 ms -- and
# the elision's agreement runs once per microbatch (NOTE [ Collective elision ] in
# agreement.py). So a list of up to ``_GATHER_MAX`` values is all-gathered and every rank
# reduces the (world, n) table itself: a max in any order, a sum rank by rank (one addition
# per rank and value, in rank order, whatever the CPU's vector width or threads: a reduction
# over the table's rows would order its additions by the kernel's accumulators, which may
# differ between machines of one run). The same numbers on every rank, bitwise. Longer lists
# (none on the hot path) go through an all-reduce: a gathered table grows with the world.
_GATHER_MAX = 1024


# DS_HILORE_TRACE_COLLECTIVES=DIR: every rank appends each of its host collectives, with the
# code that called it, to DIR/rank<r>.txt -- what to compare when ranks disagree ("collective
# mismatch" under gloo, a hang under NCCL).
_TRACE = os.environ.get("DS_HILORE_TRACE_COLLECTIVES")


def _trace(rank: int, what: str) -> None:
    frames = traceback.extract_stack(limit=6)[:-3]
    where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames))
    with open(os.path.join(_TRACE, f"rank{rank}.txt"), "a") as out:
        out.write(f"{what} | {where}\n")
