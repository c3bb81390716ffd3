"""Decisions about elided sequences taken the same on every rank, under a real DeepSpeed engine
on 2 CPU ranks (NOTE [ Collective elision ] in ds_hilore/runtime/agreement.py): one launch of
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


def test_a_leak_read_at_another_engines_optimizer_step_stops_every_rank(ranks):
    got = [_case(r, "late_leak_two_engines") for r in ranks]
    for rank in got:  # the second step raises at the critic's optimizer step, on both ranks
        assert rank["raised"][0] is None, rank
        assert len(rank["raised"]) == 2 and "gradient reached sequences" in rank["raised"][1], rank
        assert rank["critic_steps"] == 1, rank  # the critic's optimizer did not step either


def test_a_packed_row_on_one_rank_skips_the_backward_as_the_other_ranks_do(ranks):
    got = [_case(r, "packed_skip") for r in ranks]
    for rank in got:
        assert rank["raised"] == [None, None], rank
        assert rank["backward_skipped"] == [0, 1], rank  # the zero step skipped, on both ranks
    assert got[0]["params"] == got[1]["params"]  # and both stepped on the same gradients


def test_a_forward_that_stops_short_recomputes_on_every_rank(ranks):
    got = [_case(r, "stopped_short") for r in ranks]
    for rank in got:  # both steps completed on both ranks: the recompute was collective
        assert rank["raised"] == [None, None] and rank["global_steps"] == 2, rank


def test_the_last_layers_checks_are_agreed_on_whether_its_frame_keeps_or_not(ranks):
    got = [_case(r, "top_frame_on_one_rank") for r in ranks]
    # step 1: rank 0 knows the shape (its last frame keeps nothing), rank 1 learns it; step 2
    # the other way round; step 3 both know it
    assert [g["whole"] for g in got] == [[[], [0, 1], [], [0, 1]], [[], [], [0, 1], [0, 1]]], got
    for rank in got:  # no rank waited on an all-reduce the other never made
        assert rank["raised"] == [None] * 4 and rank["global_steps"] == 4, rank
    assert got[0]["params"] == got[1]["params"]


@pytest.fixture(scope="module")
def planned():
    """One launch of tests/workers/plan_agreement_worker.py (its docstring says what each case
    hands each rank)."""
    from tests.workers import plan_agreement_worker as plans

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args = [a for case in plans.CASES for a in ("--case", case)]
    return run_distributed(plans.__file__, args, nprocs=2, timeout=180)


def test_every_rank_plans_within_the_least_budget_over_ranks(planned):
    got = [_case(r, "budget") for r in planned]
    assert got[0] == got[1], got  # budget, bound and plan
    assert got[0]["budget_bytes"] == 1050 * 2**20 and got[0]["bound"] == "device", got


def test_a_profile_is_agreed_in_every_field_the_plans_read(planned):
    got = [_case(r, "profile") for r in planned]
    assert got[0] == got[1], got
    # the bucket's 4 rows, split by sequence only where every rank can, the most derived bytes
    assert got[0]["units"] == [[4, False, 2 * 2**20]] * 4, got
    # the highest peak, and under it the most any rank's peak rose above its baseline (480
    # MiB): GC's peak priced at a longer length covers every rank's
    assert (got[0]["gc_peak_bytes"], got[0]["baseline_bytes"]) == (1000 * 2**20, 520 * 2**20)


def test_a_checkpoint_state_is_restored_on_every_rank_or_on_none(planned):
    got = [_case(r, "resume") for r in planned]
    assert [g["restored"] for g in got] == [False, False], got  # rank 1's device differs


def test_steady_steps_run_each_ranks_own_shape_as_gc_and_train_exactly(ranks):
    """NOTE [ A steady step agrees nothing before its forwards ]: once 4x32 is planned (to run
    as GC: no headroom), the steps are steady; rank 1's shorter microbatch (no bucket of its
    own) makes the step after agree again; its longer one, that no bucket holds, too, and the
    next step agrees and profiles 4x64 on both ranks. No hang; every rank keeps the same
    buckets; parameters bitwise those of the run without HiLoRe (GC is exact)."""
    got = [_case(r, "local_buckets") for r in ranks]
    for rank in got:
        hilore, off = rank["hilore"], rank["off"]
        assert hilore["raised"] == [None] * len(worker.LOCAL_LENGTHS), hilore
        # step 0 profiles 4x32, 1 plans it, 2 charges what memory appeared since (NOTE [ Memory
        # that appears after profiling ]); 3 steady (rank 1's 16); 4 agrees; 5 steady (rank 1's
        # 48: unplanned); 6 agrees and profiles 4x64, 7 and 8 as 1 and 2; 9 steady
        assert hilore["steady"] == [False] * 3 + [True, False, True] + [False] * 3 + [True]
        assert all(hilore["as_gc"][1:6]) and all(hilore["as_gc"][7:]), hilore["as_gc"]
        assert hilore["buckets"][5] == ["4x32"] and hilore["buckets"][6] == ["4x32", "4x64"]
        assert hilore["params"] == off["params"]
    assert got[0]["hilore"]["buckets"] == got[1]["hilore"]["buckets"]
    assert got[1]["hilore"]["unplanned"][5] == 1 and got[0]["hilore"]["unplanned"][5] == 0


def test_steady_steps_run_each_ranks_own_plan_with_its_own_checks_and_train_exactly(ranks):
    """NOTE [ A steady step agrees nothing before its forwards ]: once 4x32 is planned (it
    keeps its units: budget 4x), the steps are steady and each rank takes the bucket of its own
    shape -- rank 1's 16 the plan of 4x32, its 48 (no bucket holds it) all R while rank 0 runs
    4x32's plan and finds zero sequences (its check at the top of the backward is its own:
    agreed, rank 1 would not have joined it, a hang) -- then 4x64 is agreed and profiled, and
    the steps are steady again with each rank on its own bucket. No hang; the same buckets on
    both ranks; parameters bitwise those of the run without HiLoRe (H and R are exact)."""
    got = [_case(r, "local_plans") for r in ranks]
    for rank in got:
        hilore, off = rank["hilore"], rank["off"]
        assert hilore["raised"] == [None] * len(worker.LOCAL_PLANS), hilore
        assert hilore["params"] == off["params"]
        # the plans this budget gives keep something: the steps after settling are steady
        # (an H/R plan is the allocator's, timed: whatever it is, the assertions above hold)
        if all("H" in (plan or "") for plan in hilore["buckets"][-1].values()):
            # 0 profiles 4x32, 1 plans it, 2 charges the memory that appeared since; 3-5
            # steady (rank 1's 48 at 5); 6 profiles 4x64, 7 plans it, 8 charges; 9- steady
            steady = [False] * 3 + [True] * 3 + [False] * 3 + [True] * 4
            assert hilore["steady"] == steady and hilore["local"] == steady, hilore
            assert got[0]["hilore"]["kept"][5] > 0  # rank 0 ran 4x32's plan there
    assert got[0]["hilore"]["buckets"] == got[1]["hilore"]["buckets"]
    assert got[1]["hilore"]["kept"][5] == 0  # rank 1's 48: no plan is priced for it


def test_steady_steps_run_each_ranks_own_prediction_and_train_exactly(ranks):
    """A prediction in a steady step is this rank's own (NOTE [ Freed memory is spent ] in
    ds_hilore/plan/prediction.py): once 4x16 is settled, the steps stay steady while
    predictions come, and each rank runs the rows its own prediction keeps -- two of four, or
    all -- and skips the layers' backward of a microbatch predicted zero (NOTE [ A microbatch
    predicted zero ]; agreed, it would keep a row of it), with nothing agreed. No hang; parameters
    bitwise those of the run without HiLoRe (H and R are exact; rows run apart are too at this
    width and length, NOTE [ Kept rows only ] in ds_hilore/runtime/rows.py)."""
    got = [_case(r, "local_predictions") for r in ranks]
    predicted = sum(1 for *_, predict in worker.LOCAL_PREDICTIONS if predict)
    for rank in got:
        hilore, off = rank["hilore"], rank["off"]
        assert hilore["raised"] == [None] * len(worker.LOCAL_PREDICTIONS), hilore
        assert hilore["params"] == off["params"]
        assert hilore["steady"][-predicted:] == [True] * predicted, hilore
        assert hilore["local"][-predicted:] == [True] * predicted, hilore
    assert got[0]["hilore"]["kept"][-predicted:] == [[0, 2], None] * (predicted // 2)
    assert got[1]["hilore"]["kept"][-predicted:] == [None, [0, 2]] * (predicted // 2)
    assert got[1]["hilore"]["skipped"][-predicted:] == [1, 0] * (predicted // 2)
    assert got[0]["hilore"]["skipped"][-predicted:] == [0, 0] * (predicted // 2)


def test_a_steady_step_with_a_gc_bucket_on_one_rank_fires_the_hooks_in_one_order(ranks):
    """NOTE [ One order of gradient hooks on every rank ]: in steady steps with one rank on a
    bucket that runs as GC and the other on one that runs its plan, the first runs all R
    through HiLoRe's frames (as GC it would fire the final norm's and the LM head's gradient
    hooks in the other order, and ZeRO-2 would sum one's gradient with the other's). No hang;
    parameters bitwise those of the run without HiLoRe."""
    got = [_case(r, "local_mixed") for r in ranks]
    mixed = len(worker.LOCAL_MIXED) - 7  # the first mixed step may still agree
    for rank in got:
        hilore, off = rank["hilore"], rank["off"]
        assert hilore["raised"] == [None] * len(worker.LOCAL_MIXED), hilore
        assert hilore["steady"][-mixed:] == [True] * mixed, hilore
        assert not any(hilore["as_gc"][-mixed:]), hilore
        assert hilore["params"] == off["params"]


def test_a_forward_dropped_on_every_rank_gives_the_next_loss_to_its_own_forward(ranks):
    """NOTE [ The last layer's output, marked ]: a forward dropped without a backward, the
    collector off, then the step's microbatch, in eight steady steps: no rank raises or waits, and the
    parameters are bitwise those of the run without HiLoRe. Its coefficients went to the
    dropped forward where the new graph reused its node's address: the ranks' all-reduces then
    differed in length."""
    got = [_case(r, "dropped_forward") for r in ranks]
    for rank in got:
        hilore, off = rank["hilore"], rank["off"]
        assert hilore["raised"] == [None] * len(worker.DROPPED), hilore
        assert hilore["params"] == off["params"]
