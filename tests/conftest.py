"""Session-wide hygiene for the test suite, and the order modules run in."""

# NOTE [ Two test workers ]
# `make test` runs the suite on two pytest-xdist workers, a whole module per worker
# (`--dist loadfile`): its module-scoped launches run once, on one worker. Most of the suite's
# time is 2-rank launches whose launcher and imports keep one core busy while the other waits,
# so two workers finish the suite in about three quarters of the time one takes on a 2-core
# machine (fresh clone: 819 s against 1072-1228 s). Modules with a multi-process test go first, then those with other slow tests
# (`pytest_collection_modifyitems`): the longest pieces of work start first and the short ones
# fill in behind them, so neither worker is left running a long launch alone at the end
# (`--no-loadscope-reorder`: by default xdist reorders modules by their number of tests, which
# put the launching modules, few tests each, last, and one worker ran them alone for minutes).
# Nothing in a test depends on the order of modules or on the load of the machine;
# `make test PYTEST_WORKERS=0` runs the suite in one process.

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SHM = Path("/dev/shm")
_BUFFERS = "deepspeed_allreduce_buffer_*"  # DeepSpeed's CPU all-reduce, left behind by its ranks
_LEFT_BEFORE = pytest.StashKey[set]()  # the buffers that existed before the run


# Codec kernels built ahead (NOTE [ Codec kernels built ahead ] in ds_hilore/runtime/codec_ahead.py)
# are read from a folder of the session's own, empty: packages a user built on this machine
# never decide what a test compiles. Set before the workers start, which inherit it.
_CACHE_MADE_HERE = "DS_HILORE_TEST_CACHE_DIR" not in os.environ  # the controller, or one process
if _CACHE_MADE_HERE:
    os.environ["DS_HILORE_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="ds_hilore_test_cache_")
os.environ["DS_HILORE_CACHE_DIR"] = os.environ["DS_HILORE_TEST_CACHE_DIR"]


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")  # an xdist worker (the controller has no such input)


def pytest_sessionstart(session):
    """Note the buffers that exist before the run (controller or single process only)."""
    if not _is_worker(session.config) and _SHM.is_dir():
        session.config.stash[_LEFT_BEFORE] = set(_SHM.glob(_BUFFERS))


def pytest_sessionfinish(session):
    """Every 2-rank launch leaves DeepSpeed's shared-memory all-reduce buffers (~70 MB per rank)
    in /dev/shm, which is the machine's memory: remove the ones this run created. Done once,
    after every worker has finished: a worker that removed them on its own would pull them from
    under a launch still running on the other."""
    if _CACHE_MADE_HERE and not _is_worker(session.config):
        shutil.rmtree(os.environ["DS_HILORE_TEST_CACHE_DIR"], ignore_errors=True)
    before = session.config.stash.get(_LEFT_BEFORE, None)
    if before is None:  # an xdist worker: the controller removes them
        return
    for path in set(_SHM.glob(_BUFFERS)) - before:
        path.unlink(missing_ok=True)


def pytest_collection_modifyitems(items):
    """Modules with a multi-process test first, then those with a slow one, each module's tests
    in their own order (NOTE [ Two test workers ])."""
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    rank: dict[str, int] = {}
    for item in items:
        marked = 0 if item.get_closest_marker("distributed") else 1 if item.get_closest_marker("slow") else 2
        rank[module(item)] = min(marked, rank.get(module(item), 2))
    items.sort(key=lambda item: rank[module(item)])  # stable: each module's tests stay together


@pytest.fixture(autouse=True)
def _close_memory_windows():
    """A test that profiles a microbatch and neither ends the step nor detaches leaves that
    microbatch's memory window open (NOTE [ Tracked windows ] in runtime/memory.py: closed at
    the next forward, the step's end or detach); close it so no test starts with a reader on
    its thread's dispatch-mode stack. Then the test's garbage is collected (NOTE [ Garbage
    between tests ])."""
    yield
    from ds_hilore.runtime import memory

    for tracker in list(memory._OPEN):
        tracker.close()


# NOTE [ Garbage between tests ]
# After each test, its fixtures torn down, the test's garbage is collected: a model it dropped
# (held by reference cycles until the collector's next pass) freed in the middle of a later
# test's heap readings would be taken from what that test measures. A full collection walks
# every object the process holds -- torch's, transformers', DeepSpeed's: 0.3-0.5 s a test, a
# quarter of the suite's time -- so what survives it is frozen (``gc.freeze``): the next
# test's collection walks only what was made since. What a module's tests kept alive (its
# module-scoped fixtures) is unfrozen and collected when the next test is another module's.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if nextitem is None or nextitem.path != item.path:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
