"""The registry of ``hilore bench``: every way of keeping activations for the backward.

A method is data: one ``Method`` entry in ``METHODS``. ``engine`` says how its DeepSpeed
engine is made -- ``"deepspeed"``: ``deepspeed.initialize`` on a model whose checkpointing
``checkpointing`` switched on beforehand (``"hf"``: transformers' non-reentrant gradient
checkpointing, ``"sac"``: the same saving matmul outputs, ``"deepspeed"``:
``deepspeed.checkpointing.checkpoint`` as every layer's checkpoint function); ``"hilore"``:
``ds_hilore.initialize`` with the ``"hilore"`` block ``hilore_block`` writes (``hilore``: the
method's own keys over the bench's base block). ``budgeted`` methods run once per
``--budgets`` value. ``allocator``: HiLoRe's scheduler decides, so the method warms up
(profiling, calibration, leave-one-out) before it is timed.

NOTE [ static: the allocator without exposure ]
``static`` is HiLoRe's allocator made exposure-blind in the simplest honest way: a
``Scheduler`` subclass whose risk pricing treats every sequence as equally exposed (the share
of a packed unit's risk is its share of sequences, never the measured per-token exposure) and
which ignores predicted exposure (``expect``) when splitting rows. Everything else --
profiling, budget, knapsack, calibration, leave-one-out, the exact elision of A = 0 rows -- is
HiLoRe's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch


__all__ = ["METHODS", "Method", "after_initialize", "hilore_block", "prepare", "skip_reason",
           "step_context"]


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of keeping activations (see the module docstring)."""

    name: str
    summary: str
    engine: str = "deepspeed"  # "deepspeed" | "hilore"
    checkpointing: str | None = None  # "hf" | "sac" | "deepspeed", switched on before the engine
    hilore: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    budgeted: bool = False  # one run per memory budget
    exact: bool = False  # the gradient equals no checkpointing's (up to op order)
    allocator: bool = False  # HiLoRe's scheduler decides: it warms up first
    blind: bool = False  # NOTE [ static: the allocator without exposure ]
    offload: bool = False  # saved activations to host memory around each micro-step
    searched: bool = False  # block_h: the k of its plan is found by measuring
    reentrant: bool = False  # its backward writes .grad itself: no autograd.grad of it


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("nogc", "no checkpointing: every activation kept (the speed limit)", exact=True),
    Method("gc", "transformers' gradient checkpointing, non-reentrant", checkpointing="hf",
           exact=True),
    Method("ds_ac", "deepspeed.checkpointing.checkpoint on every decoder layer",
           checkpointing="deepspeed", exact=True, reentrant=True),
    Method("sac", "torch selective checkpointing: matmul outputs saved, the rest recomputed",
           checkpointing="sac", exact=True),
    Method("offload", "every activation to host memory (save_on_cpu), none recomputed",
           offload=True, exact=True),
    Method("block_h", "HiLoRe forced: the last k layers stored whole, k as large as the budget "
           "allows (found by measuring), the rest recomputed", engine="hilore", budgeted=True,
           exact=True, searched=True),
    Method("all_l", "HiLoRe forced: every unit packed (int8)", engine="hilore",
           hilore={"force_plan": "L"}),
    Method("static", "HiLoRe's allocator, exposure-blind", engine="hilore", budgeted=True,
           allocator=True, blind=True),
    Method("hr", "HiLoRe's allocator with H and R only (nothing packed)", engine="hilore",
           hilore={"low_precision": "none"}, budgeted=True, allocator=True),
    Method("hilore", "HiLoRe: H, L or R per unit and microbatch, by exposure", engine="hilore",
           budgeted=True, allocator=True),
    # the machinery's own cost: forced all-R (against gc) and all-H (against nogc)
    Method("hilore_all_r", "HiLoRe forced all R (its machinery's cost against gc)",
           engine="hilore", hilore={"force_plan": "R"}, exact=True),
    Method("hilore_all_h", "HiLoRe forced all H, keeping what nogc keeps (nothing re-derived, "
           "nothing elided): its machinery's cost against nogc", engine="hilore",
           hilore={"force_plan": "H", "derive_pointwise": False, "elide_zero_rows": False},
           exact=True),
)}


def skip_reason(method: Method, device: str) -> str | None:
    """Why ``method`` cannot run on ``device`` ("cpu" | "cuda"); None: it can."""
    if method.offload and device != "cuda":
        return "save_on_cpu offloads device activations to host; on a CPU device it is meaningless"
    return None


def hilore_block(method: Method, *, budget: float | None, tolerance: float | None,
                 codec_backend: str, elide_zero_rows: Any = "auto", block_k: int = 0,
                 layers: int = 0) -> dict[str, Any]:
    """The ds_config's ``"hilore"`` block of a HiLoRe method's run: the codec backend, the
    memory budget (budgeted methods), the error tolerance, the method's own keys, then
    ``elide_zero_rows`` (unless "auto"); ``block_h``: the last ``block_k`` of ``layers``
    layers H, the rest R."""
    block: dict[str, Any] = {"codec_backend": codec_backend}
    if method.budgeted and budget is not None:
        block["memory_budget"] = float(budget)
    if tolerance is not None:
        block["grad_error_tolerance"] = float(tolerance)
    block.update(method.hilore)
    if elide_zero_rows != "auto":  # asked for: over the method's own
        block["elide_zero_rows"] = elide_zero_rows
    if method.searched:
        plan = {"*": "R"}
        for i in range(layers - block_k, layers):
            plan[f"model.layers.{i}.*"] = "H"
        block.pop("memory_budget", None)
        block["force_plan"] = plan
    return block


_SAC_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention")


def _sac_kwargs() -> dict[str, Any]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    aten = torch.ops.aten
    ops = [getattr(aten, n).default for n in _SAC_OPS if hasattr(aten, n)]
    return {"use_reentrant": False,
            "context_fn": functools.partial(create_selective_checkpoint_contexts, ops)}


def prepare(method: Method, lm: torch.nn.Module) -> None:
    """Switch ``method``'s checkpointing on in the transformers model ``lm`` (before its
    engine is made)."""
    if method.checkpointing in ("hf", "sac"):
        enable, _ = _hf_checkpointing_switches(lm)
        enable(_sac_kwargs() if method.checkpointing == "sac" else {"use_reentrant": False})
    elif method.checkpointing == "deepspeed":
        import deepspeed

        dsc = deepspeed.checkpointing
        if not dsc.is_configured():
            dsc.configure(None, partition_activations=False, contiguous_checkpointing=False,
                          checkpoint_in_cpu=False, synchronize=False, profile=False)
        lm.enable_input_require_grads()  # reentrant-style: a layer input must require grad
        lm._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=dsc.checkpoint)


def _hf_checkpointing_switches(lm: torch.nn.Module):
    """transformers' checkpointing on/off; ``activation_*`` names from 5.x, older names before."""
    if hasattr(lm, "activation_checkpointing_enable"):
        return (lambda kw: lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kw),
                lm.activation_checkpointing_disable)
    return (lambda kw: lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw),
            lm.gradient_checkpointing_disable)


def after_initialize(method: Method, engine) -> None:
    """What a method changes in its engine once made: ``static``'s exposure-blind scheduler."""
    runtime = engine.hilore
    if method.blind and runtime is not None and runtime.policy is not None:
        offload = runtime.policy.passes.zero3_offload  # what ds_hilore.initialize gave it
        runtime.policy = ExposureBlindScheduler(runtime)
        runtime.policy.passes.zero3_offload = offload


def step_context(method: Method) -> contextlib.AbstractContextManager:
    """The context each micro-step of ``method`` runs in."""
    if method.offload:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def _exposure_blind_scheduler():
    from ds_hilore.plan.scheduler import Scheduler

    class _ExposureBlind(Scheduler):
        """The allocator without exposure: uniform risk share, no predicted-exposure splits."""

        def expect(self, exposure, step_exposure=None, exposed_microbatches=None):
            super().expect(None)  # blind: no prediction reaches the plan

        def risk_vector(self, mb):
            """Every sequence weighs the same: a packed slice's risk is its share of the
            sequences (the microbatch's mass spread evenly), never its measured exposure."""
            saved = mb.exposure_read
            mass, _ = mb.exposure_lists()
            mb.exposure_read = ([sum(mass) / len(mass)] * len(mass) if mass else mass, {})
            try:
                return super().risk_vector(mb)
            finally:
                mb.exposure_read = saved

    return _ExposureBlind


def ExposureBlindScheduler(runtime):  # noqa: N802 -- a class, made when first needed
    """The exposure-blind scheduler of ``runtime`` (NOTE [ static: the allocator without
    exposure ])."""
    return _exposure_blind_scheduler()(runtime)
