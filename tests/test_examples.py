"""The example training script, launched as a user would (2 CPU ranks, deepspeed runner)."""

import math

import pytest

from tests.launch import run_distributed


@pytest.mark.distributed
def test_grpo_minimal_trains_with_the_zero2_hilore_config():
    ranks = run_distributed("examples/grpo_minimal.py",
                            ["--deepspeed_config", "ds_configs/zero2_hilore.json", "--steps", "2"],
                            nprocs=2, timeout=300)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["plan_hash"] == ranks[1]["plan_hash"]
    for r in ranks:
        assert len(r["losses"]) == 2 * 2 and all(math.isfinite(x) for x in r["losses"])
        stats = r["stats"]
        # all R; the first micro-step is one group with identical rewards (A = 0) on every rank:
        # elided whole, nothing recomputed; the second recomputes its 2 layers x 2 units
        assert stats["actions"]["R"] == 2 * 4
        assert stats["recomputed_units"] == 4
