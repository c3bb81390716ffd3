"""HiLoRe without changing the training script: ``DS_HILORE=1`` or ``DS_HILORE_CONFIG``.

With one of the variables set (or under ``python -m ds_hilore.run``), every
``deepspeed.initialize`` that trains is ``ds_hilore.initialize``; engines without an optimizer
(reference, reward, EMA models) stay plain DeepSpeed engines.

Variables:
    DS_HILORE         ``1`` / ``true`` / ``yes`` / ``on``: on. ``0`` / ``false`` / ``no`` /
                      ``off``: off, even when DS_HILORE_CONFIG is set.
    DS_HILORE_CONFIG  The ``"hilore"`` block for ds_configs that have none: inline JSON
                      (``'{"force_plan": "H"}'``) or the path of a JSON file holding the block
                      or a whole ds_config. Setting it also switches HiLoRe on.

The ``"hilore"`` block of the ds_config, when there is one, always wins (``{"enabled": false}``
there keeps an engine plain); without one the block comes from DS_HILORE_CONFIG, else the
defaults apply.

# NOTE [ Autoload ]
# Most GRPO stacks call deepspeed.initialize from code that is not the user's (TRL through
# accelerate's Accelerator._prepare_deepspeed, OpenRLHF and DeepSpeed-Chat from their own
# engine builders), so the way in is to replace the function itself before anyone calls it:
#
# 1. Installing ds_hilore puts ``ds_hilore_autoload.pth`` into site-packages (setup.py does it
#    for wheels and for ``pip install -e .``). Python's ``site`` runs its one line at every
#    interpreter start; the line reads the two variables and, only if one is set, imports
#    ``_ds_hilore_autoload`` and calls ``install``. Without the variables that is two
#    dictionary look-ups and no import -- neither torch nor deepspeed (importing deepspeed
#    early breaks vLLM) nor ds_hilore. ``_ds_hilore_autoload`` is a top-level module of its
#    own because anything inside this package runs ``ds_hilore/__init__``, which imports torch
#    and deepspeed; it imports only ``os`` and ``sys``.
# 2. ``install`` puts a meta-path finder first on ``sys.meta_path``. It answers only for the
#    top-level name ``deepspeed``: it asks the finders after it for the real spec and wraps the
#    loader, so that right after deepspeed's ``__init__`` has run -- before any other module
#    can bind the function with ``from deepspeed import initialize`` -- ``deepspeed.initialize``
#    is replaced by ``TrainingInitialize`` and the finder removes itself. The module keeps
#    deepspeed's own loader. ``importlib.util.find_spec("deepspeed")`` (the availability
#    checks of transformers and accelerate) loads nothing, so the finder stays until the real
#    import. If deepspeed is already imported, ``install`` replaces the function at once.
# 3. Each call of the replacement comes here (``initialize``): an engine trains when an
#    optimizer or model_parameters is passed or the ds_config has an "optimizer" block
#    (DeepSpeed then builds one); those calls go to ds_hilore.integrations.engine, every other call to
#    deepspeed's own function. ds_hilore.initialize always calls the function that was
#    replaced (``TrainingInitialize.deepspeed_initialize``), so the two never nest, and an
#    explicit ds_hilore.initialize in a script run this way attaches HiLoRe once.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from _ds_hilore_autoload import (
    ENV_CONFIG,
    ENV_SWITCH,
    SWITCH_OFF,
    TrainingInitialize,
    install,
    switched_on,
)
from ds_hilore._errors import HiLoReConfigError

__all__ = ["ENV_CONFIG", "ENV_SWITCH", "TrainingInitialize", "fallback_block", "initialize", "install",
           "switched_on"]

SWITCH_ON = ("1", "true", "yes", "on")


class _TrainingEngines:
    """How many training engines the replacement has built in this process: the next one's
    position (NOTE [ Settings per engine ])."""

    def __init__(self) -> None:
        self.built = 0

    def next(self) -> int:
        self.built += 1
        return self.built - 1


_TRAINING_ENGINES = _TrainingEngines()


def initialize(replacement: TrainingInitialize, args: tuple, kwargs: dict) -> Any:
    """One call of the replaced ``deepspeed.initialize(*args, **kwargs)`` (NOTE [ Autoload ])."""
    from ds_hilore.integrations import engine

    bound = inspect.signature(replacement.deepspeed_initialize).bind(*args, **kwargs)
    bound.apply_defaults()
    ds_kwargs = dict(bound.arguments)
    if not engine.trains(ds_kwargs):
        return replacement.deepspeed_initialize(*args, **kwargs)
    position = _TRAINING_ENGINES.next()
    model_class = type(ds_kwargs.get("model")).__name__
    block, settings = engine_block(fallback_block(), position, model_class)
    result = engine.initialize_with_fallback(ds_kwargs, block, settings,
                                             name=f"{model_class} (training engine {position})")
    from ds_hilore.integrations import trl_exposure
    trl_exposure.install()  # TRL's GRPOTrainer: advantages before the forward (NOTE [ TRL exposure ])
    return result


# NOTE [ Settings per engine ]
# DeepSpeed-Chat and OpenRLHF build every ds_config in code, so DS_HILORE_CONFIG is the only
# way in, and one process builds several training engines (actor, critic). The variable may
# hold an "engines" mapping next to the block's keys:
#     {"memory_budget": 1.2, "engines": {"1": {"force_plan": "R"}, "RewardModel": {...}}}
# A key is either the engine's position among the training engines this process builds
# ("0" = the first training deepspeed.initialize, whatever its model) or the class name of
# the model passed to deepspeed.initialize (DS-Chat's critic: "RewardModel"; OpenRLHF's:
# "CriticModel"; a LoRA model: "PeftModelForCausalLM"). An engine gets the keys outside
# "engines", updated with the block of its class name, then with the block of its position
# (the more specific wins: a budget of any kind replaces the budget it overrides); an engine no
# key names gets the keys outside "engines" alone.
# Positions count training engines only (reference, reward and EMA engines stay plain and
# are not counted) and are the order of the script's calls, which DS-Chat (actor, then critic)
# and OpenRLHF (actor, then critic, on each worker) keep fixed. Every block is checked when
# the first engine starts, so a mistake in the second engine's block stops the start.
def engine_block(block: dict, position: int, model_class: str) -> tuple[dict, str]:
    """The ``"hilore"`` block of the ``position``-th training engine, whose model is of class
    ``model_class``, and where it came from (NOTE [ Settings per engine ]).

    Raises:
        HiLoReConfigError: "engines" is not a mapping of objects, or a block is invalid.
    """
    from ds_hilore.config import HiLoReConfig

    base = {k: v for k, v in block.items() if k != "engines"}
    engines = block.get("engines", {})
    if not isinstance(engines, dict) or not all(isinstance(v, dict) for v in engines.values()):
        raise HiLoReConfigError(
            f'{ENV_CONFIG}: "engines" = {engines!r} must map an engine (its position among the '
            'training engines, "0", "1", ..., or its model\'s class name) to a "hilore" block. '
            'Fix: e.g. "engines": {"1": {"force_plan": "R"}}.')
    for key, own in engines.items():  # at start: every block the run can use is valid
        try:
            HiLoReConfig.coerce(_over(base, own))
        except HiLoReConfigError as error:
            raise HiLoReConfigError(f'{ENV_CONFIG} "engines"[{key!r}]: {error}') from error
    source = ENV_CONFIG if os.environ.get(ENV_CONFIG, "").strip() else \
        f"the defaults ({ENV_CONFIG} unset)"
    chosen, keys = dict(base), []
    for key in (model_class, str(position)):
        if key in engines:
            chosen = _over(chosen, engines[key])
            keys.append(key)
    where = source + "".join(f" engines[{key!r}]" for key in keys)
    if len(keys) == 2:  # both blocks apply to this engine: checked together too
        try:
            HiLoReConfig.coerce(chosen)
        except HiLoReConfigError as error:
            raise HiLoReConfigError(f"{where}: {error}") from error
    return chosen, where


_BUDGETS = ("memory_budget", "memory_budget_bytes", "memory_fraction")  # one of them at a time


def _over(block: dict, own: dict) -> dict:
    """``block`` updated with ``own``; a budget in ``own`` replaces the block's, whatever its
    kind (the more specific block wins, NOTE [ Settings per engine ])."""
    if any(k in own for k in _BUDGETS):
        block = {k: v for k, v in block.items() if k not in _BUDGETS}
    return {**block, **own}


def fallback_block(environ=os.environ) -> dict:
    """The ``"hilore"`` block for a ds_config without one: DS_HILORE_CONFIG's, else the defaults.

    Raises:
        HiLoReConfigError: DS_HILORE is not a switch; DS_HILORE_CONFIG is neither JSON nor a
            readable JSON file, or does not hold an object.
    """
    switch = environ.get(ENV_SWITCH, "").strip()
    if switch and switch.lower() not in SWITCH_ON + SWITCH_OFF:
        raise HiLoReConfigError(
            f"{ENV_SWITCH}={switch!r} is not a switch. Fix: set {ENV_SWITCH}=1 to turn HiLoRe on for "
            f"every training deepspeed.initialize, {ENV_SWITCH}=0 to turn it off, or unset it.")
    text = environ.get(ENV_CONFIG, "").strip()
    return _read_block(text) if text else {}


def _read_block(text: str) -> dict:
    import hjson  # as DeepSpeed reads ds_config files

    inline = text.startswith("{")
    if not inline and not os.path.isfile(text):
        raise HiLoReConfigError(
            f"{ENV_CONFIG}={text!r} is neither inline JSON (it does not start with '{{') nor an existing "
            f"file. Fix: {ENV_CONFIG}='{{\"force_plan\": \"H\"}}', or the path of a JSON file holding the "
            '"hilore" block or a whole ds_config.')
    try:
        if inline:
            block = hjson.loads(text)
        else:
            with open(text, encoding="utf-8") as f:
                block = hjson.load(f)
    except (ValueError, OSError) as err:
        where = "its inline JSON" if inline else f"the file {text}"
        raise HiLoReConfigError(f"{ENV_CONFIG}: {where} does not parse: {err}. Fix: write the "
                                '"hilore" block as a JSON object, e.g. {"force_plan": "H"}.') from None
    if isinstance(block, dict) and "hilore" in block:
        block = block["hilore"]  # a whole ds_config
    if not isinstance(block, dict):
        raise HiLoReConfigError(f"{ENV_CONFIG} holds {block!r}; the \"hilore\" block must be a JSON object "
                                'such as {"force_plan": "H"}.')
    return dict(block)
