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
    PeakMeter,
    PeakTracker,
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
    """GEMMs of a few shapes until MKL holds a MiB of buffers or more (it packs some of them on
    every CPU measured; which ones, and how much it keeps, is its choice: 0.4 MiB after the
    small ones in a process where other tests had run GEMMs, MiBs after the largest)."""
    for m, k, n in [(256, 256, 256), (64, 128, 128), (16, 128, 512), (512, 512, 512)]:
        for _ in range(4):
            torch.addmm(torch.randn(n), torch.randn(m, k), torch.randn(k, n))
            if mkl_buffer_bytes() >= MiB:
                return
    if mkl_buffer_bytes() == 0:
        pytest.skip("MKL packed none of these GEMMs on this CPU: no buffers to leave out")


def test_mkl_buffers_are_left_out_of_a_cpu_reading_and_handed_back_on_release():
    release_blas_buffers()
    assert mkl_buffer_bytes() == 0
    malloc_before, before = _malloc_in_use(), in_use_bytes("cpu")
    _gemms_until_mkl_holds_buffers()
    held = mkl_buffer_bytes()
    slack = min(MiB // 4, held // 2)  # what the heap moves by besides MKL's buffers
    assert held > 0
    assert _malloc_in_use() - malloc_before >= held - slack  # malloc'd: glibc counts them
    assert abs(in_use_bytes("cpu") - before) < slack  # the reading does not
    release_blas_buffers()
    assert mkl_buffer_bytes() == 0
    assert _malloc_in_use() - malloc_before < slack  # handed back, not only left out


def test_op_level_meters_leave_out_the_buffers_mkl_held_as_their_window_opened():
    """``PeakMeter`` and ``PeakTracker`` read after every op; MKL's count is taken at their
    window's start and again as the heap grows, not at every reading."""
    _gemms_until_mkl_holds_buffers()
    if mkl_buffer_bytes() <= MiB // 4:  # a reading that held them must be off by more than that
        pytest.skip("MKL keeps a quarter MiB of buffers or less here: too little to tell a "
                    "reading that holds them from one that does not")
    x = torch.ones(MiB // 4)  # 1 MiB
    before_meter = in_use_bytes("cpu")
    with PeakMeter("cpu") as meter:
        y = x + 1  # 1 MiB more, read after the op
    before_tracker = in_use_bytes("cpu")
    tracker = PeakTracker("cpu")
    assert tracker.open()
    z = x * 2
    tracker.close()
    for before, start, peak in ((before_meter, meter.start_bytes, meter.peak_bytes),
                                (before_tracker, tracker.start_bytes, tracker.peak_bytes)):
        assert abs(start - before) < MiB // 4  # MKL's buffers left out, as in_use_bytes does
        assert MiB - MiB // 8 <= peak - start < 2 * MiB
    del y, z


def test_buffers_mkl_allocates_inside_a_window_are_left_out_as_soon_as_the_heap_grows():
    release_blas_buffers()
    with PeakMeter("cpu") as meter:
        _gemms_until_mkl_holds_buffers()  # 4 MiB or more appear inside the window
        kept = torch.ones(MiB // 2)  # 2 MiB, read after the op
        now = meter.sample()
        assert abs(now - in_use_bytes("cpu")) < MiB + MiB // 4  # within the recount's 1 MiB
    del kept


def test_attach_hands_back_the_buffers_of_its_probe():
    model = tiny_model("qwen2", layers=2, hidden=128, intermediate=512, dropout=False)
    _gemms_until_mkl_holds_buffers()  # held before: the release after the probe frees them
    runtime = ds_hilore.attach(model, {"memory_budget": 1.1})
    try:
        assert runtime.units_known()  # the probe ran: every layer's units found at attach
        assert mkl_buffer_bytes() == 0
    finally:
        runtime.detach()
