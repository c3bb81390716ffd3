"""Peak-memory meters: the one way ds_hilore measures memory.

* ``in_use_bytes(device)`` -- bytes allocated now. CUDA: ``torch.cuda.memory_allocated``.
  CPU: glibc's ``mallinfo2()``, in-use = ``uordblks + hblkhd`` (heap chunks in use plus
  mmapped chunks), which is where torch's CPU allocator gets its memory, less the GEMM buffers
  MKL keeps (NOTE [ MKL's buffers ]).
* ``PeakMeter`` -- the peak of ``in_use_bytes`` over a ``with`` block, forward and backward.
* ``PeakTracker`` -- CPU: the same reading over a window opened and closed by calls (from a
  forward to past its backward), which can freeze its peak, pause, and leave bytes out
  (NOTE [ Tracked windows ]).
* ``DevicePeak`` -- CUDA: the peak of allocated (and reserved) bytes over a window, read
  without resetting the device's peak counters (NOTE [ Shared peak counters ]).
* ``live_storage_bytes(tensors)`` -- exact bytes held by a set of tensors (shared storage once).
* ``LiveStorages`` -- storages allocated by aten ops inside a ``with`` block; ``live_bytes()``
  counts those still alive, exactly (no allocator noise): what a method *retains*.
* ``release_blas_buffers()`` -- hands back the GEMM buffers MKL keeps; CPU readings leave them
  out (NOTE [ MKL's buffers ]).

Example::

    with PeakMeter() as meter:
        model(x).sum().backward()
    print(meter.peak_delta)  # bytes above what was in use at the start
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
import threading
import time
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_hilore._errors import HiLoReError, bug

__all__ = ["DevicePeak", "LiveStorages", "PeakMeter", "PeakTracker", "in_use_bytes",
           "live_storage_bytes", "mkl_buffer_bytes", "release_blas_buffers"]


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
    return _heap_in_use() - mkl_buffer_bytes()  # NOTE [ MKL's buffers ]


def _heap_in_use() -> int:
    """CPU: bytes in heap chunks in use plus in mmapped chunks, MKL's buffers included."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


# NOTE [ MKL's buffers ]
# MKL, which torch's x86 CPU builds link, keeps the buffers a GEMM copies its operands into,
# per thread, from the first GEMM that copies until the process ends or they are freed (4-15
# MiB measured). Whether a GEMM copies is MKL's choice, by shape and by where its operands
# lie in memory, so whether a process holds them, and from which op on, is chance: the
# attach-time probe's 16-row GEMMs left 8.4 MiB in each rank of the demo, which that run's GC
# never held, and a relative budget read in that process (a multiple of GC's peak) was that
# much above the user's GC run: peaks of 1.122x its GC run's at memory_budget 1.10 (1.04x
# with them left out; in the next run GC's own ranks held 9 MiB of them). In the tests,
# buffers that appeared in one window and not in another moved a reading by up to 15 MiB.
# So CPU readings leave out what MKL's allocator says it holds (``mkl_serv_mem_stat``, behind
# MKL's ``mkl_mem_stat``), as CUDA's allocated bytes leave out the caching allocator's
# reserve: a cache of the library's, bounded per thread, not the training's memory. And the
# probe's buffers are handed back after it (``mkl_serv_free_buffers``, behind
# ``mkl_free_buffers``; on the training thread with no GEMM running, as MKL asks), so the
# process does not hold them for HiLoRe's sake. Both functions are exported by torch's CPU
# library where it links MKL; elsewhere nothing is left out or freed. MKL's count costs 13 us
# a call (a ``mallinfo2`` 2 us), so the readings taken after every op (``PeakMeter``,
# ``PeakTracker``: ``_LessMkl``) count again only when the heap has grown 1 MiB above where it
# was last counted: a buffer MKL allocates (4 MiB or more) is counted before any reading above
# the last count's heap, so a window's peak is at most 1 MiB high, never low, and a microbatch
# counts a few hundred times, not at every op.
class _Mkl:
    """MKL's memory functions in torch's CPU library (NOTE [ MKL's buffers ])."""

    def __init__(self, library: ctypes.CDLL):
        self._free, self._stat = library.mkl_serv_free_buffers, library.mkl_serv_mem_stat
        self._free.restype, self._free.argtypes = None, []
        self._stat.restype, self._stat.argtypes = ctypes.c_int64, [ctypes.POINTER(ctypes.c_int)]
        self._count = ctypes.c_int(0)
        self._count_ref = ctypes.byref(self._count)

    def held_bytes(self) -> int:
        return max(0, int(self._stat(self._count_ref)))

    def free(self) -> None:
        self._free()


@functools.cache
def _mkl() -> _Mkl | None:
    """MKL's memory functions, or None where torch links no MKL."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        return _Mkl(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                             "libtorch_cpu.so")))
    except (OSError, AttributeError):
        return None


def mkl_buffer_bytes() -> int:
    """Bytes MKL's allocator holds now (its GEMM buffers), 0 without MKL (NOTE [ MKL's
    buffers ])."""
    mkl = _mkl()
    return 0 if mkl is None else mkl.held_bytes()


def release_blas_buffers() -> bool:
    """Free the buffers MKL keeps (NOTE [ MKL's buffers ]); whether this torch links an MKL to
    ask. Call with no GEMM running in any thread."""
    mkl = _mkl()
    if mkl is None:
        return False
    mkl.free()
    return True


_MKL_RECOUNT_BYTES = 1 << 20  # NOTE [ MKL's buffers ]


class _LessMkl:
    """CPU readings, MKL's buffers left out, its count taken again only as the heap grows."""

    def __init__(self):
        self.heap = _heap_in_use()
        self.mkl = mkl_buffer_bytes()

    def __call__(self) -> int:
        heap = _heap_in_use()
        if heap > self.heap + _MKL_RECOUNT_BYTES:
            self.heap, self.mkl = heap, mkl_buffer_bytes()
        return heap - self.mkl


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
    """Samples the meter after every aten op run on this thread (backward included).

    torch.compile ignores this mode (NOTE [ Tracked windows ]): compiled code runs compiled
    under it, and the aten ops its graphs dispatch are sampled like any other."""

    def __init__(self, meter: PeakMeter | PeakTracker | None):
        super().__init__()
        self._meter = meter

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._meter is not None and not func.is_view:  # NOTE [ Read after ops that allocate ]
            self._meter.sample()
        return out


# NOTE [ Read after ops that allocate ]
# In-use bytes rise only where memory is allocated, and a view op (``view``, ``t``,
# ``detach``, ``transpose``, ``slice``, ``expand``: an output aliasing an input) allocates
# none: a reading after it repeats the one after the op before. About half of a decoder's
# aten ops are views (a forward and backward of a 4-layer Qwen2: 480 of 978), and a reading
# costs a ``mallinfo2``, which walks the heap's free chunks (2 us to over 100 us), so they are
# not read: a window's peak is the same, read at half the cost.


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

    CPU: a ``TorchDispatchMode`` reads ``mallinfo2()`` after every aten op on this thread
    that is not a view (NOTE [ Read after ops that allocate ]),
    forward and backward (the autograd engine runs CPU backward on the calling thread); the
    peak reached inside a single op (its private temporaries) is not seen. Nothing hooks
    modules or parameters, so frozen parameters (LoRA) are fine. torch.compile'd code runs
    compiled under it: the aten ops of its graphs are read, the private buffers of a fused
    (inductor) kernel are not (NOTE [ Tracked windows ]). Each reading costs a Python dispatch
    (~7 us) and a ``mallinfo2`` (2 us to over 100 us: it walks the heap's free chunks).
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
        self._reading: _LessMkl | None = None  # CPU (NOTE [ MKL's buffers ])
        self._mode: _SampleAfterEachOp | None = None

    @property
    def peak_delta(self) -> int:
        """Peak bytes above what was in use on entry."""
        return self.peak_bytes - self.start_bytes

    def sample(self) -> int:
        """Read memory now, fold it into the peak, and return the bytes in use."""
        if self.device.type == "cuda":
            now = in_use_bytes(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:  # NOTE [ MKL's buffers ]
            now = peak = self._reading() if self._reading is not None else in_use_bytes(self.device)
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
            self._reading = _LessMkl()
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


# NOTE [ Tracked windows ]
# An op-level reader on CPU is a ``TorchDispatchMode`` on the thread's dispatch-mode stack,
# and that stack is LIFO: a mode's ``__exit__`` pops whatever mode is on top. A window opened
# and closed by calls (the scheduler's: from a microbatch's forward to the next forward or the
# optimizer step, NOTE [ Tracked on CPU ] in plan/metering.py) outlives ``with`` blocks opened
# and closed inside it (a ``PeakMeter`` or a ``FlopCounterMode`` around one microbatch). So a
# ``PeakTracker`` puts its mode at the bottom of the stack -- every mode pushed before or after
# it is still the one its own exit pops -- and removes it from wherever it is. Both happen
# only outside a backward: the autograd engine gives the thread back the stack it had when
# the backward began, so a mode removed in the backward (an end-of-backward callback) comes
# back. Its peak can be frozen there instead (``freeze``), and the mode, which then only
# returns, is removed later: by its owner's ``close()``, or by the next tracker opened on the
# thread, which takes off every frozen one (a window whose owner went away without closing
# it does not stay on for good). Nothing is done either while an infra mode (fake tensors,
# proxy, functionalization: torch's own tracing) is on -- it shares the stack's bookkeeping -- or
# inside a torch.compile'd call (a compiled whole model calling a hook): its wrapper puts back
# the dispatch keys it began with when it returns, so a mode pushed there would go unread
# after it, and one removed there would leave torch dispatching to an empty stack.
# The mode is pushed without ``TorchDispatchMode.__enter__``, whose flags assume LIFO exits,
# and tells torch.compile to ignore it (``ignore_compile_internals``): a compiled frame called
# under a plain mode runs eagerly and, from then on, never compiled again (measured with torch
# 2.13) -- a window around a microbatch would un-compile the model's compiled parts for the
# rest of the run.

def _infra_modes_on() -> bool:
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(k) is not None for k in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


def _in_compiled_call() -> bool:
    """A torch.compile'd (or dynamo-disabled) call is on this thread's Python stack."""
    if "torch._dynamo.eval_frame" not in sys.modules:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_fn" and code.co_filename.endswith(_EVAL_FRAME):
            return True
        frame = frame.f_back
    return False


def _stack_can_change() -> bool:
    """NOTE [ Tracked windows ]: where a mode may be pushed or removed out of LIFO order."""
    return not (_in_backward() or _infra_modes_on() or _in_compiled_call())


def _push_at_bottom(mode: TorchDispatchMode) -> None:
    above = [torch._C._pop_torch_dispatch_stack(None) for _ in range(torch._C._len_torch_dispatch_stack())]
    torch._C._push_on_torch_dispatch_stack(mode)
    for other in reversed(above):  # popped top first
        torch._C._push_on_torch_dispatch_stack(other)


def _remove_mode(mode: TorchDispatchMode) -> None:
    above = []
    while torch._C._len_torch_dispatch_stack():
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_dispatch_stack(other)


_OPEN: list["PeakTracker"] = []  # trackers whose mode is on a thread's stack


class PeakTracker:
    """CPU: the peak of ``in_use_bytes`` over a window opened and closed by calls, read after
    every aten op on this thread as ``PeakMeter`` reads it (NOTE [ Tracked windows ]).

    ``open()`` and ``close()`` act only where the thread's mode stack may change (they return
    False otherwise: inside a backward, while torch traces, inside a compiled call);
    ``freeze()`` ends the peak where the window's work ends (e.g. an end-of-backward
    callback), the mode staying on until ``close()``; ``paused()`` keeps a block out of the
    readings (what is still held after it counts from the next op); ``exclude(n)`` leaves n
    bytes, held from now to the window's end, out of every later reading; ``restore(n)`` adds
    n bytes freed early to every later reading of ``bound_bytes`` (n < 0 takes them back), whose
    readings ``bound_paused()`` suspends: an upper bound of the peak of a run that would have
    kept them (NOTE [ A bound for a check in part ] in plan/checks.py).

    Attributes (bytes): ``start_bytes`` in use at ``open()``, ``peak_bytes`` the highest reading
    (less what was excluded), ``bound_bytes`` the highest reading plus what was restored
    before it, ``samples`` the number of readings; ``spent_s`` the seconds the
    readings took (a clock can leave them out); ``phase`` a label the caller sets (None at
    ``open()``) and ``phase_peaks`` the highest reading under each label, e.g. per layer's
    backward (NOTE [ The backward's memory, layer by layer ] in plan/profile.py).

    Example::

        tracker = PeakTracker()
        tracker.open()
        loss = model(x).sum()
        loss.backward()
        peak = tracker.freeze()
        tracker.close()
    """

    def __init__(self, device="cpu"):
        self.device = _device(device)
        if self.device.type != "cpu":
            raise bug(f"PeakTracker measures CPU memory, not {self.device}")
        self.start_bytes = self.peak_bytes = self.bound_bytes = 0
        self.restored = 0  # bytes added to every later reading of ``bound_bytes``
        self.samples = 0
        self.spent_s = 0.0
        self.frozen = False
        self.excluded = 0  # bytes left out of every reading
        self._reading: _LessMkl | None = None  # NOTE [ MKL's buffers ]
        self.phase = None
        self.phase_peaks: dict = {}
        self._paused = 0
        self._bound_paused = 0
        self._mode: _SampleAfterEachOp | None = None
        self._thread = threading.get_ident()

    @property
    def active(self) -> bool:
        """Its mode is on this thread's stack."""
        return self._mode is not None

    def open(self) -> bool:
        if self._mode is not None or not _stack_can_change():
            return False
        self._thread = threading.get_ident()
        for other in [t for t in _OPEN if t.frozen and t._thread == self._thread]:
            other.close()  # its reading is over: nothing needs its mode
        _warm_up_dispatch_modes()
        self._reading = _LessMkl()  # NOTE [ MKL's buffers ]
        self.start_bytes = self.peak_bytes = self.bound_bytes = self._reading()
        self.samples, self.spent_s, self.frozen, self.excluded = 0, 0.0, False, 0
        self.restored = 0
        self.phase, self.phase_peaks = None, {None: self.start_bytes}
        self._mode = _SampleAfterEachOp(self)
        _push_at_bottom(self._mode)
        _OPEN.append(self)
        return True

    def sample(self) -> None:
        if self._paused or self.frozen:
            return
        begin = time.perf_counter()
        reading = self._reading() - self.excluded
        self.peak_bytes = max(self.peak_bytes, reading)
        if not self._bound_paused:
            self.bound_bytes = max(self.bound_bytes, reading + self.restored)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), reading)
        self.samples += 1
        self.spent_s += time.perf_counter() - begin

    def freeze(self) -> int:
        """Read once more and keep the peak as it is from now on; returns it."""
        self.sample()
        self.frozen = True
        return self.peak_bytes

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.sample()
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def bound_paused(self) -> Iterator[None]:
        """Readings in the block count for ``peak_bytes``, not for ``bound_bytes``."""
        self._bound_paused += 1
        try:
            yield
        finally:
            self._bound_paused -= 1

    def exclude(self, nbytes: int) -> None:
        self.excluded += max(0, int(nbytes))

    def restore(self, nbytes: int) -> None:
        """``nbytes`` > 0: freed early, added to later readings of the bound; < 0: taken back
        (a run keeping them would have released them by now), or held only by this run."""
        if not self.frozen:
            self.restored += int(nbytes)

    def enter_phase(self, phase) -> None:
        """Readings from now on count under ``phase`` too (the last one's ends with a reading)."""
        if self.phase != phase and not self.frozen:
            self.sample()
            self.phase = phase
            self.sample()

    def close(self) -> bool:
        """Take the mode off this thread's stack; False (still on, frozen) where it cannot be."""
        if self._mode is None:
            return True
        self.frozen = True  # read no more
        if threading.get_ident() != self._thread or not _stack_can_change():
            return False  # taken off at a later close(), or by the next tracker opened
        _remove_mode(self._mode)
        self._mode = None
        _OPEN.remove(self)
        return True

    def __repr__(self) -> str:
        return f"PeakTracker(start={self.start_bytes}, peak={self.peak_bytes}, frozen={self.frozen})"


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
