"""Session-wide hygiene for the test suite."""

from pathlib import Path

import pytest

_SHM = Path("/dev/shm")
_BUFFERS = "deepspeed_allreduce_buffer_*"  # DeepSpeed's CPU all-reduce, left behind by its ranks


@pytest.fixture(scope="session", autouse=True)
def _remove_leaked_shared_memory():
    """Every 2-rank launch leaves DeepSpeed's shared-memory all-reduce buffers (~70 MB per rank)
    in /dev/shm, which is the machine's memory: remove the ones this session created."""
    before = set(_SHM.glob(_BUFFERS)) if _SHM.is_dir() else set()
    yield
    if _SHM.is_dir():
        for path in set(_SHM.glob(_BUFFERS)) - before:
            path.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _close_memory_windows():
    """A test that profiles a microbatch and neither ends the step nor detaches leaves that
    microbatch's memory window open (NOTE [ Tracked windows ] in runtime/memory.py: closed at
    the next forward, the step's end or detach); close it so no test starts with a reader on
    its thread's dispatch-mode stack."""
    yield
    from ds_hilore.runtime import memory

    for tracker in list(memory._OPEN):
        tracker.close()
