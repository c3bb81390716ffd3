"""Low-precision packing of saved activations: the "L" action of HiLoRe.

A codec turns a 2-D (N, G) float tensor (N tokens, G features) into a low-precision payload of
the same shape plus fp32 scales, and back. Every codec is one entry of ``CODECS``; adding one is
one entry plus one test.

Example::

    codec = get_codec("int8", backend="compile")
    packed = codec.pack(x)             # None if x holds NaN/inf: keep x in H
    y = codec.unpack(packed)           # same shape and dtype as x
    packed.rel_error, packed.nbytes    # ||x - y|| / ||x||, payload + scale bytes
    codec.pack_async(x, measure=False) # same payload, no error measured (NOTE [ Measured or not ])
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import shutil
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch._dynamo.decorators import mark_unbacked
from torch.fx.experimental import _config as fx_config

from ds_hilore._errors import HiLoReConfigError, bug
from ds_hilore.runtime import codec_ahead
from ds_hilore.runtime.memory import live_storage_bytes

__all__ = ["CODECS", "CODEC_BACKENDS", "Codec", "CodecSpec", "Packed", "build_ahead",
           "codec_from_config", "compile_unavailable", "compiled_graph_counts", "get_codec"]

logger = logging.getLogger(__name__)

CODEC_BACKENDS = ("eager", "compile")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric grid [-127, 127]: -128 is never produced by rounding
INT8_NEG_INF = -128  # ... so it stands for -inf (NOTE [ -inf in int8 ])
FP32_TINY = torch.finfo(torch.float32).tiny  # smallest normal fp32
UNMEASURED = -1.0  # Packed.stats[0] of a pack whose error was not measured (NOTE [ Measured or not ])
_EAGER_CHUNK_NUMEL = 1 << 18  # elements per eager chunk on a CPU: fp32 temporaries <= 1 MiB
_EAGER_CHUNK_NUMEL_ACCELERATOR = 1 << 24  # on other devices (NOTE [ Eager chunks ])


# NOTE [ Codec kernels ]
# Every format is written once, as a per-row kernel on a (R, B) tensor: amax over the row,
# scale = amax / qmax (1 for an all-zero row, so nothing divides by zero), quantise, and, in
# the same pass, the reconstruction error that Packed.rel_error reports. The same Python
# function is the eager backend and, under torch.compile, the compiled one (inductor fuses
# it into one C++ loop nest on CPU, Triton on GPU). Eager and compiled run the same IEEE ops
# (amax, a product by 1 / qmax, one true division, round-half-even, casts), so their payloads
# and scales agree bitwise; only the error sums differ in the last bits (summation order). On
# GPUs that needs inductor told to keep eager's numerics (IEEE division and subnormals in
# Triton, ``_Kernel._inductor``), and the scale written as the product inductor would make of
# a division by a constant there.
#
# Scaling granularity is a reshape, not another kernel: per-token scaling runs the row
# kernel on (N, G); per-block scaling runs it on the (N * G/b, b) view, so a contiguous
# block of b elements is one row. Only when b does not divide G does a second, "ragged"
# kernel gather each element's block scale (slower: inductor cannot vectorise the gather).
#
# Compiled once per input dtype, never per shape: torch.compile(dynamic=True) makes sizes
# symbolic from the first call, but dynamo and inductor still add shape guards that
# mark_dynamic does not remove: sizes 0 and 1 are specialised, a first call with N == G ties
# N to G (duck sizing), and an fp32 row sum longer than 4096 elements gets a guard (inductor's
# chunked-accumulation helper), which would split graphs by row length. So the encoders take
# their input with every size > 1 marked *unbacked* (no guards at all; the row sums are fp32
# in units of the row's scale, |terms| <= qmax^2, so they cannot overflow, and rows combine
# in fp64). The decoders keep backed sizes (with unbacked ones inductor cannot prove that
# `out` has the result's shape and writes through a temporary) and trace their first call
# per dtype without duck sizing. Autocast is switched off around compiled calls (its state
# is a guard). Sizes of exactly 1 would still be specialised (a graph of their own), so
# such inputs (one row, or one feature per row) run the eager kernel; so do inference-mode
# tensors (dynamo guards on their dispatch keys; HiLoRe itself never packs one).
# The encoders return amax, not the scale: storing the scale inside the kernel makes
# inductor split its single loop over rows (amax, then quantise + measure, a row staying
# in cache) into separate passes over x.
#
# NOTE [ Size hints of unbacked sizes ]
# Inductor fuses two loops only when it finds that they share data, counted in bytes from
# the sizes' hints; an unbacked size has no hint, so every shared buffer counts 0 bytes and
# nothing fuses: the encoder became four passes over x (amax, error sums, norm sums, payload),
# each streaming the whole tensor from memory once it is larger than the cache. The marks
# therefore carry a fixed hint per dimension (``_UNBACKED_HINTS``, a typical activation: 4096
# rows of 1024 features): with it the amax, both sums and the payload of a row are computed in
# one loop over rows while the row is in cache, and only the two fp64 totals take a second,
# short loop over the row sums. A hint is used for heuristics only (never as a guard: the
# kernel stays correct for every size), and a fixed one keeps inductor's cache key fixed.
# int8 encode on a 2-core Xeon, fp32: 8192 x 1024 21 -> 10 ms, 64 x 256 0.20 -> 0.12 ms
# (fewer parallel regions).
#
# Eager is used for backend="eager", when compilation is unavailable or failed (said once per
# kernel, with the reason, never fatal: ``compile_unavailable``, ``_Kernel.compiled``), and
# whenever a TorchDispatchMode is active (e.g. memory.PeakMeter): dynamo then runs compiled
# functions eagerly anyway. It runs in row chunks (NOTE [ Eager chunks ]).
#
# NOTE [ -inf in int8 ]
# Some saved tensors hold -inf by design: given a padding mask, SDPA converts it to an additive
# (B, 1, T, T) mask of 0 and -inf and saves that. Packed like any tensor, its per-row scale
# would be inf and the run non-finite, and the whole unit would go to R after paying the pack
# (NOTE [ Non-finite tensors ] in plan/profile.py): with padding, attention -- the unit most
# expensive to recompute -- could never be L. The int8 grid is symmetric, [-127, 127], so the
# payload -128 is free: the encoder stores -inf as -128 and measures the row's scale and error
# on its other values (-inf counted as 0 in both), the decoder turns -128 back into -inf.
# -inf survives exactly (a mask of 0 and -inf packs without error: 0 is exact too). NaN and +inf
# still make the run non-finite (they reach amax and the stats). fp8 e4m3 is left as it was:
# there -inf still sends the unit to R.
# The sentinel is nearly free in the compiled kernels only as written: the encoder picks it on
# the rounded fp32 grid and casts once, the decoder compares the payload after its cast to
# fp32. A torch.where on the int8 payload, or on a -inf mask of x kept to the end, splits
# inductor's loop over a row into several passes over x (fp32 8192 x 1024 on a 2-core Xeon:
# encode 43 ms against 11 ms without the sentinel, decode 6.8 against 3.0 ms; written this
# way, 12 and 3.0 ms).
#
# NOTE [ Eager chunks ]
# Unchunked, the eager kernel allocates several full-size fp32 temporaries that the compiled
# kernel never has; chunked, it pays a few kernel launches per chunk. The right chunk depends on
# the device. On a CPU the launches cost microseconds and a chunk that stays in cache is much
# faster than one pass over the tensor (int8 encode of 8192 x 1024 bf16, one thread: 31 ms in
# 2^18-element chunks, 660 ms in one call), so chunks are 2^18 elements (fp32 temporaries
# <= 1 MiB) -- also under a dispatch mode on any device, where a peak is being measured. On an
# accelerator 2^18-element chunks are launch-bound (a few microseconds of work per launch),
# so chunks are 2^24 elements: the launches are a small part of a pass over 64 MiB, a typical
# activation takes a handful of chunks, and the temporaries stay bounded (<= 64 MiB each).
#
# NOTE [ Measured or not ]
# Measuring the error costs as much as packing: on a 2-core Xeon the int8 encoder with the error
# sums ran at 3.1-3.5 GB/s of fp32 input, without them at 5.2-6.2 GB/s (64 MiB, compiled; the
# machine reads memory at 21 GB/s, so both are bound by the loop's arithmetic, not by memory).
# The error of a unit's tensors is what the planner needs, and the profile measures it
# (plan/profile.py); a training microbatch needs only the payload and whether x was finite.
# So int8 has a second encoder, ``_int8_encode_fast``: the same payload and scales, bitwise (the
# same ops up to the cast), and stats = (UNMEASURED, sum of the rows' amax^2 in fp64), whose
# second entry is NaN or inf exactly when x holds NaN or +inf -- the finiteness check reads it as
# it reads ||x||^2 (-inf is carried, as in the measured encoder). ``pack_async(x, measure=False)``
# uses it; ``Packed.rel_error`` of such a pack is None, never a made-up 0. The runtime measures
# one microbatch in ``codec_error_interval`` (config; runtime/microbatch.py), so its stats still
# report the codec's error on the training data. fp8 has no fast encoder: it always measures.


@dataclass(frozen=True)
class Packed:
    """A tensor stored in low precision. Immutable; ``Codec.unpack`` restores it."""

    codec: str  # name in CODECS
    shape: tuple[int, int]  # (N, G) of the original tensor
    dtype: torch.dtype  # of the original tensor
    block_size: int  # elements per scale along a row (G for per-token scaling)
    payload: torch.Tensor  # (N, G) int8 | float8_e4m3fn
    scales: torch.Tensor  # (N, ceil(G / block_size)) fp32
    nbytes: int  # bytes of payload + scales + stats storages
    stats: torch.Tensor  # (2,) fp64 on x's device: ||x - unpack(pack(x))||^2, ||x||^2
    # (or UNMEASURED, sum of row amax^2: NOTE [ Measured or not ])
    measured: bool = True  # stats hold the error

    @property
    def rel_error(self) -> float | None:
        """||x - unpack(pack(x))||_2 / ||x||_2, measured at pack; 0 for x == 0; None when the
        pack did not measure it. Reads the device (a host synchronisation): the runtime reads
        it once per step, for stats."""
        return relative_errors([self.stats])[0] if self.measured else None

    @property
    def finite(self) -> torch.Tensor:
        """() bool on the device: x held no NaN or inf (checked without a synchronisation)."""
        return torch.isfinite(self.stats[1])


def relative_errors(stats: list[torch.Tensor]) -> list[float | None]:
    """Relative errors of packed tensors from their ``stats``, read from the device at once:
    0 for an all-zero tensor, NaN for a non-finite one (never 0: it was not packed faithfully),
    None for a pack that did not measure it (NOTE [ Measured or not ])."""
    if not stats:
        return []
    return [None if e < 0 else math.sqrt(e / n) if n > 0 else 0.0 if n == 0 else math.nan
            for e, n in torch.stack(stats).tolist()]


_FAILED = object()  # what _Kernel.compiled returns when compilation failed


class _Kernel:
    """One codec kernel: the plain function (eager) and its lazily compiled twin.

    ``unbacked``: compile with every size > 1 of the tensor arguments marked unbacked (the
    encoders: see the NOTE). Otherwise sizes are ordinary dynamic sizes, traced once per
    dtype without duck sizing (the decoders: unbacked sizes would make inductor write the
    result to a temporary and copy it into ``out``).
    """

    def __init__(self, fn: Callable, *, unbacked: bool):
        self.fn = fn
        self.unbacked = unbacked
        self.graphs = 0  # graphs compiled so far (expected: one per input dtype)
        self.failure: str | None = None  # why compilation failed; eager from then on
        self._compiled: Callable | None = None
        self._traced: set[tuple[torch.dtype, ...]] = set()  # argument dtypes traced so far
        # argument dtypes -> the kernel built ahead for them (NOTE [ Codec kernels built ahead ]
        # in codec_ahead.py), loaded by ``Codec.warmup``, or at their first call for dtypes it
        # did not warm (looked for once); CPU tensors only
        self.ahead: dict[tuple[torch.dtype, ...], Callable] = {}
        self._looked: set[tuple[torch.dtype, ...]] = set()
        self._buildable = codec_ahead.signature(fn.__name__)  # once: read at every call

    @property
    def name(self) -> str:
        return self.fn.__name__

    def _inductor(self, gm, example_inputs):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # Keep the bf16/fp16 rounding of x_hat: rel_error must measure what unpack returns.
        # On GPUs, Triton's division is IEEE-rounded and subnormals kept only with
        # eager_numerics (where this torch has it): the payload then is eager's, bit for bit.
        known = inductor_config.get_config_copy()
        exact = {k: True for k in ("eager_numerics.division_rounding",
                                   "eager_numerics.disable_ftz") if k in known}
        with inductor_config.patch(emulate_precision_casts=True, **exact):
            compiled = compile_fx(gm, example_inputs)
        self.graphs += 1  # counted on success: dynamo may abort a first attempt and restart
        return compiled

    def compiled(self, *args):
        """Run the compiled kernel; _FAILED if it cannot be compiled (then use ``fn``)."""
        device_type = args[0].device.type
        if device_type == "cpu" and self._buildable:  # every argument a tensor
            key = tuple(a.dtype for a in args)
            if key not in self.ahead and key not in self._looked:
                self._looked.add(key)
                codec_ahead.load_key(self, key, INPUT_DTYPES)
            built = self.ahead.get(key)
            if built is not None and all(a.is_contiguous() for a in args):
                try:
                    return built(list(args))
                except Exception as exc:  # noqa: BLE001 -- compiled at run time from now on
                    del self.ahead[key]
                    self._looked.add(key)  # not loaded again
                    logger.warning("ds_hilore: the codec kernel %s built ahead failed (%s); it "
                                   "is compiled at run time from now on.", self.name,
                                   (str(exc).splitlines() or ["?"])[0])
        if self._compiled is None:
            reason = compile_unavailable(device_type)
            if reason is not None:
                return self._fail(reason)
            self._compiled = torch.compile(self.fn, dynamic=True, fullgraph=True,
                                           backend=self._inductor)
        try:
            if torch.is_autocast_enabled(device_type):  # a guard: one graph per dtype
                with torch.autocast(device_type, enabled=False):
                    result = self._call(args)
            else:
                result = self._call(args)
        except torch.OutOfMemoryError:
            raise  # not a compiler failure: the eager kernel would run out of memory too
        except Exception as exc:  # noqa: BLE001 -- any compiler failure: fall back, never crash
            root = exc  # dynamo wraps the compiler's own error: report that one
            while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
                root = inner
            return self._fail((f"{type(root).__name__}: {root}".splitlines() or ["?"])[0])
        if self.graphs == 0:  # dynamo ran the Python function itself: nothing was compiled
            return self._fail("torch.compile ran it without compiling (torch.compiler.set_stance"
                              "('force_eager'), TORCHDYNAMO_DISABLE, or a suppressed compiler error)")
        return result

    def _fail(self, reason: str):
        """Eager from now on, said once with the reason (the planner then prices L with the
        eager codec's measured costs)."""
        self.failure = reason
        logger.warning("ds_hilore: torch.compile of codec kernel %s failed (%s); using its "
                       "eager version from now on (same results, slower: L may then not pay). "
                       "Set codec_backend to 'eager' to skip the attempt.", self.name, reason)
        return _FAILED

    def _call(self, args: tuple):
        args = _aliases(args, self.unbacked)
        if self.unbacked:
            return self._compiled(*args)
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        if dtypes in self._traced:
            return self._compiled(*args)
        with fx_config.patch(use_duck_shape=False):  # a first N == G must not tie N to G
            result = self._compiled(*args)
        self._traced.add(dtypes)
        return result


@functools.lru_cache(maxsize=None)
def compile_unavailable(device_type: str) -> str | None:
    """Why codec_backend 'compile' cannot work for tensors on ``device_type`` here, or None:
    inductor needs a C++ compiler for CPU kernels and Triton for GPU kernels."""
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        try:
            compiler = cpp_builder.get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 -- the probe's own failure is the reason
            return f"inductor finds no C++ compiler ({exc})"
        if shutil.which(compiler) is None:
            return f"inductor's C++ compiler {compiler!r} is not on PATH"
        return None
    if device_type in ("cuda", "xpu"):
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (inductor needs it on GPUs)"
    return None


# (rows, features) hints of unbacked sizes (NOTE [ Size hints of unbacked sizes ]); a torch
# whose mark_unbacked takes no hint compiles the same kernels without them (slower, as exact)
_UNBACKED_HINTS = (4096, 1024)
_HINT_KWARGS = (tuple({"hint_override": h} for h in _UNBACKED_HINTS)
                if "hint_override" in inspect.signature(mark_unbacked).parameters else ({}, {}))


def _aliases(args: tuple, unbacked: bool) -> list:
    """Tensor arguments as fresh detached aliases (same storage), sizes marked if ``unbacked``.

    Fresh: a view would make dynamo guard on its base (and recompile when the base changes),
    and marks set on the alias never leak to the caller's tensor. Each dimension is marked on
    its own: given a list of dimensions, ``mark_unbacked`` drops ``hint_override``.
    """
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.detach()
            if unbacked:
                for dim in range(a.dim()):
                    mark_unbacked(a, dim, **_HINT_KWARGS[min(dim, 1)])
        out.append(a)
    return out


# ---- kernels (see NOTE [ Codec kernels ]) -----------------------------------------------

def _safe_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # a product, not amax / qmax: inductor turns a division by a constant into this product on
    # GPUs (not on CPU), so eager and compiled kernels compute the same scale on every device
    scale = amax * (1.0 / qmax)  # fp32
    return torch.where(scale > 0, scale, 1.0)  # all-zero (or all-subnormal) rows: scale 1


def _quantise_and_measure(x, xf, scale, unit, to_grid):
    """Payload, plus stats = (||x - x_hat||^2, ||x||^2) as fp64 (2,) (``_measure``)."""
    q = to_grid(xf / scale)  # (R, B) payload dtype
    return q, _measure(x, xf, q.float(), scale, unit)  # a fresh grid: _measure may overwrite it


def _measure(x, xf, grid, scale, unit):
    """stats = (||x - x_hat||^2, ||x||^2) as fp64 (2,), x_hat = grid * scale (grid: the payload
    as fp32, overwritten by x_hat: one full-size temporary fewer in the eager kernel).

    ``unit`` (R, 1) is a per-row length in which errors are summed: with unit >= the row's
    scale, every term is <= qmax^2, so fp32 row sums cannot overflow; the fp64 total then
    cannot either. ||x||^2 is NaN or inf exactly when x holds NaN or inf.
    """
    x_hat = grid.mul_(scale).to(x.dtype).float()  # (R, B) exactly what unpack returns
    inv = 1.0 / unit  # (R, 1)
    err = ((xf - x_hat) * inv).square().sum(dim=1, keepdim=True)  # (R, 1) in unit^2
    norm = (xf * inv).square().sum(dim=1, keepdim=True)  # (R, 1) in unit^2
    unit2 = unit.double().square()  # (R, 1)
    return torch.stack([(err.double() * unit2).sum(), (norm.double() * unit2).sum()])


def _fp8_grid(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # cast rounds RNE


def _encode_rows(x: torch.Tensor, qmax: float, to_grid) -> tuple:
    xf = x.float()  # (R, B) fp32
    amax = xf.abs().amax(dim=1, keepdim=True)  # (R, 1)
    scale = _safe_scale(amax, qmax)  # (R, 1) fp32
    unit = scale.clamp(min=FP32_TINY)  # (R, 1): 1 / unit stays finite
    q, stats = _quantise_and_measure(x, xf, scale, unit, to_grid)
    # amax, not scale: storing scale here would split inductor's single loop over rows
    return q, amax, stats


def _int8_rows(xf):
    """The int8 encoders' shared first half on xf (R, B) fp32: (xf with -inf as 0, amax,
    scale, the unclamped grid round(xf / scale)). NaN and +inf stay: amax and the stats show
    them."""
    finite_part = torch.where(xf == -math.inf, 0.0, xf)  # (R, B) fp32
    amax = finite_part.abs().amax(dim=1, keepdim=True)  # (R, 1)
    scale = _safe_scale(amax, INT8_MAX)  # (R, 1) fp32
    return finite_part, amax, scale, torch.round(xf / scale)  # round half to even


def _int8_payload_grid(grid):
    """The grid on [-127, 127], -inf as the sentinel -128 (NOTE [ -inf in int8 ]); still fp32."""
    return torch.where(grid == -math.inf, INT8_NEG_INF, grid.clamp(-INT8_MAX, INT8_MAX))


def _int8_encode(x):
    # NOTE [ -inf in int8 ]: -inf is carried exactly, as the payload INT8_NEG_INF
    # one name per (R, B) fp32 temporary, updated in place where it can be: the eager kernel
    # then holds no more of them at once than it did without the sentinel (NOTE [ Eager chunks ])
    finite_part, amax, scale, grid = _int8_rows(x.float())
    grid = _int8_payload_grid(grid)
    q = grid.to(torch.int8)
    grid.masked_fill_(grid < -INT8_MAX, 0.0)  # -inf counted as 0, as in finite_part
    return q, amax, _measure(x, finite_part, grid, scale, scale.clamp(min=FP32_TINY))


def _int8_encode_fast(x):
    # _int8_encode's payload and amax by the same ops, no error sums (NOTE [ Measured or not ])
    _, amax, _, grid = _int8_rows(x.float())
    q = _int8_payload_grid(grid).to(torch.int8)
    finite = amax.double().square().sum()  # NaN or inf exactly when x holds NaN or +inf
    return q, amax, torch.stack([torch.full_like(finite, UNMEASURED), finite])


def _fp8_encode(x):
    return _encode_rows(x, FP8_E4M3_MAX, _fp8_grid)


def _fp8_encode_ragged(x, block_size: int):
    n, g = x.shape
    n_blocks = (g + block_size - 1) // block_size
    xf = x.float()  # (N, G) fp32
    padded = F.pad(xf.abs(), (0, n_blocks * block_size - g))  # (N, nb * b)
    amax = padded.view(n, n_blocks, block_size).amax(dim=2)  # (N, nb)
    scale = _safe_scale(amax, FP8_E4M3_MAX)  # (N, nb)
    per_element = scale[:, torch.arange(g, device=x.device) // block_size]  # (N, G)
    unit = scale.amax(dim=1, keepdim=True).clamp(min=FP32_TINY)  # (N, 1)
    q, stats = _quantise_and_measure(x, xf, per_element, unit, _fp8_grid)
    return q, amax, stats


def _int8_scaled(grid, scale):
    """grid (R, B) fp32 integers * scale (R, 1), the sentinel back to -inf (NOTE [ -inf in int8 ]);
    compared as fp32: an int8 compare splits the vectorised loop."""
    return torch.where(grid < -INT8_MAX, -math.inf, grid * scale)


def _int8_decode_into(q, scale, out):
    out.copy_(_int8_scaled(q.float(), scale))  # cast to out.dtype


def _int8_rescale(out, scale):
    # out: the payload cast to out.dtype (exact); scaled in place (NOTE [ int8 loads on a CPU ])
    out.copy_(_int8_scaled(out.float(), scale))


# As _int8_decode_into's body without the sentinel, but its own code object: dynamo caches
# graphs per code object, at most 8 (recompile_limit); one shared decoder would hold 2 payloads
# x 3 dtypes.
def _fp8_decode_into(q, scale, out):
    out.copy_(q.float() * scale)  # (R, B) * (R, 1), cast to out.dtype


def _fp8_decode_ragged_into(q, scale, out, block_size: int):
    per_element = scale[:, torch.arange(q.shape[1], device=q.device) // block_size]  # (N, G)
    out.copy_(q.float() * per_element)


# ---- the registry ---------------------------------------------------------------------------

# NOTE [ int8 loads on a CPU ]
# On a CPU whose widest vectors are AVX2 (an AMD EPYC of 2021, say), inductor vectorises the
# fused decoder's loop at 8 lanes of fp32 and loads the int8 payload 8 bytes at a time, a
# partial load of a 32-byte vector that ATen's AVX2 code does through memcpy into a zeroed
# buffer: the decoder ran at 5 GB/s of fp32 output, ten times slower than ATen's own int8 ->
# fp32 cast of the same payload (2048 x 1024: 1.7 ms against 0.2 ms). So on a CPU int8 decodes
# in two passes that both run at full width on every ISA: ATen casts the payload into ``out``
# (exact: |q| <= 128 is an integer of fp32, bf16 and fp16 alike), then a float-only kernel,
# ``_int8_rescale``, multiplies ``out`` by the row scales in place and turns -128 back into
# -inf (NOTE [ -inf in int8 ]). The values are bitwise the fused decoder's (the same fp32
# product of the same integer and scale, one cast to out.dtype; tested): 1.7 -> 0.4 ms for
# that tensor on the EPYC, in cache, the kernels alone (0.6 ms through ``Codec.unpack``, whose
# compiled call adds about 0.1 ms per kernel). Accelerators keep the fused decoder, one pass
# over the payload (Triton loads int8 at full width). Only the decoder: the encoders read fp32
# at full width and store the int8 payload once per row; ATen casting an fp32 grid instead ran
# no faster.


@dataclass(frozen=True)
class CodecSpec:
    """One low-precision format: payload type, kernels and the options it accepts."""

    payload_dtype: torch.dtype
    qmax: float  # largest payload magnitude: scale = amax * (1 / qmax)
    encode: _Kernel  # (R, B) rows -> (payload (R, B), amax (R, 1), (err^2, norm^2) fp64)
    decode: _Kernel  # (payload, scales, out) -> None, writes out
    summary: str
    options: Mapping[str, Any] = field(default_factory=dict)  # keyword -> default
    encode_ragged: _Kernel | None = None  # per-block amax (N, nb) when block_size does not divide G
    decode_ragged: _Kernel | None = None
    encode_fast: _Kernel | None = None  # encode's payload and amax, the error not measured
    # (out holding the payload cast to out.dtype, scales) -> None, rescales out in place: how a
    # CPU decodes (NOTE [ int8 loads on a CPU ]); None: ``decode`` everywhere
    rescale: _Kernel | None = None

    def kernels(self) -> tuple[_Kernel, ...]:
        """Every kernel of the format (what compiles, what can fall back)."""
        return tuple(k for k in (self.encode, self.encode_fast, self.encode_ragged, self.decode,
                                 self.rescale, self.decode_ragged) if k is not None)


CODECS: Mapping[str, CodecSpec] = MappingProxyType({
    "int8": CodecSpec(
        payload_dtype=torch.int8, qmax=INT8_MAX,
        encode=_Kernel(_int8_encode, unbacked=True),
        decode=_Kernel(_int8_decode_into, unbacked=False),
        encode_fast=_Kernel(_int8_encode_fast, unbacked=True),
        rescale=_Kernel(_int8_rescale, unbacked=False),
        summary="symmetric int8, one absmax scale per token (row), round to nearest"),
    "fp8_e4m3": CodecSpec(
        payload_dtype=torch.float8_e4m3fn, qmax=FP8_E4M3_MAX,
        encode=_Kernel(_fp8_encode, unbacked=True),
        decode=_Kernel(_fp8_decode_into, unbacked=False),
        encode_ragged=_Kernel(_fp8_encode_ragged, unbacked=True),
        decode_ragged=_Kernel(_fp8_decode_ragged_into, unbacked=False),
        options={"fp8_scaling": "token", "fp8_block_size": 128},
        summary="float8 e4m3fn, absmax scale mapped to 448 per token or per block of a row"),
})


def compile_failures() -> dict[str, str]:
    """Codec kernel -> why its torch.compile failed (it runs eager since), over every format."""
    return {kernel.name: kernel.failure for spec in CODECS.values() for kernel in spec.kernels()
            if kernel.failure is not None}

# option (named as its config key) -> (config key, check, what is allowed)
_OPTION_RULES: Mapping[str, tuple[str, Callable[[Any], bool], str]] = MappingProxyType({
    "fp8_scaling": ("fp8_scaling", lambda v: v in ("token", "block"), "'token' or 'block'"),
    "fp8_block_size": ("fp8_block_size", lambda v: isinstance(v, int) and not isinstance(v, bool)
                       and v > 0, "a positive integer"),
})


def build_ahead(codec_names, dtypes, say=print) -> list:
    """Build the CPU kernels of the codecs ``codec_names`` for activation ``dtypes`` ahead, once
    per machine (NOTE [ Codec kernels built ahead ] in codec_ahead.py); the packages there."""
    kernels = [k for name in codec_names for k in CODECS[name].kernels()]
    return codec_ahead.build_all(kernels, dtypes, say, compile_unavailable("cpu"))


def compiled_graph_counts() -> dict[str, int]:
    """Graphs compiled so far per kernel (one per input dtype is the expected steady state)."""
    return {k.name: k.graphs for spec in CODECS.values() for k in spec.kernels()}


def get_codec(name: str, backend: str = "eager", **options) -> "Codec":
    """The codec ``name`` of ``CODECS`` running on ``backend``.

    Args:
        name: ``"int8"`` or ``"fp8_e4m3"`` (config key ``low_precision``).
        backend: ``"eager"`` or ``"compile"`` (config key ``codec_backend``).
        options: the codec's options, named as their config keys, e.g.
            ``fp8_scaling="block", fp8_block_size=128`` for fp8_e4m3.

    Raises:
        HiLoReConfigError: unknown name, backend or option, or an invalid option value.
    """
    if name not in CODECS:
        known = ", ".join(repr(k) for k in CODECS)
        raise HiLoReConfigError(
            f"hilore.low_precision = {name!r} is not a known codec; known codecs: {known} "
            "(or 'none' to disable the L action). Fix: set \"low_precision\" in the \"hilore\" "
            "block to one of them.")
    if backend not in CODEC_BACKENDS:
        raise HiLoReConfigError(
            f"hilore.codec_backend = {backend!r} is not a known codec backend; known backends: "
            f"{', '.join(repr(b) for b in CODEC_BACKENDS)}. Fix: set \"codec_backend\" to one.")
    spec = CODECS[name]
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        accepted = ", ".join(spec.options) or "none"
        raise HiLoReConfigError(f"codec {name!r} takes no option(s) {unknown}; it accepts: "
                                f"{accepted}.")
    chosen = {**spec.options, **options}
    for key, value in chosen.items():
        config_key, ok, allowed = _OPTION_RULES[key]
        if not ok(value):
            raise HiLoReConfigError(f"hilore.{config_key} = {value!r} is invalid for codec "
                                    f"{name!r}; allowed: {allowed}.")
    return Codec(name, spec, backend, chosen)


def codec_from_config(config) -> "Codec | None":
    """The codec a ``HiLoReConfig`` asks for, or None when ``low_precision`` is ``"none"``."""
    if config.low_precision == "none":
        return None
    spec = CODECS.get(config.low_precision)
    options = {} if spec is None else {k: getattr(config, _OPTION_RULES[k][0])
                                       for k in spec.options}
    return get_codec(config.low_precision, config.codec_backend, **options)


# ---- the codec -------------------------------------------------------------------------------

class Codec:
    """Packs 2-D float tensors into ``Packed`` and back. Build with ``get_codec``."""

    def __init__(self, name: str, spec: CodecSpec, backend: str, options: Mapping[str, Any]):
        self.name = name
        self.spec = spec
        self.backend = backend
        self.options = MappingProxyType(dict(options))

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"Codec({self.name!r}, backend={self.backend!r}{opts})"

    def block_size(self, g: int) -> int:
        """Elements per scale along a row of G features."""
        if self.options.get("fp8_scaling") == "block":
            return max(1, min(self.options["fp8_block_size"], g))
        return max(1, g)

    def pack(self, x: torch.Tensor, measure: bool = True) -> Packed | None:
        """Pack ``x`` (N, G), contiguous float32/bfloat16/float16; None if x is not all finite.

        Reads the device once (finiteness); ``pack_async`` does not.
        """
        packed = self.pack_async(x, measure)
        return packed if bool(packed.finite) else None

    def pack_async(self, x: torch.Tensor, measure: bool = True) -> Packed:
        """Pack ``x`` without reading the device: whether x was finite is ``Packed.finite``
        (the payload of a non-finite x is meaningless; the caller must check before use).
        ``measure=False``: the same payload without the error, where the codec has a faster
        encoder for it (NOTE [ Measured or not ]; ``Packed.measured`` says which ran)."""
        return self._pack(x, measure)

    def unpack(self, p: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
        """The (N, G) tensor ``p`` stands for, in ``p.dtype``; written into ``out`` if given."""
        return self._unpack(p, out)

    def warmup(self, dtypes=(torch.float32,), device="cpu") -> None:
        """Compile (or load from inductor's cache) the kernels for ``dtypes`` now, not mid-step.
        Runs the kernels alone: no caller of ``pack`` / ``unpack`` sees these calls. On a CPU,
        the kernels built ahead for ``dtypes`` are loaded first and nothing is compiled for them
        (NOTE [ Codec kernels built ahead ] in codec_ahead.py)."""
        if self.backend == "compile" and torch.device(device).type == "cpu":
            codec_ahead.load_into(self.spec.kernels(), dtypes)
        for dtype in dtypes:
            for g in (256, 200):  # divisible by the fp8 block size, and not (ragged kernels)
                # no random numbers: the caller's RNG streams stay where they were
                x = torch.linspace(-3.0, 3.0, 4 * g, device=device).reshape(4, g).to(dtype)
                self._unpack(self._pack(x, True), None)
                self._pack(x, False)

    # -- internals
    def _pack(self, x: torch.Tensor, measure: bool) -> Packed:
        _check_input(x)
        n, g = x.shape
        b = self.block_size(g)
        if x.numel() == 0:
            return self._packed(x, b, x.new_empty(x.shape, dtype=self.spec.payload_dtype),
                                x.new_empty((n, -(-g // b)), dtype=torch.float32),
                                torch.zeros(2, dtype=torch.float64, device=x.device), True)
        fast = not measure and self.spec.encode_fast is not None and g % b == 0
        with torch.no_grad():
            if g % b == 0:  # one scale per row of the (N * nb, b) view
                kernel = self.spec.encode_fast if fast else self.spec.encode
                q, amax, stats = self._run_encode(kernel, x.view(n * (g // b), b))
            else:
                q, amax, stats = self._run_encode(self.spec.encode_ragged, x, b)
            scales = _safe_scale(amax.view(n, -1), self.spec.qmax)  # (N, nb) as in the kernel
        return self._packed(x, b, q.view(n, g), scales, stats, not fast)

    def _unpack(self, p: Packed, out: torch.Tensor | None) -> torch.Tensor:
        if p.codec != self.name:
            raise bug(f"{self!r} asked to unpack a {p.codec!r} payload")
        if out is None:
            out = torch.empty(p.shape, dtype=p.dtype, device=p.payload.device)
        elif tuple(out.shape) != p.shape or out.dtype != p.dtype or not out.is_contiguous():
            raise bug(f"unpack out= must be contiguous {p.shape} {p.dtype}, got "
                      f"{tuple(out.shape)} {out.dtype}")
        if out.numel() == 0:
            return out
        n, g = p.shape
        b = p.block_size
        with torch.no_grad():
            if g % b == 0 and self.spec.rescale is not None and out.device.type == "cpu":
                rows = out.view(-1, b)
                rows.copy_(p.payload.view(-1, b))  # ATen's cast, full width on every ISA
                self._run_decode(self.spec.rescale, rows, p.scales.view(-1, 1))
            elif g % b == 0:
                self._run_decode(self.spec.decode, p.payload.view(-1, b), p.scales.view(-1, 1),
                                 out.view(-1, b))
            else:
                self._run_decode(self.spec.decode_ragged, p.payload, p.scales, out, b)
        return out

    def _packed(self, x, block_size, payload, scales, stats, measured: bool) -> Packed:
        return Packed(codec=self.name, shape=tuple(x.shape), dtype=x.dtype, block_size=block_size,
                      payload=payload, scales=scales,
                      nbytes=live_storage_bytes([payload, scales, stats]), stats=stats,
                      measured=measured)

    def _use_compiled(self, kernel: _Kernel, rows: torch.Tensor) -> bool:
        return (self.backend == "compile" and kernel.failure is None
                and 1 not in rows.shape  # a size of 1 would get a graph of its own
                and not rows.is_inference()  # so would an inference-mode tensor
                and not _dispatch_mode_active())

    def _run_encode(self, kernel: _Kernel, x: torch.Tensor, *static):
        if self._use_compiled(kernel, x):
            result = kernel.compiled(x, *static)
            if result is not _FAILED:
                return result
        return _encode_in_chunks(kernel.fn, x, static)

    def _run_decode(self, kernel: _Kernel, *args) -> None:
        """Run a kernel that writes into one of ``args`` (tensors of the same rows, then static
        arguments); eager: over row chunks of every tensor."""
        if self._use_compiled(kernel, args[0]) and kernel.compiled(*args) is not _FAILED:
            return
        rows = _chunk_rows(args[0])
        for start in range(0, args[0].shape[0], rows):
            kernel.fn(*(a[start:start + rows] if isinstance(a, torch.Tensor) else a for a in args))


def _chunk_rows(x: torch.Tensor) -> int:
    """Rows of ``x`` (R, B) per eager chunk (NOTE [ Eager chunks ])."""
    small = x.device.type == "cpu" or _dispatch_mode_active()
    numel = _EAGER_CHUNK_NUMEL if small else _EAGER_CHUNK_NUMEL_ACCELERATOR
    return max(1, numel // max(1, x.shape[1]))


def _encode_in_chunks(fn, x: torch.Tensor, static: tuple):
    """Eager encode over row chunks (never reads the device)."""
    rows = _chunk_rows(x)
    if x.shape[0] <= rows:
        return fn(x, *static)
    q = amax = stats = None
    for start in range(0, x.shape[0], rows):
        stop = start + rows
        q_c, amax_c, stats_c = fn(x[start:stop], *static)
        if q is None:
            q = q_c.new_empty((x.shape[0], *q_c.shape[1:]))  # (R, B) payload dtype
            amax = amax_c.new_empty((x.shape[0], *amax_c.shape[1:]))  # (R, S) fp32
            stats = torch.zeros_like(stats_c)
        q[start:stop].copy_(q_c)
        amax[start:stop].copy_(amax_c)
        stats += stats_c  # NaN or inf once any chunk held them: the caller checks, once
    return q, amax, stats


def _check_input(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in INPUT_DTYPES or not x.is_contiguous():
        raise bug(f"codecs pack contiguous 2-D float32/bfloat16/float16 tensors, got shape "
                  f"{tuple(x.shape)}, dtype {x.dtype}, contiguous={x.is_contiguous()}")


def _dispatch_mode_active() -> bool:
    """A dispatch mode torch.compile does not ignore is on: a compiled frame first met under it
    would run eagerly and be skipped for good. HiLoRe's own memory readers are ignored by
    torch.compile (``ignore_compile_internals``, NOTE [ Tracked windows ] in runtime/memory.py)."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return not all(getattr(type(m), "ignore_compile_internals", lambda: False)()
                   for m in _get_current_dispatch_mode_stack())
