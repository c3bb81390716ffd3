"""Find a decoder layer's recovery units from its own execution, and prove them exact.

NOTE [ Discovery ]
The first call (with gradients) of each decoder-layer class runs once as plain autograd under
a recorder that sees, in order: every child-module call (its inputs and outputs), every op of
the layer-body code between the calls (a ``TorchFunctionMode``), and every tensor autograd
saves. Outputs of child calls are labelled; body ops propagate the labels; so for every read
we know which child outputs it depends on.

A split after call ``k`` makes two units, calls ``0..k`` and ``k+1..``. Fast-forwarding the
first unit in a re-run (its calls return cached outputs) is exact only if the re-run sees
exactly the values the forward saw, so the split's *cut* is every first-unit output that
anything after the split reads -- directly or through body code -- up to the layer's last
saved tensor (a re-run stops there). The cut is what the fast-forward must keep; every other
output of a fast-forwarded call becomes a NaN placeholder, so a wrong use cannot go unseen.
(The bug this replaces: a unit handed on only its last child's output, and MiniMax's layer
reads ``residual = input_layernorm(x)`` after the attention -- it got zeros, silently.)

Candidates are ranked by the cut's bytes (the memory a fast-forward costs), then by whether
the second unit starts at a residual boundary (its first call reads body-code output, not a
raw child output: post-norms stay with the block they normalise), then by balance of saved
bytes. The first candidate that *verifies* wins; none -> the layer is one unit.

Verification, on the discovery call's own inputs: (1) a full re-run with the forward's RNG
must reproduce every saved tensor (else the layer keeps state across calls and is refused);
(2) a re-run with the first unit fast-forwarded must reproduce every tensor the second unit
saves. Bitwise on deterministic devices; where the device's kernels are not reproducible, a
close match counts (as exact as gradient checkpointing there), and NaN never does.

One kind of saved tensor is not compared: the RNG state that a fused attention kernel run
without dropout returns and saves for its backward (CUDA's flash, memory-efficient and cuDNN
attention: a philox seed and offset). Without dropout nothing reads it, and the kernel leaves
it uninitialised, so two identical calls save different values. The recorder marks the
integer outputs of every op called with ``dropout_p == 0`` (a ``TorchDispatchMode``); both
sides must still save them, with the same shape and dtype.
"""

from __future__ import annotations

import logging
import os
import traceback
import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ds_hilore._errors import HiLoReError, HiLoReNameError
from ds_hilore.runtime.replay import (
    Replay,
    RngState,
    autocast_state,
    placeholder,
    replay_autocast,
)
from ds_hilore.runtime.units import LayerUnits, Split

logger = logging.getLogger("ds_hilore")

_MAX_VERIFIED = 4  # candidate splits tried, best first
_PROBE_SHAPE = (2, 8)  # (B, T) of the token ids the attach-time probe forward runs on
_TOLERANCE = dict(rtol=1e-3, atol=1e-5)  # "close" where kernels are not bitwise reproducible,
# widened to two units in the last place of a low-precision dtype (one bf16 ulp is 0.8 %)


class _Trace:
    """What one decoder-layer call did (NOTE [ Discovery ])."""

    def __init__(self, device: torch.device, is_weight: Callable[[torch.Tensor], bool]):
        self.device, self.is_weight = device, is_weight
        self.calls: list[str] = []
        self.outputs: list[tuple[list, object]] = []  # (flat leaves, treespec) per call
        self.exit_rng: list[RngState] = []
        self.saves: list[tuple[int, int, torch.Tensor]] = []  # (event, segment, tensor)
        self.weights: set[int] = set()  # indices into saves that are weights (never compared:
        # under ZeRO-3 a weight's storage is released after the forward)
        self.unread: list[torch.Tensor] = []  # RNG state of dropout-free kernels (NOTE above)
        self.unread_saves: set[int] = set()  # indices into saves that are such state
        self.reads: list[tuple[int, int, frozenset, frozenset]] = []  # event, segment, labels, raw
        self.segment = 0
        self.event = 0
        self.depth = 0
        self._labels: dict[int, frozenset] = {}  # id(tensor) -> {(call, leaf)}
        self._raw: dict[int, tuple[int, int]] = {}  # id of a child output leaf -> (call, leaf)
        self._keep: list[torch.Tensor] = []  # labelled tensors stay alive: ids stay unique

    def read(self, values) -> None:
        labels, raw = set(), set()
        for x in tree_flatten(values)[0]:
            if isinstance(x, torch.Tensor):
                labels |= self._labels.get(id(x), frozenset())
                if id(x) in self._raw:
                    raw.add(self._raw[id(x)])
        if labels:
            self.reads.append((self.event, self.segment, frozenset(labels), frozenset(raw)))
            self.event += 1

    def label(self, values, labels: frozenset) -> None:
        if not labels:
            return
        for x in tree_flatten(values)[0]:
            if isinstance(x, torch.Tensor):
                self._labels[id(x)] = self._labels.get(id(x), frozenset()) | labels
                self._keep.append(x)

    def enter(self, name: str, args, kwargs) -> None:
        if self.depth == 0:
            self.segment = 2 * len(self.calls) + 1
            self.calls.append(name)
            self.read((args, kwargs))
        self.depth += 1

    def leave(self, output) -> None:
        self.depth -= 1
        if self.depth:
            return
        call = len(self.calls) - 1
        leaves, spec = tree_flatten(output)
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                self._labels[id(x)] = frozenset({(call, i)})
                self._raw[id(x)] = (call, i)
                self._keep.append(x)
        self.outputs.append((leaves, spec))
        self.exit_rng.append(RngState(self.device))
        self.segment = 2 * call + 2

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.is_weight(t):
            self.weights.add(len(self.saves))
        elif not t.is_floating_point() and any(
                t is u or (t.device == u.device and t.data_ptr() == u.data_ptr())
                for u in self.unread):
            self.unread_saves.add(len(self.saves))
        self.saves.append((self.event, self.segment, t))
        self.event += 1
        return t


class _UnreadRng(TorchDispatchMode):
    """Marks the integer outputs of ops called with ``dropout_p == 0`` (NOTE [ Discovery ])."""

    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _dropout_p(func, args, kwargs) == 0:
            self.trace.unread.extend(  # kept alive: their data pointers stay unique
                x for x in tree_flatten(out)[0]
                if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.numel())
        return out


def _dropout_p(func, args, kwargs):
    """The ``dropout_p`` an op is called with, or None when it takes none."""
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "dropout_p":
            if arg.name in kwargs:
                return kwargs[arg.name]
            return args[i] if i < len(args) else arg.default_value
    return None


class _BodyOps(TorchFunctionMode):
    """Labels the results of layer-body ops (outside child calls) by what they read."""

    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trace = self.trace
        if trace.depth:
            return func(*args, **kwargs)
        before = len(trace.reads)
        trace.read((args, kwargs))
        out = func(*args, **kwargs)
        if len(trace.reads) > before:
            trace.label(out, trace.reads[-1][2])
        return out


def probe(root: nn.Module) -> str | None:
    """Run one small training-mode forward of the transformers model inside ``root``, so that
    every layer call goes through discovery at attach; None, or why it could not run.

    The input is known for a causal LM (token ids). The layers' inputs require grad, as in
    training (frozen embeddings under LoRA would otherwise save less). RNG streams and module
    modes are left as they were, and nothing is kept.

    Raises:
        HiLoReError: a layer was refused or an override could not be verified.
    """
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return "no transformers model to probe"
    model = next((m for m in root.modules() if isinstance(m, PreTrainedModel)), None)
    if model is None:
        return f"{type(root).__name__} holds no transformers model to probe"
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    vocab = getattr(model.config.get_text_config(), "vocab_size", None) or 2
    ids = torch.randint(vocab, _PROBE_SHAPE, generator=torch.Generator().manual_seed(0)).to(device)
    modes = [(m, m.training) for m in root.modules()]
    devices = [device.index or 0] if device.type not in ("cpu", "meta") else []
    embeddings = model.get_input_embeddings()
    hook = embeddings.register_forward_hook(lambda m, a, out: out.requires_grad_(True)) \
        if embeddings is not None else None
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes on caching under checkpointing are not news
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type), torch.enable_grad():
            root.train()
            model(input_ids=ids, attention_mask=torch.ones_like(ids))  # as training calls it
    except HiLoReError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a model-specific input need: discover later
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return (f"the probe forward of {type(model).__name__} failed: {type(exc).__name__}"
                f"({str(exc) or 'no message'}) at {os.path.basename(where.filename)}:{where.lineno} "
                f"`{where.line}` (the probe passes input_ids and attention_mask only)")
    finally:
        hf_logging.set_verbosity(verbosity)
        if hook is not None:
            hook.remove()
        for module, training in modes:
            module.training = training
    return None


def record(layer: LayerUnits, fn: Callable, args: tuple, device: torch.device, is_weight):
    """Run the layer once as plain autograd under the recorder; returns (output, trace)."""
    trace = _Trace(device, is_weight)
    handles = []
    for name, child in layer.module.named_children():
        handles.append(child.register_forward_pre_hook(
            lambda m, a, k, name=name: trace.enter(name, a, k), with_kwargs=True))
        handles.append(child.register_forward_hook(lambda m, a, out: trace.leave(out)))
    # the graph keeps its saved-tensor hooks, and the trace keeps that graph's tensors: a hook
    # holding the trace would make a cycle through C++ that Python's collector cannot see, and
    # keep the trace, its ``is_weight`` (the runtime) and the model alive after ``detach``
    ref = weakref.ref(trace)
    try:
        with _BodyOps(trace), _UnreadRng(trace), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: ref().pack(t), lambda t: t):
            out = fn(*args)
    finally:
        for h in handles:
            h.remove()
    return out, trace


def discover(layer: LayerUnits, fn: Callable, args: tuple, device: torch.device,
             is_weight: Callable[[torch.Tensor], bool], collective=None):
    """Run a layer call under discovery; returns its output and the verified ``Split``.

    ``is_weight(t)``: whether a saved tensor is a parameter (or a view or cast of one).
    ``collective``: the runtime's, under several ranks: one split for every rank (NOTE [ One
    split for every rank ]); every rank calls this for the same layers in the same order.

    Raises:
        HiLoReError: a re-run of the layer does not reproduce its saved tensors (state kept
            across calls); HiLoReNameError: the ``attn_children`` / ``mlp_children`` override
            cannot be made exact.
    """
    rng = RngState(device)
    autocast, cache = autocast_state(device.type), torch.is_autocast_cache_enabled()
    out, trace = record(layer, fn, args, device, is_weight)
    after = RngState(device)
    check = _Checker(layer, fn, args, trace, rng, autocast, cache, collective)
    try:
        full = check.verify(None)
        if full is None:
            raise HiLoReError(
                f"decoder layer {layer.name!r} ({type(layer.module).__name__}) cannot be recomputed: "
                "re-running its forward from the same inputs and RNG state does not reproduce the "
                "tensors it saved (it keeps state across calls, e.g. a cache or a running "
                f"statistic; {check.mismatch or 'on another rank'}). Exclude it with "
                "'layer_pattern' in the \"hilore\" block, or disable hilore for this model.")
        split = _choose(layer, trace, check, full)
    finally:
        after.restore()  # verification never moves the training RNG
    logger.debug("ds_hilore: %s -> %d unit(s), calls %s, boundary %s, verified %s",
                 type(layer.module).__name__, split.n_units, split.calls, split.boundary,
                 split.verified)
    return out, split


def _choose(layer: LayerUnits, trace: _Trace, check: "_Checker", full: str) -> Split:
    calls = tuple(trace.calls)
    if layer.names is not None:  # the override: one fixed split, verified or refused
        k = _override_split(layer, calls)
        cut = _cut(trace, k)
        verified = check.verify(k, cut)
        if verified is None:
            raise HiLoReNameError(
                f"the hilore.attn_children / mlp_children override splits decoder layer "
                f"{layer.name!r} ({type(layer.module).__name__}) where a re-run of the mlp unit "
                "does not reproduce its saved tensors. Remove both keys to let ds_hilore find the "
                "units from the layer's execution.")
        return Split(calls, 2 * k + 1, cut, _worst(full, verified))
    ranked = [k for k, _ in _candidates(layer, trace)]
    if check.collective is not None:  # NOTE [ One split for every rank ]
        ranked = check.collective.broadcast_object(ranked)
    for k in ranked[:_MAX_VERIFIED]:
        cut = _cut(trace, k) if k < len(calls) - 1 else None
        verified = check.verify(k, cut)
        if verified is not None:
            return Split(calls, 2 * k + 1, cut, _worst(full, verified))
    return Split(calls, None, frozenset(), full)


def _worst(a: str, b: str) -> str:
    return "tolerance" if "tolerance" in (a, b) else "bitwise"


def _override_split(layer: LayerUnits, calls: tuple[str, ...]) -> int:
    positions = [layer.names[c] for c in calls]
    if 1 not in positions or 0 not in positions or positions != sorted(positions):
        raise HiLoReNameError(
            f"decoder layer {layer.name!r} ({type(layer.module).__name__}) calls its children in "
            f"the order {list(calls)}: the hilore.attn_children must all run before the "
            "'mlp_children' (a unit is a contiguous run of calls). Remove both keys to let "
            "ds_hilore find the units from the layer's execution.")
    return positions.index(1) - 1


def _cut(trace: _Trace, k: int) -> frozenset:
    """First-unit outputs read after a split after call ``k`` (up to the last save)."""
    boundary = 2 * k + 1
    last_save = trace.saves[-1][0] if trace.saves else -1
    cut = set()
    for event, segment, labels, _ in trace.reads:
        if segment > boundary and event <= last_save:
            cut |= {x for x in labels if x[0] <= k}
    return frozenset(cut)


def _candidates(layer: LayerUnits, trace: _Trace) -> list[tuple[int, frozenset]]:
    def activation_bytes(saves) -> int:
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saves}
        return sum(seen.values())

    activations = [s for i, s in enumerate(trace.saves) if i not in trace.weights]
    ranked = []
    for k in range(len(trace.calls) - 1):
        boundary = 2 * k + 1
        first = [t for _, segment, t in activations if segment <= boundary]
        second = [t for _, segment, t in activations if segment > boundary]
        if not activation_bytes(first) or not activation_bytes(second):
            continue  # a unit that keeps nothing is no unit
        cut = _cut(trace, k)
        cut_bytes = sum(trace.outputs[c][0][i].untyped_storage().nbytes() for c, i in cut)
        # the second unit's first call reads a raw first-unit output: not a residual boundary
        raw = any(c <= k for _, segment, _, r in trace.reads if segment == 2 * k + 3 for c, _ in r)
        balance = abs(activation_bytes(first) - activation_bytes(second))
        ranked.append(((cut_bytes, raw, balance, k), k, cut))
    return [(k, cut) for _, k, cut in sorted(ranked, key=lambda r: r[0])]


# NOTE [ One split for every rank ]
# A layer's split is found from this rank's call: candidates ranked by this rank's byte
# counts (its microbatch's shape, at a first training forward), and verified against its own
# kernels, where a close match may count on one rank and not on another. Two ranks that
# split a layer differently recompute different children, and under ZeRO-3 or FSDP gather
# different parameters (NOTE [ One decision for every rank ] in collective.py). So under
# several ranks the candidates are rank 0's ranking (a broadcast), each verified on every
# rank, and a verification holds only where it holds on every rank: "bitwise" where every
# rank's is, "tolerance" where one rank's is, failed where one rank's failed (an all-reduce
# of max). A full re-run that fails on one rank refuses the layer on every rank. Discovery
# runs once per layer kind (at attach, or at the first training forward), on every rank at
# the same layer call.
_VERDICTS = ("bitwise", "tolerance", None)  # by rank: the max over ranks is the verdict


class _Checker:
    """Re-runs the discovery call and compares what it saves (NOTE [ Discovery ])."""

    def __init__(self, layer, fn, args, trace: _Trace, rng, autocast, cache, collective=None):
        self.layer, self.fn, self.args, self.trace = layer, fn, args, trace
        self.rng, self.autocast, self.cache = rng, autocast, cache
        self.collective = collective  # NOTE [ One split for every rank ]
        self.mismatch = ""  # the last verification's first difference, for the error

    def verify(self, k: int | None, cut: frozenset | None = frozenset()) -> str | None:
        """``"bitwise"``, ``"tolerance"`` or None (not reproduced), on every rank (NOTE [ One
        split for every rank ]). ``k`` None: a full re-run; ``cut`` None: a split this rank's
        call has no place for (it failed here)."""
        verdict = self._verify(k, cut) if cut is not None else None
        if self.collective is None:
            return verdict
        worst = self.collective.all_reduce_max([_VERDICTS.index(verdict)])[0]
        return _VERDICTS[worst]

    def _verify(self, k: int | None, cut: frozenset) -> str | None:
        boundary = -1 if k is None else 2 * k + 1
        expected = [None if i in self.trace.weights else t
                    for i, (_, segment, t) in enumerate(self.trace.saves) if segment > boundary]
        got: list[torch.Tensor | None] = []

        def on_save(segment: int, t: torch.Tensor) -> None:
            # no early stop: in a forward, ZeRO-3 expects every module it gathered for to finish
            if segment > boundary:
                got.append(None if self.trace.is_weight(t) else t.detach())

        skip = {} if k is None else {c: self._fast_forward(c, cut) for c in range(k + 1)}
        replay = Replay(self.layer.module, tuple(self.trace.calls), skip, on_save)
        try:
            with replay_autocast(self.autocast, self.cache):
                replay.run(self.fn, self.args, self.rng)
        except HiLoReError as exc:
            self.mismatch = f"the re-run took another path: {exc}"
            return None  # the re-run took another path through the children
        if len(got) != len(expected):
            self.mismatch = f"the re-run saved {len(got)} tensors, the forward {len(expected)}"
            return None
        unread = [i in self.trace.unread_saves
                  for i, (_, segment, _) in enumerate(self.trace.saves) if segment > boundary]
        for j in (j for j, skip in enumerate(unread) if skip):  # both saved it: shape, dtype
            a, b = expected[j], got[j]
            if b is None or a.shape != b.shape or a.dtype != b.dtype:
                self.mismatch = _unlike(j, a, b)
                return None
            expected[j] = got[j] = None
        result, self.mismatch = _compare(expected, got)
        return result

    def _fast_forward(self, call: int, cut: frozenset):
        leaves, spec = self.trace.outputs[call]
        kept = [x.detach().requires_grad_(x.requires_grad)
                if isinstance(x, torch.Tensor) and (call, i) in cut else
                placeholder(x) if isinstance(x, torch.Tensor) else x
                for i, x in enumerate(leaves)]
        rng = self.trace.exit_rng[call]

        def make():
            rng.restore()
            return tree_unflatten(kept, spec)
        return make


def _describe(t) -> str:
    return "a weight" if t is None else f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _unlike(j: int, a, b) -> str:
    return f"saved tensor {j}: {_describe(a)} then {_describe(b)}"


def _compare(expected: list, got: list) -> tuple[str | None, str]:
    """``("bitwise" | "tolerance" | None, the first difference)``."""
    result = "bitwise"
    for j, (a, b) in enumerate(zip(expected, got)):
        where = f"saved tensor {j} ({_describe(a)})"
        if a is None or b is None:  # weights: never compared, but both sides must agree
            if (a is None) != (b is None):
                return None, _unlike(j, a, b)
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return None, _unlike(j, a, b)
        if torch.equal(a.detach(), b):
            continue
        if not a.is_floating_point():
            return None, f"{where} differs"
        if b.isnan().any() and not a.isnan().any():
            return None, f"{where} is NaN on the re-run"
        rtol = max(_TOLERANCE["rtol"], 2 * torch.finfo(a.dtype).eps)
        if not torch.allclose(a.detach().float(), b.float(), equal_nan=True, rtol=rtol,
                              atol=_TOLERANCE["atol"]):
            diff = float((a.detach().float() - b.float()).abs().max())
            return None, f"{where} differs by up to {diff:.3g}, beyond rtol {rtol:g}"
        result = "tolerance"
    return result, ""
