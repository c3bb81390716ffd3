"""Re-runs of a decoder layer from its inputs, with the forward's RNG and autocast state.

NOTE [ Recompute ]
The re-run captures only the units that need it and stops as soon as the last of them is done.
A unit kept in H/L that precedes one being recomputed is fast-forwarded: its child modules are
swapped for stand-ins returning the cached output of the unit (retained at forward only when
the capture plan needs it) or shape-only placeholders for outputs that never leave the unit.
Skipping a unit skips its RNG draws, so the RNG state is snapshotted at every unit's entry in
forward (only when it differs from the previous snapshot) and restored there on re-run, and at
a fast-forwarded unit's exit, restored by its last stand-in, for layer-body code between units
(OPT's dropout after the attention); without them later dropout masks would silently differ.
A unit whose other children feed a later unit (a parallel block sharing a norm) is re-run, not
fast-forwarded. Recomputed tensors refill slots by their order within the unit, checked
against the forward's shapes and dtypes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ds_hilore._errors import HiLoReError, bug


class StopReplay(Exception):
    """Raised inside a re-run once everything it was run for has been regenerated."""


# --------------------------------------------------------------------------- RNG and autocast

class RngState:
    """The CPU RNG stream and the stream of the hidden state's device, captured together."""

    __slots__ = ("cpu", "where", "device")

    def __init__(self, where: torch.device | str):
        self.where = torch.device(where)
        self.cpu = torch.get_rng_state()
        self.device = None
        if self.where.type not in ("cpu", "meta"):
            module = torch.get_device_module(self.where.type)
            index = self.where.index if self.where.index is not None else module.current_device()
            self.device = (index, module.get_rng_state(index))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(self.where.type).set_rng_state(self.device[1], self.device[0])

    def same_as(self, other: "RngState") -> bool:
        return torch.equal(self.cpu, other.cpu) and (
            self.device is None or torch.equal(self.device[1], other.device[1]))

    def nbytes(self) -> int:
        """Bytes it holds in its device's memory: the states are host tensors, so an
        accelerator's memory holds none of them."""
        states = [self.cpu] + ([self.device[1]] if self.device is not None else [])
        return sum(s.untyped_storage().nbytes() for s in states if s.device.type == self.where.type)


def autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
            for d in dict.fromkeys(("cpu", device_type))]


@contextlib.contextmanager
def replay_autocast(state, cache_enabled: bool):
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                               cache_enabled=cache_enabled))
        yield


# --------------------------------------------------------------------------- re-runs

def placeholder(x) -> torch.Tensor:
    """A stand-in for a fast-forwarded output nobody may read: NaN (integers: their minimum),
    so that any wrong use shows instead of silently computing with zeros. ``x``: a tensor or
    its (shape, dtype, device) spec."""
    shape, dtype, device = (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x
    value = (float("nan") if dtype.is_floating_point or dtype.is_complex else
             False if dtype == torch.bool else torch.iinfo(dtype).min)
    return torch.full((), value, dtype=dtype, device=device).expand(shape)


def _spec(x):
    return (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x


def _detach_like(output):
    return tree_map(lambda x: x.detach().requires_grad_(x.requires_grad)
                    if isinstance(x, torch.Tensor) else x, output)


class FastForward:
    """What a fast-forwarded child call hands on in a re-run (NOTE [ Recompute ]): the outputs
    in the split's cut, NaN placeholders for the rest, and the RNG state at the call's exit."""

    __slots__ = ("leaves", "spec", "rng")

    def __init__(self, output, call: int, cut, rng: RngState | None):
        leaves, self.spec = tree_flatten(output)
        self.leaves = [x.detach().requires_grad_(x.requires_grad) if (call, i) in cut else _spec(x)
                       if isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves)]
        self.rng = rng

    def __call__(self):
        if self.rng is not None:
            self.rng.restore()
        return tree_unflatten([placeholder(x) if _is_spec(x) else x for x in self.leaves], self.spec)

    def nbytes(self) -> int:
        """Bytes of the outputs it keeps (its RNG state: ``RngState.nbytes``)."""
        return sum(x.untyped_storage().nbytes() for x in self.leaves if isinstance(x, torch.Tensor))


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], torch.dtype)


class _Router(nn.Module):
    """Takes a child's place during a re-run; routes each call by its position (``Replay``)."""

    def __init__(self, replay: "Replay", name: str, original: nn.Module):
        super().__init__()
        self.replay, self.name = replay, name
        self.__dict__["original"] = original  # not a submodule: no second registration

    def forward(self, *args, **kwargs):
        return self.replay.route(self.name, self.original, args, kwargs)

    # a layer may read a child instead of calling it (Mamba's self.norm.weight, a ModuleList
    # indexed or iterated): everything but the call goes to the original
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["original"], name)

    def __getitem__(self, index):
        return self.__dict__["original"][index]

    def __iter__(self):
        return iter(self.__dict__["original"])

    def __len__(self) -> int:
        return len(self.__dict__["original"])

    def __bool__(self) -> bool:  # a module is truthy; __len__ must not decide it
        return True


class Replay:
    """One re-run of a decoder layer from its inputs (NOTE [ Recompute ]).

    Every child is routed by call position: a call in ``skip`` returns ``skip[call]()`` (a
    fast-forward), a call at or after ``stop_call`` ends the re-run, any other call runs.
    ``on_save(segment, tensor)`` sees every tensor the re-run saves (segments as in units.py)
    and raises ``StopReplay`` when it has what it needs: the re-run stops inside that op, as
    torch's non-reentrant checkpoint does -- running on to the end of the module would fire
    its post-forward hooks, and ZeRO-3's would release the parameters the backward just
    gathered. ``on_call(call, args, kwargs)``, if given, sees every call that runs, before it
    runs. The training RNG stream is left where it was.
    """

    def __init__(self, module: nn.Module, calls: tuple[str, ...], skip: dict[int, Callable],
                 on_save: Callable[[int, torch.Tensor], None], stop_call: int | None = None,
                 on_call: Callable[[int, tuple, dict], None] | None = None):
        self.module, self.calls, self.skip, self.on_save = module, calls, skip, on_save
        self.stop_call, self.on_call = stop_call, on_call
        self.call = 0
        self.segment = 0

    def run(self, fn: Callable, args: tuple, rng: RngState) -> None:
        args = tuple(_detach_like(a) for a in args)
        if isinstance(fn, functools.partial) and fn.keywords:  # detach keyword tensors too
            fn = functools.partial(fn.func, *fn.args, **_detach_like(fn.keywords))
        outer = RngState(rng.where)
        swapped = dict(self.module._modules)
        try:
            for name, child in swapped.items():
                if child is not None:
                    self.module._modules[name] = _Router(self, name, child)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, _never_unpacked):
                rng.restore()
                try:
                    fn(*args)
                except StopReplay:
                    pass
        finally:
            self.module._modules.update(swapped)
            outer.restore()

    def route(self, name: str, original: nn.Module, args, kwargs):
        call = self.call
        self.call += 1
        if call >= len(self.calls) or self.calls[call] != name:
            raise HiLoReError(f"a re-run of {type(self.module).__name__} called {name!r} as call "
                              f"{call}, the forward called {list(self.calls)}")
        if self.stop_call is not None and call >= self.stop_call:
            raise StopReplay
        if call in self.skip:
            out = self.skip[call]()
        else:
            if self.on_call is not None:
                self.on_call(call, args, kwargs)
            self.segment = 2 * call + 1
            out = original(*args, **kwargs)
        self.segment = 2 * call + 2
        return out

    def _pack(self, t: torch.Tensor) -> None:
        self.on_save(self.segment, t)
        return None



def _never_unpacked(_):
    raise bug("a tensor saved during recompute was unpacked")
