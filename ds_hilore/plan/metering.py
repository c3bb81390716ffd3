"""The scheduler's memory windows: the peaks every memory budget rests on.

* a profiled microbatch's GC peak (``open_profile`` / ``end_profile``), the unit of a relative
  budget and the base of an absolute one's headroom;
* the first microbatch that runs a bucket's plan, checked against the budget (``open_check`` /
  ``end_check``, NOTE [ The plan's peak, checked ] in checks.py);
* the step's peak for ``stats`` (``peak_now``), and memory that appears after a shape was
  profiled (``begin_step``, ``grown``, ``planned``);
* a profile's numbers agreed over ranks (``agree``).

CUDA reads the device's peak counters without resetting them (NOTE [ Shared peak counters ] in
runtime/memory.py); CPU reads the process's in-use bytes after every aten op of those windows
(NOTE [ Tracked on CPU ]). ``Scheduler`` (scheduler.py) owns one ``Metering`` and calls it at
``begin_forward``, ``begin_microbatch``, ``top_grad``, when it plans a bucket and at ``end_step``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Iterator

import torch

from ds_hilore.plan import budget as budgets
from ds_hilore.plan.checks import MAX_CREDITS, MAX_PARTIAL, PlanChecks, gradient_bytes
from ds_hilore.plan.profile import BucketProfile, exclude_nonfinite
from ds_hilore.runtime.memory import DevicePeak, PeakTracker, in_use_bytes

logger = logging.getLogger("ds_hilore")

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
__all__ = ["MAX_CREDITS", "MAX_PARTIAL", "Metering", "agree"]


# NOTE [ Tracked on CPU ]
# CUDA's peak counter sees every allocation; on CPU nothing does, and in-use bytes sampled at
# unit boundaries and at the start of the backward miss the peaks inside a unit's forward and
# backward and those of the loss and the LM head (measured on the bench's paper-cpu: GC's peak
# sampled at 351 MiB, 367 MiB read after every op; the plan made from it then ran at 1.115x
# GC's peak against a 1.10 budget, with no check to catch it). So on CPU the windows every
# budget rests on are read after every aten op (``memory.PeakTracker``, NOTE [ Tracked
# windows ] there): each profiled microbatch (GC's peak is the max over them: it varies with
# the data, e.g. with how many sequences have A = 0) and the first microbatch that runs a
# bucket's plan (NOTE [ The plan's peak, checked ]). No other microbatch is tracked: a
# reading costs a Python dispatch (~7 us) and a ``mallinfo2`` (2 us to over 100 us: it walks
# the heap's free chunks) per op; the others are sampled as before, for ``stats``. The
# profile's clock stops while the tracker reads (``_Sample.now``), so its timings carry only
# the dispatch. A window opens at its microbatch's ``begin_forward`` and its peak is the one
# read when that microbatch's backward ends (``freeze`` in the end-of-backward callback); its
# mode, which then does nothing, is taken off at the next ``begin_forward``, ``end_step`` or
# ``detach`` -- outside the backward, since the autograd engine puts back the dispatch modes
# it began with. Where the stack cannot change (inside a torch.compile'd call, e.g. a compiled
# whole model running the pre-hook) the microbatch is sampled, not tracked, and a window left
# open stays frozen until a later close, or the next window opened on the thread, takes it off.
# Left out of the readings as measurement only: the profile's trials (packing, unpacking and
# re-deriving each re-created tensor once more: paused by ``_Sample.tracker``), and what the
# matched passes keep of a microbatch for the optimizer step (the gradient at the last layer:
# paused while taken, its bytes excluded until the window ends); the passes themselves run at
# ``end_step``, after the window closed. Not seen: the peak inside one op (its private
# temporaries), and the private buffers of a compiled (inductor) kernel.

class Metering(PlanChecks):
    """The memory windows of one scheduler (see the module's docstring)."""

    def __init__(self, scheduler):
        self.s = scheduler
        self.baseline = 0  # in use before the profiled microbatch's forward
        self.start = 0  # the same, less the parameters' gradients (as ``begin_step`` reads it)
        self.meter: DevicePeak | None = None  # CUDA: the profiled microbatch's window
        self.tracker: PeakTracker | None = None  # CPU: the op-level window open now, if any
        self.check = None  # (bucket, plan, meter) of the microbatch whose plan's peak is checked
        self.check_partial = False  # that microbatch kept less than its plan (units sent to R, ...)
        self.check_whole = False  # it ran the plan whole at its forward (checks.py)
        self.check_length = 0  # that microbatch's length, the max over ranks
        self.check_budget = 0  # the budget at this rank's length (``budget_at``)
        # in use at its start, less gradients (NOTE [ Growth that is not the plan's ] in checks.py)
        self.check_base = 0
        self.partial_checks: dict[tuple, tuple] = {}  # key -> (actions, checks, highest over)
        self.step_meter: tuple[int, DevicePeak] | None = None  # CUDA: (step, the step's window)
        # NOTE [ Memory that appears after profiling ]: in use at a step's first forward, by
        # step; buckets planned in a step, charged at the next one's start
        self.step_bases: dict[int, int] = {}
        # bucket key -> (step it was planned in, bytes in use less gradients when it was)
        self.awaiting: dict[tuple[int, int], tuple[int, int]] = {}
        self.codec_warm = False  # NOTE [ A codec's first use ]
        self.said_under_earlier_peak = False  # CUDA: a window under an earlier peak, said once

    # ------------------------------------------------------------------ pipeline
    def end_windows(self) -> None:
        """``begin_forward`` and ``end_step``: the windows of the microbatch before end here."""
        self.close_profile()
        self.drop_check()
        self.close_tracker()

    def begin_microbatch(self, sample) -> None:
        """The profiler's sample of the microbatch whose window is open pauses it for its trials."""
        if self.tracker is not None and not self.tracker.frozen:
            sample.tracker = self.tracker

    def top_grad(self, mb) -> None:
        """The backward reached the last layer: a window of this microbatch ends with the backward."""
        if mb.profile is not None:
            mb.profile.sample_memory()  # the start of the backward: logits and their gradient
            _queue_callback(lambda: self.end_profile(mb))
            return
        peak = self.peak_now()
        self.s.step_stats["peak_bytes"] = max(self.s.step_stats["peak_bytes"] or 0, peak)
        if self.check is not None:
            check = self.check
            if isinstance(check[2], DevicePeak):
                check[2].sample()  # the start of the backward: the window's floor, if not exact
            _queue_callback(lambda: self.end_check(check))

    def _under_earlier_peak(self, what: str, meter: DevicePeak) -> None:
        """A CUDA window that stayed under an earlier peak of the process (NOTE [ Shared peak
        counters ] in runtime/memory.py): said once, at WARNING; ``stats["peak_exact"]``
        records each step it happened in."""
        self.s.step_stats["peak_exact"] = False
        if self.said_under_earlier_peak:
            return
        self.said_under_earlier_peak = True
        logger.warning(
            "ds_hilore: %s ran under an earlier, higher peak of this process on %s (%.1f MiB; "
            "e.g. generation, or another model's step). CUDA's peak counter is shared and "
            "ds_hilore never resets it, so that window's own peak is known only from in-use "
            "samples (%.1f MiB, a lower bound): plans may keep less than the budget allows, and "
            "a plan that goes over the budget is not seen to. Fix: call "
            "torch.cuda.reset_peak_memory_stats() before the training step (where nothing else "
            "needs the process's peak since its start).", what, meter.device,
            meter.prior / 2**20, meter.peak / 2**20)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """HiLoRe keeps something for a measurement (the matched passes' copy of a gradient):
        left out of the open window, while it is taken and until the window ends."""
        tracker = self.tracker
        if tracker is None or tracker.frozen:
            yield
            return
        before = in_use_bytes(tracker.device)
        with tracker.paused():
            yield
        tracker.exclude(in_use_bytes(tracker.device) - before)

    def detach(self) -> None:
        """The runtime is detached: no window stays open."""
        self.end_windows()

    # ------------------------------------------------------------------ profiled microbatches
    # NOTE [ Shared peak counters ] (runtime/memory.py): CUDA's peak counters are never reset;
    # a profiled microbatch and the step are windows read as offsets. A GC peak that stayed
    # under an earlier peak is known only between bounds: a budget relative to it is safe with
    # the lower bound (less headroom), an absolute one with the upper (the GC peak subtracted).
    def open_profile(self) -> None:
        """A profiled microbatch's forward begins (on CPU: tracked, NOTE [ Tracked on CPU ])."""
        device = self.s._device()
        self.baseline = in_use_bytes(device)
        self.start = self.baseline - gradient_bytes(self.s.runtime.model, device)
        bucket = self.s.bucket  # NOTE [ The plan's peak, checked ]: the longest profiled
        if bucket is not None:
            bucket.longest = max(bucket.longest or 0, self.s.longest)
        if device.type == "cuda":
            self.meter = DevicePeak(device)
        else:
            self._track()

    def close_profile(self, sampled: int = 0) -> int | None:
        """The profiled microbatch's GC peak on CUDA (None on CPU, or when none was metered),
        ``sampled``: in-use bytes read inside it; also starts the step's window at its first forward."""
        meter, self.meter = self.meter, None
        device = self.s._device()
        if device.type == "cuda" and (self.step_meter is None or self.step_meter[0] != self.s.steps):
            self.step_meter = (self.s.steps, DevicePeak(device))
        if meter is None:
            return None
        meter.floor = max(meter.floor, sampled)
        meter.close()
        config = self.s.config
        relative = config.memory_budget_bytes is None and config.memory_fraction is None
        stats = self.s.step_stats
        stats["peak_exact"] = stats.get("peak_exact", True) and meter.exact
        if not meter.exact:
            self._under_earlier_peak("a profiled microbatch (gradient checkpointing's peak)", meter)
        stats["peak_reserved_bytes"] = max(stats.get("peak_reserved_bytes") or 0, meter.reserved_peak)
        return meter.peak if relative else meter.upper

    def end_profile(self, mb) -> None:
        """End of a profiled microbatch's backward: its sample and GC's peak go to the profiler."""
        sample, mb.profile = mb.profile, None
        sample.sample_memory()
        peak = self.close_profile(sample.peak_bytes)
        tracker = getattr(sample, "tracker", None)
        sample.tracker = None
        phases = None  # NOTE [ The backward's memory, layer by layer ] in plan/profile.py
        if peak is None:  # CPU: sampled, and tracked unless its window could not open or closed early
            peak = sample.peak_bytes
            if tracker is not None and tracker.active and not tracker.frozen:
                peak = max(peak, tracker.freeze())
                phases = dict(tracker.phase_peaks)
        bucket = self.s.buckets[mb.plan_key]
        positions = {layer.index: k for k, layer in enumerate(self.s.runtime._layers)}
        bucket.profiler.add(sample, positions, peak, self.baseline, self.s.steps, phases,
                            start=self.start)
        stats = self.s.step_stats
        stats["peak_bytes"] = max(stats["peak_bytes"] or 0, peak or 0) or None

    def peak_now(self) -> int:
        device = self.s._device()
        if device.type == "cuda":  # the step's peak so far: exact, or its highest reading
            if self.step_meter is None or self.step_meter[0] != self.s.steps:
                self.step_meter = (self.s.steps, DevicePeak(device))
            return self.step_meter[1].close()
        return in_use_bytes(device)  # CPU, untracked: sampled at the start of the backward

    # ------------------------------------------------------------------ CPU windows
    def _track(self) -> bool:
        """Open an op-level window on this thread (NOTE [ Tracked on CPU ])."""
        self.close_tracker()
        tracker = PeakTracker()
        if not tracker.open():  # inside a backward, or under torch's tracing: not tracked
            return False
        self.tracker = tracker
        return True

    def close_tracker(self) -> None:
        if self.tracker is not None and self.tracker.close():
            self.tracker = None

    # ------------------------------------------------------------------ after profiling
    # NOTE [ Memory that appears after profiling ]
    # A shape is profiled in its first microbatches, over one step or several; memory created at
    # the optimizer's first step (a torch optimizer's state: AdamW's two moments, 2x the
    # trainable parameters in fp32) is in none of the samples taken before it, so a plan priced
    # from them runs past an absolute budget by all of it (measured: 1.35x). So the bytes in use
    # at each step's first forward are read (``begin_step``, once per step): the same point of
    # every step, the optimizer stepped and the gradients released. A profile's samples are
    # raised by what appeared between their step's start and the start of the step its bucket is
    # planned in (``grown``, ``Profiler.result``; from a later point, below), and a bucket
    # planned in a step is charged once, at the next step's start, with what appeared since
    # (the first optimizer step, if it came after, is then behind it): added to its baseline and
    # GC's peak, and the bucket is planned again, within the headroom left, or, below what GC now
    # needs, all R with the warning ``_plan_bucket`` gives. The growth is the max over ranks, so
    # every rank plans again the same buckets. Memory created later is seen by the plan's check,
    # where it is not taken for the plan's (NOTE [ Growth that is not the plan's ] in checks.py).
    # Parameters' gradients are left out of the readings: a trainer that keeps them between
    # steps would otherwise have them in the growth after the first backward as well as in the
    # profiled peaks (the backward makes them). Other memory a profiled microbatch makes and
    # keeps -- first-use caches of the libraries: 37 MiB of host memory after the first
    # microbatch of a process, measured on a 2-core AVX-512 CPU with a tiny Qwen2 and no codec --
    # is in the samples taken after it appeared; counted from the step's start, it was counted
    # again in the growth added to them: GC's peak read high by it, so an absolute budget left
    # less headroom (a plan with room for 2x the optimizer's state went all R) and a relative
    # one (m x that peak) allowed (m - 1) x it more. So a sample is raised by what appeared
    # after the later of its step's start and the start of the next sample of its step (its
    # own for the step's last): memory the first sample left behind is in the second's start
    # reading and peak, not in the growth (``Profiler._shifts``). The charge at the next step's
    # start is counted the same way, from the later of the planned step's start and the
    # planning itself (a forward's start, after the profiled microbatches). The largest such
    # cache is HiLoRe's own (NOTE [ A codec's first use ]), made before the first reading.
    #
    # NOTE [ A codec's first use ]
    # The codec's kernels are compiled at their first call (inductor's graphs, generated code
    # and caches: host memory that stays, 19 MiB measured on a CPU, where every malloc counts).
    # Left to the first pack, that is inside a profiled microbatch: GC's peak then read 5.6 %
    # high and a relative budget with it (measured: a peak of 1.051x GC's at memory_budget
    # 1.05). So the kernels are compiled at the runtime's first forward, before the first step's
    # reading, for the activations' dtype (autocast's, else the first floating parameter's) and
    # fp32 (what a bf16 model's norms save; a pack in yet another dtype compiles its own graph
    # when it comes, or loads it where it was built ahead): from then on the memory is
    # in every reading and in none of the growth. The time it takes (a few seconds with
    # inductor's on-disk cache, once per process; milliseconds where the kernels were built
    # ahead: NOTE [ Codec kernels built ahead ] in runtime/codec_ahead.py) is the step's
    # ``warm_up["compile"]``. It stays
    # in the training thread: compiled in a thread of its own while the script went on, dynamo
    # failed now and then on fake tensors, and a process that ended with the thread alive aborted.
    def begin_step(self) -> None:
        """The first forward of a step (NOTE [ Memory that appears after profiling ])."""
        s = self.s
        if s.steps in self.step_bases:
            return
        device = s._device()
        self._warm_codec(device)
        self.step_bases[s.steps] = in_use_bytes(device) - gradient_bytes(s.runtime.model, device)
        needed = {s.steps, *(step for step, _ in self.awaiting.values())}
        for bucket in s.buckets.values():
            if bucket.plan is None:
                needed.update(bucket.profiler.steps)
        self.step_bases = {k: v for k, v in self.step_bases.items() if k in needed}
        self.charge_memory_after_profiling()

    def _warm_codec(self, device: torch.device) -> None:
        """NOTE [ A codec's first use ]"""
        codec = self.s.runtime._codec
        if codec is None or self.codec_warm:
            return
        self.codec_warm = True
        begin = time.perf_counter()
        dtype = _activation_dtype(self.s.runtime.model, device)  # and fp32: a bf16 model's norms
        codec.warmup(tuple(dict.fromkeys((dtype, torch.float32))), device)
        self.s.warm_up("compile", time.perf_counter() - begin)

    def grown(self) -> tuple[dict[int, int], int | None]:
        """Step -> what appeared in use between its start and this step's; and what is in use
        at this step's start (less gradients), None before it was read."""
        now = self.step_bases.get(self.s.steps)
        if now is None:
            return {}, None
        return {k: max(0, now - base) for k, base in self.step_bases.items()}, now

    def planned(self, bucket) -> None:
        """``bucket`` was planned from samples of this process: charged at the next step's start
        with what appeared since now (a forward's start, nothing of it allocated yet)."""
        device = self.s._device()
        self.awaiting[bucket.key] = (self.s.steps, in_use_bytes(device)
                                     - gradient_bytes(self.s.runtime.model, device))

    def charge_memory_after_profiling(self) -> None:
        s = self.s
        due = [key for key, (step, _) in self.awaiting.items()
               if step < s.steps and key in s.buckets]
        if not due:
            return
        now = self.step_bases[s.steps]
        since = [max(self.step_bases[step], reading)
                 for step, reading in (self.awaiting.pop(key) for key in due)]
        grown = [float(max(0, now - base)) for base in since]
        if s.runtime.collective is not None:
            grown = s.runtime.collective.all_reduce_max_float(grown)
        for key, extra in zip(due, grown):
            bucket = s.buckets[key]
            if extra > 0 and bucket.profile is not None:
                self._plan_again_for(bucket, int(extra))

    def _plan_again_for(self, bucket, extra: int) -> None:
        """``extra`` bytes in use appeared after ``bucket`` was profiled: its baseline and GC's
        peak raised by them, and the bucket planned again (NOTE [ Memory that appears after
        profiling ], NOTE [ Growth that is not the plan's ] in checks.py)."""
        s = self.s
        logger.info("ds_hilore: %.1f MiB in use appeared after %dx%d was profiled (e.g. the "
                    "optimizer's state); planned again for it", extra / 2**20, *bucket.key)
        bucket.profile.baseline_bytes += extra
        bucket.profile.gc_peak_bytes += extra
        bucket.fit_actions = None  # a plan's peak grew by it too: checked again
        s._plan_bucket(bucket, profiled=False)
        headroom = bucket.plan.headroom_bytes
        if headroom < 0:  # a replan does not repeat _plan_bucket's warning: said here
            logger.warning("ds_hilore: %.1f MiB appeared after %dx%d was profiled (e.g. the "
                           "optimizer's state): the memory budget (%s: %.1f MiB per rank) is "
                           "now below what gradient checkpointing itself needs (%.1f MiB); "
                           "running as GC (all R). Fix: raise the budget.", extra / 2**20,
                           *bucket.key, budgets.describe(s.config),
                           bucket.budget_bytes / 2**20, (bucket.budget_bytes - headroom) / 2**20)


def _activation_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype a forward's activations have: autocast's where it is on, else the first
    floating parameter's (fp32 for a model without one)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def agree(profile: BucketProfile, collective) -> BucketProfile:
    """Every rank plans from the same numbers: the element-wise max over ranks; a unit
    excluded from L on any rank is excluded on all (NOTE [ Non-finite tensors ] in
    plan/profile.py: the max of L bytes alone can fall below the max of H bytes)."""
    if collective is None:
        return profile
    fields = ("recompute_s", "capture_s", "pack_s", "unpack_s", "derive_s", "rel_error")
    # rows: a rank's last microbatch may hold fewer sequences (priced per row kept when
    # sequences are elided, buckets.py); sliceable only where every rank's is
    counts = ("h_bytes", "l_bytes", "ff_bytes", "nonfinite_tensors", "derived_bytes", "rows",
              "unsliceable")
    values = [(not u.sliceable) if f == "unsliceable" else getattr(u, f)
              for u in profile.units for f in fields + counts]
    # the least room of each phase over ranks (NOTE [ The backward's memory, layer by layer ]
    # in profile.py): as many on every rank, 0 where a rank read none
    top, layers = profile.rooms() or (0, [0] * profile.n_layers())
    rooms = [-float(top)] + [-float(r) for r in layers]
    # the most above the baseline too: GC's peak priced at the bucket's longest (buckets.py)
    # grows that part, and the max peak less the max baseline can understate it
    above = profile.gc_peak_bytes - profile.baseline_bytes
    totals = [above, profile.seconds, profile.gc_peak_bytes]  # peak last
    first = len(values)
    values = collective.all_reduce_max_float([float(v) for v in values + rooms + totals])
    agreed = [int(-v) for v in values[first:first + len(rooms)]]
    profile.top_room_bytes, profile.layer_room_bytes = agreed[0], agreed[1:]
    profile.seconds = values[-2]  # the state saved
    # the baseline under the most above it (never above the max baseline): every rank's peak
    # at any length within the priced
    profile.baseline_bytes = max(0, int(values[-1]) - int(values[-3]))
    k = len(fields) + len(counts)
    for i, unit in enumerate(profile.units):
        for j, f in enumerate(fields + counts):
            value = values[i * k + j]
            if f == "unsliceable":
                unit.sliceable = not value
            else:
                setattr(unit, f, int(value) if f in counts else value)
        exclude_nonfinite(unit)
    profile.gc_peak_bytes = int(values[-1])
    return profile
