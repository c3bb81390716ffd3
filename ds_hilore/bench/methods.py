"""The registry of ``hilore bench``: every way of keeping activations for the backward.

Adding a method is one entry in ``METHODS``: a ``Method`` whose ``setup(model, config)`` switches
it on for one model copy and returns a ``Context`` (the HiLoRe runtime, if any, and a per-step
context manager), and whose ``teardown(model, context)`` switches it off again.
``skip_reason(config)`` says why a method cannot run in this configuration (``None``: it can).

``static`` is HiLoRe's allocator made exposure-blind in the simplest honest way: a ``Scheduler``
subclass (``ExposureBlindScheduler``) whose risk pricing treats every sequence as equally exposed
(the share of a packed unit's risk is its share of sequences, never the measured per-token
exposure) and which ignores predicted exposure (``expect``) when splitting rows. Everything else
-- profiling, budget, knapsack, calibration, leave-one-out, the exact elision of A = 0 rows --
is HiLoRe's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from ds_hilore.bench.demo import _hf_checkpointing_switches

__all__ = ["METHODS", "Context", "ExposureBlindScheduler", "Method", "budgeted"]


@dataclasses.dataclass
class Context:
    """What ``Method.setup`` returns: the runtime (HiLoRe methods) and a per-step context."""

    runtime: Any = None
    step: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    note: str | None = None  # e.g. the k block_h chose
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class Method:
    """One method. ``budgeted``: one run per memory budget (``config["budget"]`` is set)."""

    name = ""
    budgeted = False
    exact = False  # the gradient equals no checkpointing's (up to op order)
    policy = False  # HiLoRe's scheduler decides: warm up through profiling/calibration/LOO

    def skip_reason(self, config: dict[str, Any]) -> str | None:
        return None

    def setup(self, model: torch.nn.Module, config: dict[str, Any]) -> Context:
        return Context()

    def teardown(self, model: torch.nn.Module, context: Context) -> None:
        if context.runtime is not None:
            context.runtime.detach()


class NoGC(Method):
    name, exact = "nogc", True


class HFCheckpointing(Method):
    """transformers' non-reentrant checkpointing, with ``kwargs`` for ``torch.utils.checkpoint``."""

    name, exact = "gc", True

    def kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        return {"use_reentrant": False}

    def setup(self, model, config):
        enable, _ = _hf_checkpointing_switches(_base(model))
        enable(self.kwargs(config))
        return Context()

    def teardown(self, model, context):
        _, disable = _hf_checkpointing_switches(_base(model))
        disable()


_SAC_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention")


class SelectiveAC(HFCheckpointing):
    """torch SAC: matmul (and fused attention) outputs saved, everything else recomputed."""

    name = "sac"

    def kwargs(self, config):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        aten = torch.ops.aten
        ops = [getattr(aten, n).default for n in _SAC_OPS if hasattr(aten, n)]
        return {"use_reentrant": False,
                "context_fn": functools.partial(create_selective_checkpoint_contexts, ops)}


class DeepSpeedAC(Method):
    """``deepspeed.checkpointing.checkpoint`` as every decoder layer's checkpoint function."""

    name, exact = "ds_ac", True

    def skip_reason(self, config):
        if not torch.distributed.is_available():
            return "deepspeed.checkpointing needs torch.distributed, which this torch lacks"
        import deepspeed

        if not deepspeed.comm.is_initialized() and not config.get("ds_init"):
            return ("deepspeed.checkpointing needs DeepSpeed's communication backend "
                    "(deepspeed.init_distributed), which is not up; pass --ds-init to start a "
                    "one-rank group (on CPU DeepSpeed first builds its shm comm op: minutes)")
        return None

    def setup(self, model, config):
        import deepspeed

        if not deepspeed.comm.is_initialized():  # a one-rank group: DS's checkpointing asks for it
            _one_rank_group(config["device"])
        dsc = deepspeed.checkpointing

        if not dsc.is_configured():
            dsc.configure(None, partition_activations=False, contiguous_checkpointing=False,
                          checkpoint_in_cpu=False, synchronize=False, profile=False)
        lm = _base(model)
        lm.enable_input_require_grads()  # reentrant-style: a layer input must require grad
        lm._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=dsc.checkpoint)
        return Context()

    def teardown(self, model, context):
        lm = _base(model)
        lm.gradient_checkpointing_disable()
        if getattr(lm, "_require_grads_hooks", None):
            lm.disable_input_require_grads()


STARTED_GROUP: list[bool] = []  # the bench started a process group (ended by end_group)


def _one_rank_group(device: str) -> None:
    """``deepspeed.init_distributed`` for this process alone (gloo on CPU, nccl on CUDA), with
    a free local port; the environment is restored afterwards."""
    import os
    import socket

    import deepspeed

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if saved[k] is None})
    try:
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo",
                                   auto_mpi_discovery=False, verbose=False)
        STARTED_GROUP.append(True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def end_group() -> None:
    """Ends the process group ``ds_ac`` started, if it started one."""
    if STARTED_GROUP:
        STARTED_GROUP.clear()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class Offload(Method):
    """Every saved activation offloaded to host memory (``save_on_cpu``), none recomputed."""

    name, exact = "offload", True

    def skip_reason(self, config):
        if config["device"] != "cuda":
            return "save_on_cpu offloads device activations to host; on a CPU device it is meaningless"
        return None

    def setup(self, model, config):
        return Context(step=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))


def _base_block(config: dict[str, Any]) -> dict[str, Any]:
    """What every HiLoRe run's block carries: the codec backend, and --elide-zero-rows."""
    block = {"codec_backend": config["codec_backend"]}
    if config.get("elide_zero_rows", "auto") != "auto":
        block["elide_zero_rows"] = config["elide_zero_rows"]
    return block


class HiLoRe(Method):
    """HiLoRe (``ds_hilore.attach``) with ``overrides`` on top of the bench's base block."""

    def __init__(self, name: str, overrides: dict[str, Any] | None = None, budgeted: bool = True,
                 exact: bool = False, policy: bool = True):
        self.name, self.overrides = name, dict(overrides or {})
        self.budgeted, self.exact, self.policy = budgeted, exact, policy

    def hilore_config(self, config: dict[str, Any]) -> dict[str, Any]:
        block = _base_block(config)
        if self.budgeted:
            block["memory_budget"] = float(config["budget"])
        if config.get("grad_error_tolerance") is not None:
            block["grad_error_tolerance"] = float(config["grad_error_tolerance"])
        block.update(self.overrides)
        return block

    def setup(self, model, config):
        from ds_hilore import attach

        return Context(runtime=attach(model, self.hilore_config(config)))


class BlockH(HiLoRe):
    """The last k decoder layers kept whole, the rest recomputed; k from ``config["block_k"]``
    (the bench finds the largest k whose measured peak fits the budget)."""

    def __init__(self):
        super().__init__("block_h", budgeted=True, exact=True, policy=False)

    def hilore_config(self, config):
        k, n = int(config.get("block_k", 0)), int(config["layers_n"])
        plan = {"*": "R"}
        for i in range(n - k, n):
            plan[f"model.layers.{i}.*"] = "H"
        return dict(_base_block(config), force_plan=plan)

    def setup(self, model, config):
        context = super().setup(model, config)
        context.note = f"k={int(config.get('block_k', 0))}"
        return context


class Static(HiLoRe):
    def __init__(self):
        super().__init__("static")

    def setup(self, model, config):
        context = super().setup(model, config)
        runtime = context.runtime
        if runtime.policy is not None:
            runtime.policy = ExposureBlindScheduler(runtime)
        return context


def _exposure_blind_scheduler():
    from ds_hilore.plan.scheduler import Scheduler

    class _ExposureBlind(Scheduler):
        """The allocator without exposure: uniform risk share, no predicted-exposure splits."""

        def expect(self, exposure, step_exposure=None, exposed_microbatches=None):
            super().expect(None)  # blind: no prediction reaches the plan

        def _fit_risk(self, mb, bucket):
            saved = mb.exposure
            mb.exposure = {}  # risk share = share of sequences packed (Scheduler's fallback)
            try:
                return super()._fit_risk(mb, bucket)
            finally:
                mb.exposure = saved

    return _ExposureBlind


def ExposureBlindScheduler(runtime):
    return _exposure_blind_scheduler()(runtime)


METHODS: dict[str, Method] = {m.name: m for m in (
    NoGC(),
    HFCheckpointing(),
    DeepSpeedAC(),
    SelectiveAC(),
    Offload(),
    BlockH(),
    HiLoRe("all_l", {"force_plan": "L"}, policy=False),
    Static(),
    HiLoRe("hr", {"low_precision": "none"}),
    HiLoRe("hilore"),
    # runtime efficiency of HiLoRe's machinery: forced all-R (vs gc) and all-H (vs nogc)
    HiLoRe("hilore_all_r", {"force_plan": "R"}, budgeted=False, exact=True, policy=False),
    HiLoRe("hilore_all_h", {"force_plan": "H"}, budgeted=False, exact=True, policy=False),
)}


def budgeted(name: str) -> bool:
    return METHODS[name].budgeted
