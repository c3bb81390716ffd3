"""The ``"hilore"`` block of a ds_config: typed fields, defaults and validation.

DeepSpeed ignores unknown top-level keys, so ds_hilore reads its own block. An invalid value
raises HiLoReConfigError naming the key, the bad value, the allowed values and the fix.

Example::

    cfg = HiLoReConfig.from_ds_config("ds_config.json")   # no "hilore" block -> enabled=False
    cfg = HiLoReConfig(memory_budget=1.2, force_plan={"model.layers.*.mlp": "R"})
    cfg.force_plan_for("model.layers.3.mlp")               # -> "R"
"""

import collections
import difflib
import fnmatch
import json
import logging
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import hjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ds_hilore._errors import HiLoReConfigError

logger = logging.getLogger(__name__)

__all__ = ["ACTIONS", "ACTIVATE", "LOW_PRECISION", "HiLoReConfig"]

ACTIONS = ("H", "L", "R")  # high-precision store, low-precision store, recompute
ACTIVATE = ("auto", "always", "with_checkpointing")  # NOTE [ The script's checkpointing ]
LOW_PRECISION = ("int8", "fp8_e4m3", "none")  # must match the names in codecs.CODECS (+ "none")
_FORCE_PLAN_ALLOWED = '"H", "L", "R", a mapping {"<unit-name glob>": "H" | "L" | "R"}, or null'


def _integral(value: Any) -> Any:
    # JSON writers emit 8e9 for 8000000000: accept floats without a fractional part as ints.
    return int(value) if isinstance(value, float) and value.is_integer() else value


_Int = Annotated[int, BeforeValidator(_integral)]
_Str = Annotated[str, Field(strict=True)]


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class _ConfigModel(BaseModel):
    """The pydantic settings of DeepSpeed's ``DeepSpeedConfigModel``, without importing
    DeepSpeed: ``import ds_hilore`` and reading a config must not (importing DeepSpeed before
    vLLM breaks vLLM). None of DeepSpeedConfigModel's extras apply here: the block has no
    deprecated fields and never drops "auto" (NOTE [ No "auto" dropping ])."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())


class HiLoReConfig(_ConfigModel):
    """Settings of HiLoRe activation recovery; JSON key == attribute name == keyword argument.

    Raises:
        HiLoReConfigError: on an unknown key, a wrong type, an out-of-range or unknown value,
            a malformed ``force_plan``, or contradictory settings.
    """

    enabled: bool = Field(True, strict=True, description=(
        "Master switch; false leaves the model as DeepSpeed alone would train it."))
    activate: Literal[ACTIVATE] = Field("auto", description=(
        "Where HiLoRe turns on: always (attaching makes it the model's checkpointing and turns "
        "it on); with_checkpointing (only where the script turned gradient checkpointing on, "
        "now or later; a model trained without it stays plain); auto: always for "
        "ds_hilore.attach / ds_hilore.initialize, with_checkpointing for engines HiLoRe joins "
        "without a script change (DS_HILORE, python -m ds_hilore.run)."))
    memory_budget: float = Field(1.10, strict=True, ge=1.0, allow_inf_nan=False, description=(
        "Per-rank peak-memory budget, a multiple of gradient checkpointing's measured peak."))
    memory_budget_bytes: Optional[_Int] = Field(None, strict=True, gt=0, description=(
        "Absolute per-rank peak-memory budget in bytes; use instead of memory_budget."))
    memory_fraction: Optional[float] = Field(None, strict=True, gt=0.0, le=1.0, allow_inf_nan=False,
        description=("Per-rank peak-memory budget as a fraction of the device's memory (CPU: of the "
                     "memory the process may use, shared by the node's ranks); use instead of "
                     "memory_budget."))
    grad_error_tolerance: float = Field(0.015, strict=True, ge=0.0, lt=1.0, allow_inf_nan=False,
        description="Relative error that L (packing) may add to the step's accumulated gradient (summed "
                    "over micro-steps and ranks, what the optimizer sees): the risk budget.")
    low_precision: Literal[LOW_PRECISION] = Field("int8", description=(
        "Codec of the L action: int8 (per-token absmax), fp8_e4m3, or none (no L: only H and R)."))
    codec_backend: Literal["eager", "compile"] = Field("compile", description=(
        "compile: fused torch.compile codecs (eager fallback on failure); eager: plain ops."))
    fp8_scaling: Literal["token", "block"] = Field("token", description=(
        "Scale granularity of fp8_e4m3: one scale per token, or per fp8_block_size elements."))
    fp8_block_size: _Int = Field(128, strict=True, gt=0,
                                description="Elements per scale when fp8_scaling is block.")
    min_pack_numel: _Int = Field(4096, strict=True, ge=0, description=(
        "Saved tensors with fewer elements per sequence slice are never packed (kept H)."))
    codec_error_interval: _Int = Field(16, strict=True, ge=1, description=(
        "One training microbatch in this many measures the codec's error on what it packs "
        "(stats' packed_rel_error_max); the others pack without measuring it, about twice as "
        "fast. The planner's errors come from profiling, which always measures. 1: every "
        "microbatch."))
    derive_pointwise: bool = Field(True, strict=True, description=(
        "Where memory is short, H and L units keep the inputs of a saved activation / product "
        "(a gated MLP's silu(g) and silu(g) * u) and re-derive it at first read instead of "
        "keeping it; false always keeps it."))
    force_plan: Optional[Union[Literal[ACTIONS], dict[str, Literal[ACTIONS]]]] = Field(None,
        description="Fixed actions, overriding allocator and budget: one action for every "
        "unit, or a mapping unit-name glob (fnmatch) -> action; the LAST matching glob wins.")
    layer_pattern: Optional[str] = Field(None, strict=True, min_length=1, description=(
        "Glob (fnmatch) over module names of decoder layers; null = GradientCheckpointingLayers."))
    attn_children: Optional[list[_Str]] = Field(None, description=(
        "Override: child-module names of a decoder layer that form its attention unit; null = "
        "units found from the layer's own execution. Set together with mlp_children."))
    mlp_children: Optional[list[_Str]] = Field(None, description=(
        "Override: child-module names of a decoder layer that form its MLP unit; null = found "
        "from execution. Set together with attn_children."))
    calibration_microbatches: _Int = Field(4, strict=True, ge=0, description=(
        "Microbatches of matched passes that calibrate susceptibility; 0 skips calibration."))
    profile_microbatches: _Int = Field(3, strict=True, ge=1, description=(
        "Microbatches of a new shape run all-R (as GC) and are measured before HiLoRe plans for "
        "that shape; the first warms up, the rest are timed; the peak is taken from all of them."))
    plan_validation_microbatches: _Int = Field(2, strict=True, ge=0, description=(
        "When a shape's plan is first built: microbatches per variant of the leave-one-out "
        "timing (the plan, and the plan with each kept layer recomputed); layers that save "
        "nothing under joint execution are recomputed from then on. 0 = off."))
    refresh_interval: _Int = Field(1, strict=True, ge=1,
                                  description="Re-estimate exposure and risk every N microbatches.")
    validation_interval: _Int = Field(0, strict=True, ge=0, description=(
        "Measure the true gradient error every N optimizer steps; 0 = off."))
    elide_zero_rows: Literal["auto", True, False, "whole"] = Field("auto", description=(
        "Sequences whose loss coefficients are all exactly zero keep no activations (E), and a "
        "microbatch of only such sequences skips its layers' backward. true: every such "
        "sequence; \"whole\": only a microbatch whose every sequence is, and only when its "
        "layers' backward is then skipped, so no kernel's backward reads the stand-in values "
        "of elided sequences; false: none (every sequence stored or recomputed as planned). "
        "auto: true on CPU, \"whole\" on accelerators, where CUDA's attention kernels were "
        "seen to turn stand-ins into gradient. In every setting but false, sequences a "
        "prediction (expect) says are zero run their layers without autograd, and the layers' "
        "recompute and backward cost the others only (kept rows only)."))
    exposure_source: Literal["auto", "analytic", "hidden_grad"] = Field("auto", description=(
        "Per-token coefficients: analytic (ds_hilore.grpo / set_coefficients), hidden_grad "
        "(gradient at the last hidden state, any loss), auto (analytic when given)."))
    log_interval: _Int = Field(0, strict=True, ge=0, description=(
        "Every N optimizer steps, one line on rank 0 with the step's mix, peak against the "
        "budget and error estimate (engine.hilore.stats has it all); 0 = quiet."))

    # NOTE [ No "auto" dropping ]
    # DeepSpeedConfigModel.__init__(strict=False) silently drops every value equal to "auto",
    # so {"low_precision": "auto"} would become the default instead of an error, and a key
    # named "strict" would be swallowed as that argument. The block is not built on it: every
    # value reaches validation, keys are checked first, and pydantic's errors are translated
    # into HiLoReConfigError.
    def __init__(self, **data: Any) -> None:
        _check_keys(data)
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise HiLoReConfigError(_explain(error, data)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            return super().__setattr__(name, value)
        # Validate the whole config with the new value first, so that a rejected assignment
        # (also a contradiction between two keys) leaves this object unchanged.
        explicit = {key: getattr(self, key) for key in self.model_fields_set}
        checked = type(self)(**{**explicit, name: value})
        super().__setattr__(name, getattr(checked, name))

    @field_validator("force_plan", mode="before")
    @classmethod
    def _check_force_plan(cls, plan: Any) -> Any:
        if plan is None or (isinstance(plan, str) and plan in ACTIONS):
            return plan
        fix = f"Fix: set force_plan to {_FORCE_PLAN_ALLOWED}."
        if not isinstance(plan, Mapping):
            what = "is not an action" if isinstance(plan, str) else "has the wrong shape"
            raise HiLoReConfigError(f"hilore.force_plan = {_show(plan)} {what}. {fix}")
        for pattern, action in plan.items():
            if not isinstance(pattern, str) or not pattern:
                raise HiLoReConfigError(f"hilore.force_plan has the key {_show(pattern)}; keys "
                                        f'are unit-name globs ("model.layers.*.mlp"). {fix}')
            if not (isinstance(action, str) and action in ACTIONS):
                raise HiLoReConfigError(f"hilore.force_plan[{_show(pattern)}] = {_show(action)} "
                                        f'is not an action: "H", "L" or "R". {fix}')
        return dict(plan)

    @model_validator(mode="after")
    def _check_contradictions(self) -> "HiLoReConfig":
        given = [key for key in ("memory_budget", "memory_budget_bytes", "memory_fraction")
                 if key in self.model_fields_set and getattr(self, key) is not None]
        if len(given) > 1:
            raise HiLoReConfigError(
                f"hilore.{given[0]} = {_show(getattr(self, given[0]))} and hilore.{given[1]} = "
                f"{_show(getattr(self, given[1]))} are both set, but they are alternatives (a "
                "multiple of gradient checkpointing's peak, absolute bytes per rank, or a fraction "
                "of the device's memory). Fix: keep exactly one of memory_budget, "
                "memory_budget_bytes and memory_fraction.")
        if (self.attn_children is None) != (self.mlp_children is None):
            given, missing = (("attn_children", "mlp_children") if self.mlp_children is None
                              else ("mlp_children", "attn_children"))
            raise HiLoReConfigError(
                f"hilore.{given} is set but hilore.{missing} is not: the two name the children "
                "of a decoder layer's two units and go together. Fix: set both, or neither "
                "(units are then found from each layer's own execution).")
        plan = self.force_plan
        where = ([p for p, a in plan.items() if a == "L"] if isinstance(plan, dict)
                 else ["every unit"] if plan == "L" else [])
        if where and self.low_precision == "none":
            raise HiLoReConfigError(
                f'hilore.force_plan asks for "L" (low-precision store) for '
                f'{", ".join(map(_show, where))}, but hilore.low_precision = "none" disables '
                f'packing. Allowed low_precision for "L": "int8", "fp8_e4m3". Fix: set '
                f'low_precision to "int8" or "fp8_e4m3", or use only "H" and "R" in force_plan.')
        return self

    # ---- construction from a ds_config ---------------------------------------------------
    @classmethod
    def from_ds_config(cls, ds_config: Union[Mapping, str, os.PathLike]) -> "HiLoReConfig":
        """Read the top-level ``"hilore"`` block of a full ds_config.

        Args:
            ds_config: the ds_config as a dict, or the path of its JSON (hjson) file, as
                accepted by ``deepspeed.initialize(config=...)``.
        Returns:
            The parsed block; ``HiLoReConfig(enabled=False)`` when there is no block.
        """
        if isinstance(ds_config, (str, os.PathLike)):
            ds_config = _read_json(ds_config)
        if not isinstance(ds_config, Mapping):
            raise HiLoReConfigError(
                f"a ds_config must be a dict or the path of a JSON file, not a "
                f"{type(ds_config).__name__}. Fix: pass what deepspeed.initialize(config=) gets.")
        block = ds_config.get("hilore")
        if block is None:
            _say_a_misspelt_block(ds_config)
        return cls(enabled=False) if block is None else cls._from_block(block)

    @classmethod
    def coerce(cls, obj: Union["HiLoReConfig", Mapping, str, os.PathLike, None]) -> "HiLoReConfig":
        """A HiLoReConfig from what ``attach`` / ``initialize`` accept.

        ``HiLoReConfig`` -> itself; ``None`` -> the defaults (enabled); a dict -> the block
        itself, or, if it has a ``"hilore"`` key, a full ds_config; a path -> a ds_config file.
        """
        if obj is None or isinstance(obj, HiLoReConfig):
            return cls() if obj is None else obj
        if isinstance(obj, (str, os.PathLike)) or (isinstance(obj, Mapping) and "hilore" in obj):
            return cls.from_ds_config(obj)
        if isinstance(obj, Mapping):
            return cls._from_block(obj)
        raise HiLoReConfigError(
            f"cannot make a HiLoReConfig from a {type(obj).__name__}. Allowed: a HiLoReConfig, "
            "a dict of the \"hilore\" block, a full ds_config dict, the path of a ds_config "
            "JSON file, or None (defaults). Fix: pass one of these.")

    @classmethod
    def _from_block(cls, block: Any) -> "HiLoReConfig":
        if not isinstance(block, Mapping):
            raise HiLoReConfigError(
                f'the "hilore" entry of the ds_config is {_show(block)}; it must be an object '
                'such as {"enabled": true, "memory_budget": 1.1}. Fix: write the block as a '
                "JSON object, or remove it to disable HiLoRe.")
        _check_keys(block)
        return cls(**block)

    def force_plan_for(self, unit_name: str) -> Optional[str]:
        """The forced action of one unit, or None when the allocator decides.

        Patterns are matched with ``fnmatch.fnmatchcase`` (``*`` also crosses dots:
        ``model.layers.1*`` matches layers 1 and 10-19). When several patterns match, the
        LAST one in the mapping wins, so write general patterns first and exceptions after:
        ``{"*": "R", "model.layers.0.*": "H"}``.
        """
        plan = self.force_plan
        if not isinstance(plan, dict):
            return plan
        matches = [action for pattern, action in plan.items()
                   if fnmatch.fnmatchcase(unit_name, pattern)]
        return matches[-1] if matches else None

    def unmatched_force_plan_patterns(self, unit_names: list[str]) -> list[str]:
        """Patterns of a force_plan mapping that match none of ``unit_names`` (likely typos)."""
        if not isinstance(self.force_plan, dict):
            return []
        return [p for p in self.force_plan
                if not any(fnmatch.fnmatchcase(name, p) for name in unit_names)]

    def to_dict(self) -> dict[str, Any]:
        """The block as a JSON-ready dict; ``HiLoReConfig(**c.to_dict()) == c``.

        ``memory_budget`` is left out when ``memory_budget_bytes`` or ``memory_fraction`` is in force (they exclude
        each other, so the round trip would otherwise fail).
        """
        alternative = self.memory_budget_bytes is not None or self.memory_fraction is not None
        exclude = {"memory_budget"} if alternative else None
        return self.model_dump(exclude=exclude)


# ---- error messages ----------------------------------------------------------------------
def _check_keys(data: Mapping) -> None:
    known = list(HiLoReConfig.model_fields)
    lines = []
    for key in data:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f' Did you mean "{close[0]}"?' if close else ""
        lines.append(f"unknown key {_show(key)} in the \"hilore\" block.{hint} Allowed keys: "
                     f"{', '.join(known)}. Fix: rename or remove {_show(key)}.")
    if lines:
        raise HiLoReConfigError("\n".join(lines))


def _explain(error: ValidationError, data: Mapping) -> str:
    lines = {}  # one line per key (a list can fail at several items)
    for item in error.errors():
        cause = (item.get("ctx") or {}).get("error")
        if isinstance(cause, HiLoReConfigError):
            lines[str(cause)] = str(cause)
            continue
        key = str(item["loc"][0])
        value = data.get(key, item["input"])
        allowed = _allowed(key)
        problem = {"literal_error": "is not a known value", "finite_number": "is not finite",
                   }.get(item["type"], "is out of range" if "ctx" in item else "has the wrong type")
        default = _show(HiLoReConfig.model_fields[key].default)
        lines[key] = (f"hilore.{key} = {_show(value)} {problem}. Allowed: {allowed}. "
                      f"Fix: set \"{key}\" to {allowed}, or remove it for the default {default}.")
    return "\n".join(lines.values())


def _allowed(key: str) -> str:
    """Human description of a field's type and bounds, derived from its declaration."""
    if key == "force_plan":
        return _FORCE_PLAN_ALLOWED
    info = HiLoReConfig.model_fields[key]
    base, args = info.annotation, get_args(info.annotation)
    if get_origin(base) is Union:  # Optional[X]: describe X, then add "or null"
        base = get_args(args[0])[0] if get_origin(args[0]) is Annotated else args[0]
    bounds = [f"{op} {getattr(m, name)}" for m in info.metadata
              for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
              if hasattr(m, name)]
    if get_origin(base) is Literal:
        text = "one of " + ", ".join(map(_show, get_args(base)))
    elif base in (int, float):
        text = f"{'an integer' if base is int else 'a number'} {' and '.join(bounds)}".rstrip()
    else:
        nonempty = any(getattr(m, "min_length", None) for m in info.metadata)
        text = {bool: "true or false", str: "a non-empty string" if nonempty else "a string"
                }.get(base, "a list of strings")
    return text + (" or null" if type(None) in args else "")


def _say_a_misspelt_block(ds_config: Mapping) -> None:
    """A top-level key that looks like ``"hilore"`` but is not it (``"HiLoRe"``,
    ``"hilore_config"``): DeepSpeed ignores unknown keys, so the run would train without HiLoRe,
    without a word."""
    near = [key for key in ds_config if isinstance(key, str) and (
        "hilore" in key.lower() or difflib.get_close_matches(key.lower(), ["hilore"], cutoff=0.8))]
    if near:
        logger.warning("ds_hilore: the ds_config has no \"hilore\" block but a key %r: HiLoRe is "
                       "off. Fix: name the block \"hilore\" (lower case, exactly).", near[0])


def _unique_keys(pairs: list) -> dict:
    """An object of a ds_config file, refused where a key comes twice, as DeepSpeed refuses it
    (the last value would otherwise win without a word)."""
    twice = sorted(key for key, n in collections.Counter(key for key, _ in pairs).items() if n > 1)
    if twice:
        raise HiLoReConfigError(f"duplicate keys in the ds_config: {twice} (DeepSpeed refuses "
                                "such a file). Fix: keep one of each.")
    return dict(pairs)


def _read_json(path: Union[str, os.PathLike]) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:  # DeepSpeed reads ds_configs as hjson
            return hjson.load(handle, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as error:
        raise HiLoReConfigError(f"the ds_config file {os.fspath(path)!r} is not UTF-8 text "
                                f"({error.reason} at byte {error.start}). Fix: save it as UTF-8."
                                ) from None
    except OSError as error:
        reason = error.strerror
        raise HiLoReConfigError(f"cannot read the ds_config file {os.fspath(path)!r}: {reason}. "
                                "Fix: pass an existing file or a dict.") from None
    except hjson.HjsonDecodeError as error:
        raise HiLoReConfigError(f"the ds_config file {os.fspath(path)!r} is not valid JSON: "
                                f"{error}. Fix the syntax at that position.") from None
