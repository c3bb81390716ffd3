"""Capture and recovery, no policy: installation on a model, recovery units found from each
layer's own execution, the per-layer frame (H / L / R / E, recompute, fast-forward), storage,
weight references, codecs and memory meters. It executes the plan it is given
(``HiLoReRuntime.set_plan`` / ``downgrade``); ``ds_hilore.plan`` decides."""

from ds_hilore.runtime.core import HiLoReRuntime, attach, find_runtime

__all__ = ["HiLoReRuntime", "attach", "find_runtime"]
