"""Worker for tests/test_rank_agreement.py: the allocator's numbers agreed over 2 CPU ranks, where
each rank's own differ (NOTE [ Collective elision ] for why a rank-local decision hangs: a
replan, a plan check or a restore is a collective). The runtime is a real one attached to a tiny
model, with torch.distributed's collective; what differs between ranks here is handed in, as a
device of another size, an uneven last microbatch or another GPU model would make it:

* ``budget``: rank 1's device can give less than the stated budget (``device_available_bytes``,
  CUDA's free memory; None on CPU). Reports the bucket's budget and bound on each rank.
* ``profile``: rank 1 profiled a microbatch of 3 sequences, not 4, its units cannot be split by
  sequence, and its GC peak is lower but further above a lower baseline (980 over 500 MiB;
  rank 0: 1000 over 800). Reports each unit's agreed rows, sliceable and derived bytes, and the
  agreed peak and baseline.
* ``resume``: a checkpoint's HiLoRe state whose setup matches rank 0's and not rank 1's (another
  GPU model). Reports whether each rank restored it.
"""

from __future__ import annotations

import types

import torch.distributed as dist

from tests.launch import case_arguments, run_cases

MiB = 2**20


def _runtime(config: dict):
    import ds_hilore
    from ds_hilore.integrations.engine import TorchDistCollective
    from tests.models import tiny_model

    runtime = ds_hilore.attach(tiny_model("llama"), dict(config, calibration_microbatches=0,
                                                        plan_validation_microbatches=0))
    runtime.collective = TorchDistCollective()
    return runtime


def _profile(rows: int, sliceable: bool, derived: int, gc_mib: int = 1000, baseline_mib: int = 800):
    from ds_hilore.plan.profile import BucketProfile, UnitCost

    units = [UnitCost(name=f"model.layers.{i}.{kind}", kind=kind, layer=i, pos=p, recompute_s=0.01,
                      h_bytes=10 * MiB, l_bytes=10 * MiB, rows=rows, sliceable=sliceable,
                      derived_bytes=derived)
             for i in range(2) for p, kind in enumerate(("attn", "mlp"))]
    return BucketProfile((4, 128), units, gc_peak_bytes=gc_mib * MiB,
                         baseline_bytes=baseline_mib * MiB, repeats=2, seconds=0.1)


def _bucket(policy, profile):
    from ds_hilore.plan.buckets import Bucket
    from ds_hilore.plan.profile import Profiler

    bucket = policy.buckets[profile.key] = Bucket(profile.key, Profiler(profile.key, 0), profile)
    return bucket


def budget(rank: int) -> dict:
    from ds_hilore.plan import budget as budgets

    runtime = _runtime({"memory_budget": 1.1})
    budgets.device_available_bytes = lambda device: None if rank == 0 else 1050 * MiB
    bucket = _bucket(runtime.policy, _profile(4, True, 0))
    runtime.policy._plan_bucket(bucket, profiled=False)
    return {"budget_bytes": bucket.budget_bytes, "bound": bucket.budget_bound,
            "plan": bucket.plan.actions}


def profile(rank: int) -> dict:
    from ds_hilore.plan.metering import agree

    runtime = _runtime({"memory_budget": 1.1})
    agreed = agree(_profile(4, True, MiB) if rank == 0 else _profile(3, False, 2 * MiB, 980, 500),
                   runtime.collective)
    return {"units": [(u.rows, u.sliceable, u.derived_bytes) for u in agreed.units],
            "gc_peak_bytes": agreed.gc_peak_bytes, "baseline_bytes": agreed.baseline_bytes}


def resume(rank: int) -> dict:
    from ds_hilore.integrations import engine

    runtime = _runtime({"memory_budget": 1.1})
    saved_setup = dict(engine.setup_key(), device_name="GPU A")
    mine = dict(saved_setup, device_name="GPU A" if rank == 0 else "GPU B")
    engine.setup_key = lambda: mine
    restored = []
    load = runtime.load_state_dict
    runtime.load_state_dict = lambda state: (restored.append(True), load(state))
    holder = types.SimpleNamespace(hilore=runtime)  # what the restore reads of an engine
    engine._restore_runtime_state(holder, {"setup": saved_setup, "runtime": runtime.state_dict()},
                                  "a checkpoint")
    return {"restored": bool(restored)}


CASES = {"budget": budget, "profile": profile, "resume": resume}


def main() -> None:
    args = case_arguments(CASES)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", distributed_port=args.master_port)
    run_cases("plan_agreement_worker", args.case, lambda case: CASES[case](dist.get_rank()),
              args.result_dir)


if __name__ == "__main__":
    main()
