"""MKL's GEMM buffers are left out of CPU readings, and the attach-time probe's are handed back
(NOTE [ MKL's buffers ] in runtime/memory.py): whether a GEMM leaves buffers is MKL's choice
(by shape and by where the operands lie), so a reading that held them would move by chance,
and a process with HiLoRe attached would hold what the same script without it may not.

Where torch links no MKL there is nothing to leave out or free: skipped, with that reason."""

from __future__ import annotations

import pytest
import torch
from models import one_torch_thread, tiny_model

import ds_hilore
from ds_hilore.runtime.memory import (
    _mallinfo2,
    in_use_bytes,
    mkl_buffer_bytes,
    release_blas_buffers,
)

MiB = 2**20

_one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(autouse=True)
def _mkl():
    if not release_blas_buffers():
        pytest.skip("this torch links no MKL: no GEMM buffers are kept to leave out or free")


def _malloc_in_use() -> int:
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


def _gemms_until_mkl_holds_buffers() -> None:
    """GEMMs of a few shapes until MKL holds buffers (it packs some of them on every CPU
    measured; which ones is its choice)."""
    for m, k, n in [(256, 256, 256), (64, 128, 128), (16, 128, 512), (512, 512, 512)]:
        for _ in range(4):
            torch.addmm(torch.randn(n), torch.randn(m, k), torch.randn(k, n))
            if mkl_buffer_bytes() > 0:
                return
    pytest.skip("MKL packed none of these GEMMs on this CPU: no buffers to leave out")


def test_mkl_buffers_are_left_out_of_a_cpu_reading_and_handed_back_on_release():
    release_blas_buffers()
    assert mkl_buffer_bytes() == 0
    malloc_before, before = _malloc_in_use(), in_use_bytes("cpu")
    _gemms_until_mkl_holds_buffers()
    held = mkl_buffer_bytes()
    assert held >= MiB  # MKL's GEMM buffers are MiBs
    assert _malloc_in_use() - malloc_before >= held - MiB // 4  # malloc'd: glibc counts them
    assert abs(in_use_bytes("cpu") - before) < MiB // 4  # the reading does not
    release_blas_buffers()
    assert mkl_buffer_bytes() == 0
    assert _malloc_in_use() - malloc_before < MiB // 4  # handed back, not only left out


def test_attach_hands_back_the_buffers_of_its_probe():
    model = tiny_model("qwen2", layers=2, hidden=128, intermediate=512, dropout=False)
    _gemms_until_mkl_holds_buffers()  # held before: the release after the probe frees them
    runtime = ds_hilore.attach(model, {"memory_budget": 1.1})
    try:
        assert runtime.units_known()  # the probe ran: every layer's units found at attach
        assert mkl_buffer_bytes() == 0
    finally:
        runtime.detach()
