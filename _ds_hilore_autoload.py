"""Interpreter-start half of ds_hilore's zero-code-change path (NOTE [ Autoload ] in
ds_hilore/integrations/autoload.py).

``ds_hilore_autoload.pth`` imports this module at interpreter start when DS_HILORE or
DS_HILORE_CONFIG is set. It holds only what must exist before deepspeed is imported -- the
switch, the import hook, the stand-in for ``deepspeed.initialize`` -- and imports nothing but
``sys`` and ``os``, so that it costs about a millisecond. It lives outside the ds_hilore
package because importing anything in the package runs ``ds_hilore/__init__``, which imports
torch and deepspeed. Everything decided at call time is in ds_hilore/integrations/autoload.py.
"""

import os
import sys

ENV_SWITCH = "DS_HILORE"
ENV_CONFIG = "DS_HILORE_CONFIG"
SWITCH_OFF = ("0", "false", "no", "off")


def switched_on(environ=os.environ) -> bool:
    """Whether the variables ask for HiLoRe. A malformed DS_HILORE counts as on, so that the
    first training ``deepspeed.initialize`` reports it instead of training without HiLoRe."""
    switch = environ.get(ENV_SWITCH, "").strip().lower()
    if switch in SWITCH_OFF:
        return False
    return bool(switch) or bool(environ.get(ENV_CONFIG, "").strip())


def switched_off(environ=os.environ) -> bool:
    """Whether DS_HILORE says off (``0``, ``false``, ``no``, ``off``): off on every path."""
    return environ.get(ENV_SWITCH, "").strip().lower() in SWITCH_OFF


def install(explicit=False) -> bool:
    """Make every training ``deepspeed.initialize`` a ``ds_hilore.initialize`` in this process:
    at once if deepspeed is imported, else right after its import. ``explicit`` (``python -m
    ds_hilore.run``): on unless DS_HILORE turns it off. Returns whether the replacement is (or
    will be) in place."""
    if switched_off() or not (explicit or switched_on()):
        return False
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "initialize"):
        _replace(deepspeed)
    elif not any(isinstance(finder, _DeepSpeedImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedImportHook())
    return True


def _replace(deepspeed):
    if not isinstance(deepspeed.initialize, TrainingInitialize):
        deepspeed.initialize = TrainingInitialize(deepspeed.initialize)


class TrainingInitialize:
    """Stands in for ``deepspeed.initialize``: same signature, same result; training engines
    come from ``ds_hilore.initialize``.

    Attributes:
        deepspeed_initialize: the function it replaced; ds_hilore.initialize calls this one.
    """

    def __init__(self, deepspeed_initialize):
        import functools

        functools.update_wrapper(self, deepspeed_initialize)
        self.deepspeed_initialize = deepspeed_initialize

    def __call__(self, *args, **kwargs):
        from ds_hilore.integrations.autoload import initialize  # deepspeed is imported: ds_hilore may be too

        return initialize(self, args, kwargs)


class _DeepSpeedImportHook:
    """Meta-path finder: replaces ``deepspeed.initialize`` once deepspeed's ``__init__`` ran."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, self)
        return spec

    def imported(self, deepspeed):
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _replace(deepspeed)


class _PatchingLoader:
    """deepspeed's own loader, plus the replacement after ``exec_module``."""

    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # The module keeps deepspeed's loader (resource readers, inspect, reload use it).
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.hook.imported(module)

    def __getattr__(self, name):  # is_package, get_code, get_resource_reader, ...
        return getattr(self.loader, name)
