"""Peak-memory meters: the one way ds_hilore measures memory.

* ``in_use_bytes(device)`` -- bytes allocated now. CUDA: ``torch.cuda.memory_allocated``.
  CPU: glibc's ``mallinfo2()``, in-use = ``uordblks + hblkhd`` (heap chunks in use plus
  mmapped chunks), which is where torch's CPU allocator gets its memory.
* ``PeakMeter`` -- the peak of ``in_use_bytes`` over a ``with`` block, forward and backward.
* ``DevicePeak`` -- CUDA: the peak of allocated (and reserved) bytes over a window, read
  without resetting the device's peak counters (NOTE [ Shared peak counters ]).
* ``live_storage_bytes(tensors)`` -- exact bytes held by a set of tensors (shared storage once).
* ``LiveStorages`` -- storages allocated by aten ops inside a ``with`` block; ``live_bytes()``
  counts those still alive, exactly (no allocator noise): what a method *retains*.

Example::

    with PeakMeter() as meter:
        model(x).sum().backward()
    print(meter.peak_delta)  # bytes above what was in use at the start
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_hilore._errors import HiLoReError, bug

__all__ = ["DevicePeak", "LiveStorages", "PeakMeter", "in_use_bytes", "live_storage_bytes"]


class _MallInfo2(ctypes.Structure):
    # struct mallinfo2 of glibc >= 2.33 (malloc.h); every field is a size_t.
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    try:
        fn = libc.mallinfo2
    except AttributeError:
        raise HiLoReError(
            "measuring CPU memory needs glibc >= 2.33 (its mallinfo2() counts the bytes torch's "
            "CPU allocator holds); this C library has none. Measure on a CUDA device, or run on "
            "a glibc-based Linux.") from None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


def _device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise HiLoReError(f"memory can be measured on 'cpu' and 'cuda' devices, not {device}.")
    return device


def in_use_bytes(device=None) -> int:
    """Bytes allocated now on ``device`` (None: the current CUDA device if any, else CPU).

    On CPU this counts every malloc of the process (torch and anything else), not only tensors.
    """
    device = _device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd  # bytes in heap chunks in use + in mmapped chunks


def live_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once).

    Counts whole storages: a small view of a big tensor keeps (and counts) all of it.
    """
    seen: set[tuple[torch.device, int]] = set()
    total = 0  # bytes
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class _SampleAfterEachOp(TorchDispatchMode):
    """Samples the meter after every aten op run on this thread (backward included)."""

    def __init__(self, meter: PeakMeter | None):
        super().__init__()
        self._meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._meter is not None:
            self._meter.sample()
        return out


@functools.cache
def _warm_up_dispatch_modes() -> None:
    # The first op ever run under a python dispatch mode imports ~800 modules (~25 MB of
    # malloc'ed Python objects); do it once outside any measurement.
    with _SampleAfterEachOp(None):
        torch.zeros(1)


# CUDA meters active now, outermost first: an inner meter resets the device's peak counter,
# so it first hands the peak reached so far to the meters around it.
_ACTIVE_CUDA_METERS: list[PeakMeter] = []


class PeakMeter:
    """The peak of ``in_use_bytes(device)`` while the ``with`` block runs.

    CPU: a ``TorchDispatchMode`` reads ``mallinfo2()`` after every aten op on this thread,
    forward and backward (the autograd engine runs CPU backward on the calling thread); the
    peak reached inside a single op (its private temporaries) is not seen. Nothing hooks
    modules or parameters, so frozen parameters (LoRA) are fine. torch.compile'd functions
    run eagerly while a dispatch mode is active, so compiled regions are measured as eager.
    CUDA: ``torch.cuda.max_memory_allocated`` (the meter resets the device's peak counter).

    Attributes (bytes): ``start_bytes`` in use on entry, ``peak_bytes`` the highest sample,
    ``end_bytes`` in use on exit, ``peak_delta`` = peak_bytes - start_bytes; ``samples`` the
    number of readings taken.
    """

    def __init__(self, device=None):
        self.device = _device(device)
        self.start_bytes = 0
        self.peak_bytes = 0
        self.end_bytes = 0
        self.samples = 0
        self._mode: _SampleAfterEachOp | None = None

    @property
    def peak_delta(self) -> int:
        """Peak bytes above what was in use on entry."""
        return self.peak_bytes - self.start_bytes

    def sample(self) -> int:
        """Read memory now, fold it into the peak, and return the bytes in use."""
        now = in_use_bytes(self.device)
        peak = now
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        self.peak_bytes = max(self.peak_bytes, peak)
        self.samples += 1
        return now

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            for outer in _ACTIVE_CUDA_METERS:
                if outer.device == self.device:
                    outer.sample()
            torch.cuda.reset_peak_memory_stats(self.device)
            _ACTIVE_CUDA_METERS.append(self)
        if self.device.type == "cpu":
            _warm_up_dispatch_modes()
        self.samples = 0
        self.start_bytes = self.peak_bytes = in_use_bytes(self.device)
        if self.device.type == "cpu":
            self._mode = _SampleAfterEachOp(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        self.end_bytes = self.sample()
        if self in _ACTIVE_CUDA_METERS:
            _ACTIVE_CUDA_METERS.remove(self)

    def __repr__(self) -> str:
        return (f"PeakMeter({self.device}, start={self.start_bytes}, peak={self.peak_bytes}, "
                f"peak_delta={self.peak_delta})")


# NOTE [ Shared peak counters ]
# CUDA keeps one peak counter per device (``max_memory_allocated`` / ``max_memory_reserved``)
# for the whole process: the training script, DeepSpeed's memory reports and any trainer read
# it, and ``reset_peak_memory_stats`` destroys every other reader's peak. A window is measured
# as an offset instead: the counter's value at its start is the earlier peak, ``prior``. If the
# counter ends above ``prior``, the window reached a new peak and the counter is exactly the
# window's peak. If it does not, the window stayed at or under an earlier peak: its own peak is
# then only known to lie between the highest in-use sample taken in the window and ``prior``;
# ``exact`` says which case held and callers choose the bound their use is safe with. A counter
# that ends below ``prior`` was reset by someone else inside the window: what it holds is a
# peak reached inside the window, a lower bound as well.

class DevicePeak:
    """CUDA: the peak of allocated and reserved bytes from construction to ``close()``, without
    resetting the device's peak counters (NOTE [ Shared peak counters ]).

    Attributes (bytes): ``start`` allocated at the start; ``prior`` / ``prior_reserved`` the
    counters at the start; after ``close()``: ``peak`` and ``reserved_peak`` (the window's,
    exact or a lower bound), ``exact`` and ``reserved_exact``, ``upper`` (``peak`` when exact,
    else ``prior``: what the window's peak is known not to exceed).
    """

    def __init__(self, device):
        self.device = _device(device)
        if self.device.type != "cuda":
            raise bug(f"DevicePeak measures CUDA devices, not {self.device}")
        cuda = torch.cuda
        self.start = cuda.memory_allocated(self.device)
        self.prior = cuda.max_memory_allocated(self.device)
        self.prior_reserved = cuda.max_memory_reserved(self.device)
        self.floor = self.start  # highest allocated bytes sampled in the window
        self.reserved_floor = cuda.memory_reserved(self.device)
        self.peak = self.reserved_peak = self.upper = None
        self.exact = self.reserved_exact = None
        _check_counters(self.start, self.prior, self.reserved_floor, self.prior_reserved)

    def sample(self) -> int:
        """Read allocated and reserved bytes now into the window's lower bounds; returns allocated."""
        now = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        self.floor = max(self.floor, now)
        self.reserved_floor = max(self.reserved_floor, reserved)
        return now

    def close(self) -> int:
        """End the window; returns ``peak`` (see the class)."""
        now = self.sample()
        top = torch.cuda.max_memory_allocated(self.device)
        top_reserved = torch.cuda.max_memory_reserved(self.device)
        _check_counters(now, top, torch.cuda.memory_reserved(self.device), top_reserved)
        self.exact = top > self.prior
        # not exact: the counter either still holds the earlier peak (no news) or was reset
        # inside the window by someone else (a peak reached in the window)
        self.peak = top if self.exact else max(self.floor, top) if top < self.prior else self.floor
        self.upper = top if self.exact else max(self.prior, top)
        self.reserved_exact = top_reserved > self.prior_reserved
        self.reserved_peak = top_reserved if self.reserved_exact else max(self.reserved_floor, top_reserved) \
            if top_reserved < self.prior_reserved else self.reserved_floor
        return self.peak


def _check_counters(allocated: int, peak: int, reserved: int, reserved_peak: int) -> None:
    # CUDA's caching allocator guarantees allocated <= its peak and allocated <= reserved;
    # a reading against that means the counters are not what this module takes them to be
    if not (0 <= allocated <= peak and allocated <= reserved <= reserved_peak):
        raise bug(f"CUDA memory counters disagree: allocated {allocated}, peak {peak}, "
                  f"reserved {reserved}, reserved peak {reserved_peak}")


class _RecordAllocations(TorchDispatchMode):
    def __init__(self, tracker: "LiveStorages"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_flatten
        inputs = {t.untyped_storage().data_ptr() for t in flat((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in flat(out)[0]:  # new allocations only: a view aliases an input's storage
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.tracker._add(t)
        return out


class LiveStorages:
    """Storages allocated by aten ops while active; ``live()`` lists those still alive.

    Exact: a storage counts while any tensor, saved variable or packed payload keeps it,
    once however many views share it. Used to compare what methods retain after a forward
    (e.g. HiLoRe all-R against gradient checkpointing: equal to the byte).

    Example::

        with LiveStorages() as tracker:
            loss = model(x).loss
        retained = tracker.live_bytes()
    """

    def __init__(self):
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak_ref = StorageWeakRef
        self._mode = _RecordAllocations(self)
        self._refs: dict[int, tuple] = {}  # storage id -> (weak ref, bytes, shape, dtype)

    def _add(self, t: torch.Tensor) -> None:
        ref = self._weak_ref(t.untyped_storage())
        old = self._refs.get(ref.cdata)
        if old is None or old[0].expired():
            self._refs[ref.cdata] = (ref, t.untyped_storage().nbytes(), tuple(t.shape), t.dtype)

    def __enter__(self) -> "LiveStorages":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def live(self) -> list[tuple[int, tuple, torch.dtype]]:
        """(bytes, shape, dtype) of each live storage (of the op output that allocated it)."""
        return [(n, shape, dtype) for ref, n, shape, dtype in self._refs.values()
                if not ref.expired()]

    def live_bytes(self) -> int:
        return sum(n for n, _, _ in self.live())
