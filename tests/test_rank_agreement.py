"""Decisions about elided sequences taken the same on every rank, under a real DeepSpeed engine
on 2 CPU ranks (NOTE [ Collective elision ] in ds_hilore/runtime/elision.py): one launch of
tests/workers/rank_agreement_worker.py (its docstring says what each case does)."""

from __future__ import annotations

import os

import pytest

from tests.launch import run_distributed
from tests.workers import rank_agreement_worker as worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_launched: list = []


@pytest.fixture(scope="module")
def ranks():
    """One launch for the module's tests."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load()  # built here once, not by two ranks at once
    args = [a for case in worker.CASES for a in ("--case", case)]
    return run_distributed(worker.__file__, args, nprocs=2, timeout=180)


def _case(rank: dict, name: str) -> dict:
    got = rank["cases"][name]
    if "error" in got:
        pytest.fail(f"rank {rank['rank']}, case {name} raised:\n{got['error']}", pytrace=False)
    return got


def test_a_leak_on_one_rank_stops_every_rank_before_the_optimizer_steps(ranks):
    got = [_case(r, "late_leak") for r in ranks]
    for rank in got:  # the first step steps; the second raises on both ranks, rank 1's too
        assert rank["raised"][0] is None, rank
        assert rank["raised"][1] is not None and "gradient reached sequences" in rank["raised"][1]
        assert rank["global_steps"] == 1, rank  # the optimizer did not step on the wrong gradients


def test_a_packed_row_on_one_rank_skips_the_backward_as_the_other_ranks_do(ranks):
    got = [_case(r, "packed_skip") for r in ranks]
    for rank in got:
        assert rank["raised"] == [None, None], rank
        assert rank["backward_skipped"] == [0, 1], rank  # the zero step skipped, on both ranks
    assert got[0]["params"] == got[1]["params"]  # and both stepped on the same gradients
