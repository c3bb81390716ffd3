"""The peak-memory meter: sees known allocations (even freed ones), backward ops, frozen
parameters, is reproducible run to run; live_storage_bytes counts shared storage once."""

import pytest
import torch
from torch import nn

from ds_hilore._errors import HiLoReError
from ds_hilore.runtime.memory import PeakMeter, in_use_bytes, live_storage_bytes

MiB = 2 ** 20


def test_in_use_bytes_sees_an_allocation_and_its_release():
    before = in_use_bytes("cpu")
    t = torch.empty(16 * MiB // 4)  # 16 MiB fp32: mmapped, counted in hblkhd
    during = in_use_bytes("cpu")
    del t
    after = in_use_bytes("cpu")
    assert during - before >= 16 * MiB
    assert during - after >= 16 * MiB


def test_peak_meter_keeps_the_peak_of_a_tensor_freed_before_exit():
    with PeakMeter("cpu") as meter:
        t = torch.ones(64 * MiB // 4)  # 64 MiB
        del t
        small = torch.ones(10)
    assert meter.peak_delta >= 64 * MiB
    assert meter.peak_delta < 64 * MiB + 4 * MiB  # nothing else of that size happened
    assert meter.end_bytes - meter.start_bytes < 4 * MiB
    assert meter.samples >= 3  # ones, ones, exit
    del small


def test_peak_meter_reads_after_ops_that_allocate_not_after_views():
    # NOTE [ Read after ops that allocate ]: a view allocates nothing, so it is not read
    x = torch.randn(1024, 1024)
    with PeakMeter("cpu") as meter:
        y = x.view(-1).t().detach()  # three views: no reading
        z = x @ x  # allocates 4 MiB: read
        v = z.t()
    assert meter.samples == 2  # the matmul's reading and the exit's
    assert meter.peak_delta >= 4 * MiB
    del y, z, v


def test_peak_meter_sees_backward_ops():
    # tanh saves its 64 MiB output; its backward allocates a 64 MiB gradient while that output
    # is still alive and frees both before backward returns. Only a meter that samples during
    # backward sees start + 64 MiB; entry and exit alone would see a drop.
    x = torch.randn(4096, 64)  # (N, K)
    w = torch.randn(64, 4096, requires_grad=True)  # (K, M) 1 MiB
    loss = torch.tanh(x @ w).sum()  # saves tanh's (N, M) 64 MiB output
    with PeakMeter("cpu") as meter:
        loss.backward()
    assert meter.peak_delta >= 64 * MiB
    assert meter.end_bytes < meter.start_bytes - 32 * MiB  # the saved output is gone


def frozen_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    model[0].requires_grad_(False)  # a frozen base, as under LoRA
    return model


def peak_of_one_step(model, x) -> int:
    with PeakMeter("cpu") as meter:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return meter.peak_delta


def test_peak_meter_works_with_frozen_parameters_and_is_reproducible():
    model, x = frozen_mlp(), torch.randn(2048, 256)
    peak_of_one_step(model, x)  # warm-up: first-use allocations of kernels and thread pools
    peaks = [peak_of_one_step(model, x) for _ in range(3)]
    activations = 2048 * 1024 * 4  # bytes of one (N, 1024) fp32 activation
    assert min(peaks) >= 2 * activations  # Linear output and GELU output are saved together
    assert max(peaks) - min(peaks) <= 64 * 1024, peaks  # same computation, same peak
    assert model[0].weight.grad is None and model[2].weight.grad is None


def test_nested_meters_both_see_the_peak():
    with PeakMeter("cpu") as outer:
        with PeakMeter("cpu") as inner:
            t = torch.empty(8 * MiB // 4)
            del t
    assert inner.peak_delta >= 8 * MiB and outer.peak_delta >= 8 * MiB


def test_unsupported_device_is_an_error():
    with pytest.raises(HiLoReError, match="'cpu' and 'cuda'"):
        in_use_bytes("meta")


def test_live_storage_bytes_counts_each_storage_once():
    a = torch.empty(1000)  # 4000 bytes
    b = torch.empty(10, dtype=torch.float64)  # 80 bytes
    views = [a, a[:10], a.view(10, 100), a[500:].view(50, 10).t(), a.detach()]
    assert live_storage_bytes(views) == 4000
    assert live_storage_bytes(views + [b, b[3:], None]) == 4080
    assert live_storage_bytes([a[:1]]) == 4000  # a small view keeps its whole storage
    assert live_storage_bytes([]) == 0
    assert live_storage_bytes([torch.empty(0)]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_meter_sees_a_freed_allocation():
    with PeakMeter("cuda") as meter:
        t = torch.empty(64 * MiB // 4, device="cuda")
        del t
    assert meter.peak_delta >= 64 * MiB
    assert meter.end_bytes == meter.start_bytes


def test_live_storages_count_new_allocations_once_and_only_while_alive():
    from ds_hilore.runtime.memory import LiveStorages

    x = torch.randn(256, 256)  # made outside: not counted
    with LiveStorages() as tracker:
        y = x * 2  # 256 KiB
        view = y.t()  # an alias: not a new storage
        z = y + 1  # 256 KiB, dropped below
    assert tracker.live_bytes() == 2 * 256 * 256 * 4
    del z
    assert tracker.live_bytes() == 256 * 256 * 4
    assert tracker.live() == [(256 * 256 * 4, (256, 256), torch.float32)]
    del y
    assert tracker.live_bytes() == 256 * 256 * 4  # the view keeps the storage
    del view
    assert tracker.live_bytes() == 0


# The launchers' names for "ranks on this node", in the order the budget reads them.
_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _clear_local_size(monkeypatch):
    for name in _LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("variable", _LOCAL_SIZE_VARIABLES)
def test_memory_fraction_on_cpu_is_shared_by_the_ranks_any_launcher_names(monkeypatch, variable):
    from ds_hilore.config import HiLoReConfig
    from ds_hilore.plan import budget as budgets

    _clear_local_size(monkeypatch)
    cpu = torch.device("cpu")
    whole = budgets.device_memory_bytes(cpu)
    monkeypatch.setenv(variable, "4")
    assert budgets.device_memory_bytes(cpu) == whole // 4
    got = budgets.budget_and_bound(HiLoReConfig(memory_fraction=0.5), 0, cpu)
    assert got == (int(0.5 * (whole // 4)), "hilore.memory_fraction = 0.5")


def test_the_first_local_size_variable_set_wins(monkeypatch):
    from ds_hilore.plan import budget as budgets

    _clear_local_size(monkeypatch)
    monkeypatch.setenv("MPI_LOCALNRANKS", "8")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher, read before mpirun's
    assert budgets.ranks_on_this_node() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's, read first
    assert budgets.ranks_on_this_node() == 3


def test_a_bad_local_size_variable_is_an_error_that_names_it(monkeypatch):
    from ds_hilore.plan import budget as budgets

    _clear_local_size(monkeypatch)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "two")
    with pytest.raises(HiLoReError, match="OMPI_COMM_WORLD_LOCAL_SIZE = 'two'"):
        budgets.ranks_on_this_node()


def test_without_a_local_size_variable_the_budget_assumes_one_rank_and_says_so_once(monkeypatch, caplog):
    from ds_hilore.plan import budget as budgets

    _clear_local_size(monkeypatch)
    budgets.assume_one_rank_per_node.cache_clear()
    monkeypatch.setattr(budgets, "_world_size", lambda: 4)
    with caplog.at_level("WARNING", logger="ds_hilore"):
        assert budgets.ranks_on_this_node() == 1
        assert budgets.ranks_on_this_node() == 1
    said = [record for record in caplog.records if "one rank per node" in record.getMessage()]
    assert len(said) == 1 and "LOCAL_WORLD_SIZE" in said[0].getMessage()
    caplog.clear()
    monkeypatch.setattr(budgets, "_world_size", lambda: 1)  # one process: nothing to share
    budgets.assume_one_rank_per_node.cache_clear()
    with caplog.at_level("WARNING", logger="ds_hilore"):
        assert budgets.ranks_on_this_node() == 1
    assert not caplog.records
