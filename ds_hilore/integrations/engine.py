"""DeepSpeed glue: ``ds_hilore.initialize`` = ``deepspeed.initialize`` + the HiLoRe runtime.

This is the only ds_hilore module that imports DeepSpeed's engine internals;
the runtime itself works on any ``nn.Module``.

Example::

    engine, optimizer, _, scheduler = ds_hilore.initialize(model=model,
                                                           model_parameters=model.parameters(),
                                                           config="ds_config.json")
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()                 # runs engine.hilore.end_step() on each optimizer step
    print(engine.hilore.stats)

Launch as with DeepSpeed: ``deepspeed --num_gpus N train.py --deepspeed_config cfg.json`` or
``mpirun -np N python train.py ...``; on a machine without GPUs set ``DS_ACCELERATOR=cpu``.

With ``"hilore": {"enabled": false}`` (or no ``"hilore"`` block) ``initialize`` is exactly
``deepspeed.initialize``: nothing is attached, the engine keeps its class, and
``engine.hilore`` is ``None``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Mapping, Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from ds_hilore._errors import HiLoReConfigError, HiLoReError
from ds_hilore.config import HiLoReConfig
from ds_hilore.runtime.collective import TorchDistCollective  # noqa: F401 (importable here)

__all__ = ["initialize", "initialize_with_fallback", "trains", "TorchDistCollective", "setup_key",
           "CHECKPOINT_KEY"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "ds_hilore"  # client_state entry that carries the runtime's learned state


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None):
    """``deepspeed.initialize`` with HiLoRe as the model's activation checkpointing.

    Args: exactly those of ``deepspeed.initialize``; the ``"hilore"`` block is read from the
        same ds_config (``config``, ``config_params`` or ``args.deepspeed_config``: a dict, a
        path, or base64 text).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as ``deepspeed.initialize``.
        ``engine.hilore`` is the attached runtime, or ``None`` when HiLoRe is disabled.

    Raises:
        HiLoReConfigError: an invalid ``"hilore"`` block (e.g. ``memory_budget`` < 1.0).
        HiLoReError: pipeline parallelism (a ``PipelineModule`` or a ``"pipeline"`` block).

    Warns:
        ``activation_checkpointing`` and ``hilore`` both configured (HiLoRe wins);
        ``memory_budget_bytes`` below what gradient checkpointing needs (falls back to GC).
    """
    ds_kwargs = dict(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
        mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
        mesh_param=mesh_param, config_params=config_params)
    return initialize_with_fallback(ds_kwargs, None)


def initialize_with_fallback(ds_kwargs: dict, fallback_block: Optional[Mapping],
                             settings: str = "DS_HILORE_CONFIG", name: Optional[str] = None):
    """``initialize(**ds_kwargs)``, with ``fallback_block`` as the ``"hilore"`` block when the
    ds_config has none (the variables of NOTE [ Autoload ] in ds_hilore/integrations/autoload.py).

    ``fallback_block`` is given on the zero-code-change path only: there ``activate: "auto"``
    follows the script's checkpointing (NOTE [ The script's checkpointing ] in runtime/core.py).
    ``settings`` says where that block came from and ``name`` which engine this is, for the
    start line."""
    ds_config = _resolve_ds_config(ds_kwargs["args"], ds_kwargs["config"], ds_kwargs["config_params"])
    if "hilore" not in ds_config and fallback_block is not None:
        hilore_config = HiLoReConfig.coerce(fallback_block)
    else:
        hilore_config = HiLoReConfig.from_ds_config(ds_config)
        settings = 'the ds_config\'s "hilore" block'
    if hilore_config.enabled:
        _check_supported(ds_kwargs["model"], ds_config)
    engine, ds_optimizer, dataloader, scheduler = _deepspeed_initialize()(**ds_kwargs)
    engine.hilore = None
    if hilore_config.enabled:
        follow = fallback_block is not None and hilore_config.activate == "auto"
        _attach_runtime(engine, hilore_config, follow)
        engine.hilore_name = name or type(engine.module).__name__
        _announce(_start_line(engine, settings))
    return engine, ds_optimizer, dataloader, scheduler


def trains(ds_kwargs: Mapping) -> bool:
    """Whether ``deepspeed.initialize(**ds_kwargs)`` builds a training engine: an optimizer or
    model_parameters is given, or the ds_config has an "optimizer" block (DeepSpeed then builds
    one). Reference, reward and EMA engines do not train. A ds_config that cannot be found
    counts as not training: deepspeed.initialize then reports it."""
    if ds_kwargs.get("optimizer") is not None or ds_kwargs.get("model_parameters") is not None:
        return True
    try:
        ds_config = _resolve_ds_config(ds_kwargs.get("args"), ds_kwargs.get("config"),
                                       ds_kwargs.get("config_params"))
    except (HiLoReConfigError, OSError, ValueError):
        return False
    return ds_config.get("optimizer") is not None


def _deepspeed_initialize():
    """DeepSpeed's own ``initialize``, also while the autoload replacement stands in for it."""
    return getattr(deepspeed.initialize, "deepspeed_initialize", deepspeed.initialize)


# ---- configuration ---------------------------------------------------------------------
def _resolve_ds_config(args: Any, config: Any, config_params: Any) -> dict:
    """The ds_config as a dict, found where ``deepspeed.initialize`` looks for it."""
    if config is None:
        config = config_params
    for name in ("deepspeed_config", "deepscale_config"):
        if config is None and getattr(args, name, None) is not None:
            config = getattr(args, name)
    if config is None:
        raise HiLoReConfigError(
            "no ds_config given. Fix: pass config=<dict or path> to ds_hilore.initialize, or "
            "--deepspeed_config <path> in args, as for deepspeed.initialize.")
    if isinstance(config, Mapping):
        return dict(config)
    return load_ds_config(config)  # a path or base64 text, read as deepspeed.initialize reads it


# NOTE [ Which activation checkpointing wins ]
# DeepSpeed's "activation_checkpointing" block configures deepspeed.checkpointing, which only
# acts where model code calls deepspeed.checkpointing.checkpoint (Megatron-style models);
# transformers models checkpoint through their GradientCheckpointingLayers, which HiLoRe
# takes over. With both configured HiLoRe wins for every decoder layer it manages: we warn
# instead of failing, because stock DeepSpeed configs often carry that block, and
# "hilore": {"enabled": false} gives DeepSpeed's behaviour back.
def _check_supported(model: Optional[torch.nn.Module], ds_config: Mapping) -> None:
    pipeline = ds_config.get("pipeline") or {}
    stages = pipeline.get("stages", 1) if isinstance(pipeline, Mapping) else pipeline
    # "auto", DeepSpeed's default, pipelines only a PipelineModule: a plain module trains as is
    if isinstance(model, PipelineModule) or stages not in (1, None, "auto"):
        what = "the model is a PipelineModule" if isinstance(model, PipelineModule) else \
            f'the ds_config has a "pipeline" block {pipeline}'
        raise HiLoReError(
            f"HiLoRe does not support DeepSpeed pipeline parallelism ({what}): the pipeline "
            "engine schedules its own activation checkpointing per stage. Fix: train with ZeRO "
            "data parallelism (stages 0-3) and a plain nn.Module, or set "
            '"hilore": {"enabled": false} to keep pipeline parallelism without HiLoRe.')
    if "activation_checkpointing" in ds_config:
        warnings.warn(
            'the ds_config has both "hilore" (enabled) and DeepSpeed\'s "activation_checkpointing" '
            "block. HiLoRe wins: it is the activation checkpointing of every decoder layer it "
            "manages, and the activation_checkpointing block only affects code that calls "
            "deepspeed.checkpointing itself. Fix: remove the activation_checkpointing block, or "
            'set "hilore": {"enabled": false} to use DeepSpeed\'s checkpointing instead.',
            UserWarning, stacklevel=4)


# ---- attaching ---------------------------------------------------------------------------
def _attach_runtime(engine: Any, hilore_config: HiLoReConfig, follow_script: bool = False) -> None:
    from ds_hilore.plan import (
        attach,  # the runtime needs no DeepSpeed; imported when enabled only
    )

    runtime = attach(engine.module, hilore_config)
    try:  # an engine that cannot take HiLoRe leaves its model as it found it
        if follow_script:
            runtime.follow_script_checkpointing()
        _zero_stage(runtime, engine.zero_optimization_stage())
        if runtime.policy is not None:  # NOTE [ Matched passes under ZeRO-3 ] (zero3_passes.py)
            offload = getattr(engine.optimizer, "parameter_offload", None)
            runtime.policy.passes.zero3_offload = offload
        engine.hilore = runtime
        engine.__class__ = _hilore_engine_class(type(engine))
        _check_budget(runtime, hilore_config)
        runtime.sync_plan()
    except BaseException:
        runtime.detach()
        raise


def _zero_stage(runtime: Any, stage: int) -> None:
    """What the ZeRO stage allows: a rank's skipped backward of zeros (NOTE [ A backward of
    zeros ] in runtime/zero_backward.py) below stage 3, where each rank's backward is its own;
    at stage 3 the module calls of every rank match instead (NOTE [ Kept rows only ] in
    runtime/rows.py). Said once at stage 3."""
    runtime.zero_backward_skip = stage < 3
    runtime.matched_calls = stage >= 3
    if stage >= 3 and not _SAID_STAGE3:
        _SAID_STAGE3.append(True)
        logger.info("ds_hilore: under ZeRO-3 a microbatch whose loss coefficients all turn out "
                    "zero after its forward still runs its layers' backward (ZeRO-3 gathers and "
                    "reduce-scatters in the backward's module hooks, which every rank must "
                    "reach). Handing the prediction before the forward (runtime.expect) runs its "
                    "layers' backward over one row instead.")


_SAID_STAGE3: list = []
_ENGINE_CLASSES: dict[type, type] = {}


def _hilore_engine_class(base: type) -> type:
    """``base`` (DeepSpeedEngine or a subclass) with HiLoRe's step and checkpoint hooks."""
    if issubclass(base, HiLoReEngineMixin):
        return base
    if base not in _ENGINE_CLASSES:
        _ENGINE_CLASSES[base] = type(f"HiLoRe{base.__name__}", (HiLoReEngineMixin, base), {})
    return _ENGINE_CLASSES[base]


class HiLoReEngineMixin:
    """Hooks on a DeepSpeed engine; the class of an engine is switched to include it.

    * ``step``: ``hilore.check_late()`` before the optimizer step, on every rank (a leak into
      elided sequences on any rank stops all of them); ``hilore.end_step()`` once per optimizer
      step, i.e. when DeepSpeed's ``global_steps`` advanced (gradient-accumulation micro-steps
      do not count; an fp16 overflow-skipped step does, as DeepSpeed counts it).
    * ``save_checkpoint`` / ``load_checkpoint``: carry the runtime's learned state in
      DeepSpeed's own ``client_state`` (NOTE [ HiLoRe state in checkpoints ]).
    * ``backward`` under ZeRO-3: parameter states after it as DeepSpeed alone leaves them
      (NOTE [ ZeRO-3's trace and persistent parameters ]).
    """

    hilore: Any

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        coordinator = _zero3_coordinator(self)
        if coordinator is None:
            return super().backward(*args, **kwargs)
        complete = coordinator.is_complete_trace()
        result = super().backward(*args, **kwargs)
        self._keep_persistent_resident(coordinator, complete)
        return result

    def _keep_persistent_resident(self, coordinator: Any, complete: bool) -> None:
        """NOTE [ ZeRO-3's trace and persistent parameters ]: from a backward whose trace HiLoRe's
        new plan invalidated until a training pass runs under a complete trace again, the
        persistent parameters are resident after every backward, as gradient checkpointing
        leaves them."""
        recomputed = tuple(unit.action == "R" for unit in self.hilore.units)
        changed = recomputed != getattr(self, "_hilore_recomputed", recomputed)
        self._hilore_recomputed = recomputed
        still_complete = coordinator.is_complete_trace()
        if complete and not still_complete and changed:
            self._hilore_retrace = True
        elif complete and still_complete:
            self._hilore_retrace = False
        if getattr(self, "_hilore_retrace", False):
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            released = [p for p in self.module.parameters() if getattr(p, "ds_persist", False)
                        and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            if released:  # the same list on every rank: DeepSpeed's trace and the plan agree
                released[0].all_gather(param_list=released)

    def destroy(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's model is left as it was before HiLoRe: a new engine may attach again."""
        self.hilore.detach()
        return super().destroy(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_gradient_accumulation_boundary():  # the same on every rank
            self.hilore.check_late()
        steps_before = self.global_steps
        result = super().step(*args, **kwargs)
        if self.global_steps != steps_before:
            self.hilore.end_step(step=self.global_steps)
            self.hilore.sync_plan()
            self._log_hilore_stats()
        return result

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        *args: Any, **kwargs: Any) -> Any:
        client_state = dict(client_state or {})
        if CHECKPOINT_KEY in client_state:
            raise HiLoReError(f"client_state has the key {CHECKPOINT_KEY!r}, which ds_hilore uses "
                              "for HiLoRe's learned state. Fix: rename your key.")
        pending = getattr(self, "_hilore_pending", None)  # loaded, the units not found yet
        state = pending[0] if pending is not None else self.hilore.state_dict()
        client_state[CHECKPOINT_KEY] = {"setup": setup_key(), "runtime": state}
        return super().save_checkpoint(save_dir, tag, client_state, *args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        load_path, client_state = super().load_checkpoint(*args, **kwargs)
        if load_path is None or client_state is None:
            return load_path, client_state
        _restore_runtime_state(self, client_state.pop(CHECKPOINT_KEY, None), load_path)
        return load_path, client_state

    def _log_hilore_stats(self) -> None:
        interval = self.hilore.config.log_interval
        if interval and self.global_steps % interval == 0:
            _announce(_step_line(self.global_steps, getattr(self, "hilore_name", "engine"),
                                 self.hilore.plan_hash(), self.hilore.stats))


# NOTE [ ZeRO-3's trace and persistent parameters ]
# ZeRO-3 records the order in which one forward and backward fetch submodules (its trace, reset
# at each forward of the engine's module) and compares every later pass with it. Under a
# complete trace it keeps "persistent" parameters (stage3_param_persistence_threshold) resident;
# while the trace is invalid or being recorded again it releases them with the rest, so they
# are NOT_AVAILABLE after that micro-step. Gradient checkpointing recomputes every layer in
# every backward: its order never changes. HiLoRe's does whenever its plan changes what is
# recomputed (profiling all-R, then the plan, leave-one-out variants, units sent to R): that
# backward invalidates the trace, and the next pass to reach the engine's module records a new
# one -- in DeepSpeed-Chat a generation step's one-token forward, which the next training pass
# invalidates again. Scripts that read parameters between micro-steps (DeepSpeed-Chat's EMA
# gathers only NOT_AVAILABLE ones) would see another state than without HiLoRe. So from a
# backward whose trace a plan change invalidated until a backward that starts and ends under a
# complete trace, the persistent parameters are gathered back after each backward. Every input
# is the same on every rank (DeepSpeed checks that ranks record the same trace; plans are the
# same on every rank), so every rank gathers the same list.
def _zero3_coordinator(engine: Any) -> Any:
    """DeepSpeed's ZeRO-3 parameter coordinator of ``engine``, or None below stage 3."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return offload.get_param_coordinator() if offload is not None else None


# ---- what is said ------------------------------------------------------------------------
# NOTE [ What HiLoRe says ]
# One line per HiLoRe engine at start, and with log_interval one line per logged step, on
# rank 0, through DeepSpeed's logger as DeepSpeed's own lines are (log_dist, ranks=[0], INFO).
# DeepSpeed's logger lets INFO through only with "log_level": "info" in the ds_config; at its
# default (WARNING) the lines are printed on rank 0 instead (DeepSpeed's print_dist), so a
# user sees that HiLoRe is on without configuring logging. The planner's own messages (plans,
# fallbacks) go to the standard "ds_hilore" logger.
def _announce(message: str) -> None:
    from deepspeed.utils import logging as ds_logging

    if ds_logging.logger.isEnabledFor(logging.INFO):
        ds_logging.log_dist(message, ranks=[0])
    else:
        ds_logging.print_dist(message, ranks=[0])


def _start_line(engine: Any, settings: str) -> str:
    from ds_hilore.plan import budget as budgets

    runtime, config = engine.hilore, engine.hilore.config
    units = runtime.units
    layers = sorted({u.layer_index for u in units})
    where = f"{len(units)} units in {len(layers)} decoder layers" + (
        f" ({units[0].name} .. {units[-1].name})" if units else " (found at the first forward)")
    plan = f"force_plan {config.force_plan}" if config.force_plan is not None else \
        f"budget {budgets.describe(config)}, grad_error_tolerance {config.grad_error_tolerance}, " \
        f"low_precision {config.low_precision}"
    state = "on" if runtime.enabled else \
        "off: the script trains it without gradient checkpointing (activate: " \
        f"{config.activate}; gradient_checkpointing_enable() turns it on)"
    return f"ds_hilore: HiLoRe engine {engine.hilore_name}: {where}; {plan}; {state}; settings: {settings}"


def _step_line(step: int, name: str, digest: str, stats: Mapping) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB"  # noqa: E731
    error = stats.get("grad_error_est")
    measured = stats.get("grad_error_measured")
    actions = stats.get("actions") or {}
    mix = " ".join(f"{a} {actions.get(a, 0)}" for a in "HLRE")
    budget = stats.get("budget_bytes")
    budget = "(force_plan: no budget)" if "budget_bytes" not in stats else \
        f"of budget {mib(budget)}" if budget is not None else "(budget: once the shape is profiled)"
    return (f"ds_hilore step {step} ({name}, plan {digest}): actions {mix} (units x microbatches); "
            f"recomputed {stats.get('recomputed_units', 0)}; peak {mib(stats.get('peak_bytes'))} "
            f"{budget}; est. error "
            f"{'-' if error is None else f'{error:.4f}'}, measured "
            f"{'-' if measured is None else f'{measured:.4f}'}")


# ---- checkpoints -------------------------------------------------------------------------
# NOTE [ HiLoRe state in checkpoints ]
# The learned state (calibration, profiles, plan cache) rides in DeepSpeed's client_state,
# not in a side file: DeepSpeed writes it inside the model-states file it already writes
# (through its checkpoint engine, so async/decoupled writers and the "latest" tag apply), it
# is read back on every rank by load_checkpoint, and it cannot go missing or get out of step
# with the weights the way a separate hilore_state.pt could. The state is rank 0's (the rank
# that decides plans from all-reduced statistics and broadcasts them), so every rank
# restoring the same copy keeps plans identical across ranks.
# Timings and calibration only hold on the setup that measured them, so the state is keyed
# by setup_key(); on a different setup it is dropped and HiLoRe profiles again. They hold
# only for the recovery units they were learned for, compared once the units are known: at
# load for a transformers model (found by the probe at attach), at the start of the first
# training forward after the one that finds them otherwise (a ``layer_pattern`` model,
# OpenRLHF's critic, which refuses the probe); until then the loaded state is what a save
# writes. Compared earlier, against no units at all, every such resume would drop it.
def setup_key() -> dict[str, Any]:
    """What learned state depends on: device type (and model), world size, torch version."""
    accelerator = get_accelerator()
    device = accelerator.device_name()
    name = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else device
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return {"device_type": device, "device_name": name, "world_size": world_size,
            "torch_version": torch.__version__}


def _restore_runtime_state(engine: Any, saved: Optional[Mapping], load_path: str) -> None:
    runtime, current = engine.hilore, setup_key()
    mismatch = saved is not None and saved["setup"] != current
    if saved is not None and runtime.collective is not None:
        # kept or dropped on every rank alike: restoring broadcasts plans (a collective), and
        # ranks of different devices (setup_key's device_name) would otherwise differ
        mismatch = runtime.collective.all_reduce_max([int(mismatch)])[0] > 0
    if saved is None:
        logger.info("checkpoint %s has no HiLoRe state (saved without ds_hilore): HiLoRe "
                    "profiles and calibrates from scratch.", load_path)
    elif mismatch:
        logger.warning("HiLoRe state in checkpoint %s was learned on %s, this run is %s (on this "
                       "rank or another): dropped; HiLoRe profiles and calibrates again.",
                       load_path, saved["setup"], current)
    else:
        engine._hilore_pending = (saved["runtime"], load_path)
        if not runtime.units_known():
            logger.info("HiLoRe state in checkpoint %s is restored once the recovery units are "
                        "found, at the first training forward.", load_path)
        runtime.when_units_known(lambda: _restore_for_units(engine, saved["runtime"], load_path))


def _restore_for_units(engine: Any, state: Mapping, load_path: str) -> None:
    """The learned state back, once the runtime's units are known (NOTE [ HiLoRe state in
    checkpoints ]): only for the units it was learned for."""
    runtime = engine.hilore
    if getattr(engine, "_hilore_pending", (None,))[0] is not state:
        return  # a later load_checkpoint replaced it
    engine._hilore_pending = None
    # learned for these recovery units: another model, layer_pattern or children override
    # would plan units it never profiled, or name units this run does not have
    saved_units = sorted(state.get("plan", {}))
    units = sorted(u.name for u in runtime.units)
    other_units = saved_units != units
    if runtime.collective is not None:  # the units are agreed on; the answer too
        other_units = runtime.collective.all_reduce_max([int(other_units)])[0] > 0
    if other_units:
        logger.warning("HiLoRe state in checkpoint %s was learned for %d recovery units (%s ..), "
                       "this run has %d (%s ..): another model, layer_pattern or children "
                       "override; dropped; HiLoRe profiles and calibrates again.", load_path,
                       len(saved_units), saved_units[:1], len(units), units[:1])
        return
    runtime.load_state_dict(state)
    logger.info("HiLoRe state restored from checkpoint %s (same setup: no recalibration).",
                load_path)


# ---- memory budget -----------------------------------------------------------------------
# NOTE [ Budget below gradient checkpointing ]
# memory_budget (a multiple >= 1.0 of GC's measured peak) can never be below GC.
# memory_budget_bytes can: a budget smaller than what is already in use once DeepSpeed holds
# parameters, gradients and optimizer state is certainly below GC's peak. HiLoRe then does
# exactly what GC does (every unit R), never more, so it cannot OOM where GC would not.
# The check uses the max over ranks so that every rank takes the same decision.
def _check_budget(runtime: Any, hilore_config: HiLoReConfig) -> None:
    budget = hilore_config.memory_budget_bytes
    if budget is None:
        return
    from ds_hilore.runtime.memory import in_use_bytes

    in_use = in_use_bytes()  # bytes
    if runtime.collective is not None:
        in_use = runtime.collective.all_reduce_max([in_use])[0]
    if in_use <= budget:
        return
    forced = isinstance(hilore_config.force_plan, str)  # a mapping leaves the others to the budget
    warnings.warn(
        f"hilore.memory_budget_bytes = {budget} is below what gradient checkpointing needs: "
        f"{in_use} bytes are in use per rank (max over ranks) right after deepspeed.initialize. "
        + ("force_plan is set and overrides the budget, so it is kept. " if forced else
           "HiLoRe falls back to gradient checkpointing (every unit R). ")
        + "Fix: raise memory_budget_bytes, or use memory_budget (a multiple >= 1.0 of GC's peak).",
        UserWarning, stacklevel=5)
    if not forced:
        runtime.set_plan("R")
