"""Worker for tests/test_launch.py: reports what its launcher gave it, or fails on one rank.

``--fail_rank R``: rank R raises before the barrier every other rank waits at (a rank left
waiting in a collective, as when a test's worker breaks on one rank).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from tests.launch import write_result

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
       "MASTER_PORT", "DS_ACCELERATOR")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail_rank", type=int, default=-1)
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher passes it
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == args.fail_rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    dist.barrier()
    write_result(args.result_dir, rank, {"env": {k: os.environ.get(k) for k in ENV},
                                         "local_rank_arg": args.local_rank, "argv": sys.argv[1:],
                                         "world_size": dist.get_world_size()})


if __name__ == "__main__":
    main()
