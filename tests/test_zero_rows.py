"""Zero sequences under ZeRO-2 and ZeRO-3 on 2 CPU ranks whose zero rows differ (NOTE [ A backward
of zeros ] in ds_hilore/runtime/zero_backward.py, NOTE [ Kept rows only ] in
ds_hilore/runtime/rows.py): rank 1's first micro-step is all zero while rank 0's is not, and
the other micro-steps' zero rows differ by rank. No launch may hang (each fails by its
timeout), and after 3 optimizer steps every parameter is bitwise that of the run with
transformers' checkpointing and no HiLoRe (and, under ZeRO-2, of HiLoRe without the skip).

Two launches, ~1-2 minutes each on 2 cores."""

from __future__ import annotations

import os

import pytest

from tests.launch import run_distributed
from tests.workers import zero_rows_worker as worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_launched: dict[str, list[dict]] = {}


@pytest.fixture(scope="module", autouse=True)
def ds_op_built():
    """Build DeepSpeed's CPU shared-memory op once here, not concurrently in two ranks."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load()


def ranks(stage: str) -> list[dict]:
    """Every mode of ``stage`` in one launch (once per session)."""
    if stage not in _launched:
        cases = [f"{stage}:{mode}" for mode in worker.MODES]
        args = [a for case in cases for a in ("--case", case)]
        _launched[stage] = run_distributed(worker.__file__, args, nprocs=2, timeout=600)
    return _launched[stage]


def result(rank: dict, case: str) -> dict:
    got = rank["cases"][case]
    if "error" in got:
        pytest.fail(f"rank {rank['rank']}, case {case} raised:\n{got['error']}", pytrace=False)
    return got


def assert_same_run(stage: str, mode: str) -> dict[int, dict]:
    """``mode``'s losses and final parameters on every rank bitwise those of ``gc``."""
    out = {}
    for rank in ranks(stage):
        got, ref = result(rank, f"{stage}:{mode}"), result(rank, f"{stage}:gc")
        assert got["losses"] == ref["losses"], (rank["rank"], mode)
        assert got["param_sha"] == ref["param_sha"], (rank["rank"], mode)
        out[rank["rank"]] = got
    return out


def test_zero2_a_rank_of_zeros_skips_its_backward_while_the_other_runs_its():
    got = assert_same_run("zero2", "skip")
    assert_same_run("zero2", "noskip")
    # per step: rank 1's first micro-step (all zero) skipped, its second (partly zero) not;
    # rank 0 never: the gradient hooks of ZeRO-2 met the same parameters in the same order
    assert got[1]["skipped"] == [1, 0] * worker.STEPS
    assert got[0]["skipped"] == [0, 0] * worker.STEPS
    noskip = [result(r, "zero2:noskip")["skipped"] for r in ranks("zero2")]
    assert noskip == [[0, 0] * worker.STEPS] * 2


@pytest.mark.parametrize("plan", ["R", "H"])
def test_zero2_kept_rows_differ_by_rank(plan):
    got = assert_same_run("zero2", f"predict_{plan}")
    # the first microbatch runs whole (the layers' safety for a split is learnt there); then
    # rank 0 keeps its non-zero rows and runs whole where none is zero; rank 1 keeps one row
    # of its zero microbatch (skipped: its gradient is zero) and its two non-zero rows
    assert got[0]["kept_rows"] == [None, None] + [[0, 2], None] * (worker.STEPS - 1)
    assert got[1]["kept_rows"] == [None, [1, 3]] + [[0], [1, 3]] * (worker.STEPS - 1)
    assert got[1]["skipped"] == [1, 0] * worker.STEPS


def test_zero3_skip_is_refused_and_nothing_hangs():
    got = assert_same_run("zero3", "skip")
    assert all(not any(r["skipped"]) for r in got.values())


@pytest.mark.parametrize("plan", ["R", "H"])
def test_zero3_kept_rows_make_the_same_module_calls_on_every_rank(plan):
    got = assert_same_run("zero3", f"predict_{plan}")
    # where rank 1 splits, rank 0 splits too: a probe row runs without autograd beside all of
    # its rows kept; rank 1's zero microbatch keeps one row (its backward runs over it)
    assert got[0]["kept_rows"] == [None, [0, 1, 2, 3]] + [[0, 2], [0, 1, 2, 3]] * (worker.STEPS - 1)
    assert got[1]["kept_rows"] == [None, [1, 3]] + [[0], [1, 3]] * (worker.STEPS - 1)
    assert all(not any(r["skipped"]) for r in got.values())
