"""``ds_hilore.attach`` without DeepSpeed on 2 CPU ranks, under DistributedDataParallel, FSDP2
and FSDP1 (NOTE [ Data parallel wrappers ] in ds_hilore/runtime/install.py): one launch of
tests/workers/data_parallel_worker.py (its docstring says what each case runs).

Under every wrapper, ``force_plan`` H and R give gradients bitwise those of HF's gradient
checkpointing on each rank, and so does the planner (``low_precision: "none"``), whose plans are
the same on both ranks although each rank's microbatches are of another length (NOTE [ One
decision for every rank ] in ds_hilore/runtime/collective.py); a step whose loss coefficients
are all zero runs its layers' backward, which the wrappers' gradient hooks need (NOTE [ A
backward of zeros ] in ds_hilore/runtime/zero_backward.py). In one process: the wrappers
HiLoRe does not support are refused at attach, naming the way in."""

from __future__ import annotations

import pytest
import torch

import ds_hilore
from ds_hilore import HiLoReError
from models import tiny_model

WRAPPERS = ("ddp", "fsdp2", "fsdp1")


@pytest.fixture(scope="module")
def ranks():
    from tests.launch import run_distributed
    from tests.workers import data_parallel_worker as worker

    args = [a for case in worker.CASES for a in ("--case", case)]
    return run_distributed(worker.__file__, args, nprocs=2, timeout=300)


def _case(rank: dict, name: str) -> dict:
    got = rank["cases"][name]
    if "error" in got:
        pytest.fail(f"rank {rank['rank']}, case {name} raised:\n{got['error']}", pytrace=False)
    return got


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_attach_under_a_data_parallel_wrapper_is_exact_and_agreed_over_ranks(ranks, wrapper):
    got = [_case(r, wrapper) for r in ranks]
    for rank in got:
        reference = rank["gc"]["digests"]
        for mode in ("H", "R", "planner"):
            assert rank[mode]["digests"] == reference, (wrapper, mode)
            assert rank[mode]["collective"] == "TorchDistCollective", (wrapper, mode)
            # the wrapper's hooks reduce every gradient as it is made: no backward skipped
            assert rank[mode]["skipped"] == [0, 0, 0], (wrapper, mode)
    plans = [rank["planner"]["plans"] for rank in got]
    assert plans[0] == plans[1], plans  # one bucket (the longer rank's), one plan, every step
    assert list(plans[0][-1]) == ["2x32"] and plans[0][-1]["2x32"] is not None, plans[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_parameters_are_refused_at_attach(ranks):
    for rank in ranks:
        raised = _case(rank, "tensor_parallel")["raised"]
        assert raised is not None and "fully_shard" in raised and "DistributedDataParallel" in raised


def test_data_parallel_is_refused_at_attach_with_the_supported_ways_in():
    model = tiny_model("llama", layers=2)
    with pytest.raises(HiLoReError, match="DistributedDataParallel.*ds_hilore.initialize"):
        ds_hilore.attach(torch.nn.DataParallel(model))
    assert ds_hilore.find_runtime(model) is None  # the model is left as it was


def test_a_deepspeed_engine_is_refused_at_attach():
    class DeepSpeedEngine(torch.nn.Module):  # what attach reads of one: its class and module
        def __init__(self, module):
            super().__init__()
            self.module = module

    DeepSpeedEngine.__module__ = "deepspeed.runtime.engine"
    with pytest.raises(HiLoReError, match=r"ds_hilore.initialize\(\.\.\.\) in place of"):
        ds_hilore.attach(DeepSpeedEngine(tiny_model("llama", layers=2)))
