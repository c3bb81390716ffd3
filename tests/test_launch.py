"""The test launcher's ranks started directly get what DeepSpeed's runner gives them, and a
rank that fails ends the launch at once (NOTE [ Three ways to start ranks ] in tests/launch.py)."""

from __future__ import annotations

import pytest

from tests.launch import run_distributed
from tests.workers import launch_worker as worker

pytestmark = pytest.mark.distributed


def test_ranks_started_directly_get_what_the_deepspeed_runner_gives():
    direct = run_distributed(worker.__file__, nprocs=2, launcher="direct", timeout=120)
    runner = run_distributed(worker.__file__, nprocs=2, launcher="deepspeed", timeout=120)
    for rank, (mine, theirs) in enumerate(zip(direct, runner, strict=True)):
        assert mine["world_size"] == theirs["world_size"] == 2
        assert mine["local_rank_arg"] == theirs["local_rank_arg"] == rank
        assert mine["env"]["RANK"] == mine["env"]["LOCAL_RANK"] == str(rank)
        ports = mine["env"].pop("MASTER_PORT"), theirs["env"].pop("MASTER_PORT")  # each launch's own
        assert all(ports)
        assert mine["env"] == theirs["env"]
        # the same arguments in the same order, but for each launch's own folder and port
        assert _shape(mine["argv"]) == _shape(theirs["argv"])
        assert mine["argv"][0] == f"--local_rank={rank}"


def _shape(argv: list[str]) -> list[str]:
    return [a if k == 0 or argv[k - 1] not in ("--result_dir", "--master_port") else "VALUE"
            for k, a in enumerate(argv)]


def test_a_rank_that_fails_ends_the_launch_with_its_error():
    with pytest.raises(pytest.fail.Exception) as failure:
        run_distributed(worker.__file__, ["--fail_rank", "1"], nprocs=2, launcher="direct",
                        timeout=240, retry=False)
    message = str(failure.value)
    # not the timeout: rank 0, left at the barrier, was ended when rank 1 exited with its error
    assert "exited with" in message and "timed out" not in message
    assert "rank 1 fails on purpose" in message
