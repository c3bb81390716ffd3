"""The example training script, launched as a user would (2 CPU ranks, deepspeed runner)."""

import math

import pytest

from tests.launch import run_distributed


@pytest.mark.distributed
def test_grpo_minimal_trains_with_the_zero2_hilore_config():
    ranks = run_distributed("examples/grpo_minimal.py",
                            ["--deepspeed_config", "ds_configs/zero2_hilore.json", "--steps", "2"],
                            nprocs=2, launcher="deepspeed", timeout=300)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["plan_hash"] == ranks[1]["plan_hash"]
    for r in ranks:
        assert len(r["losses"]) == 2 * 2 and all(math.isfinite(x) for x in r["losses"])
        stats = r["stats"]
        # the allocator decides: 3 profiled microbatches (all R, as GC), then the plan; the last
        # step's 2 micro-steps report 2 layers x 2 units each
        assert sum(stats["actions"].values()) == 2 * 4
        assert stats["budget_bytes"] > 0 and stats["plans"]  # planned within a measured budget
        assert stats["peak_bytes"] is None or stats["peak_bytes"] > 0
