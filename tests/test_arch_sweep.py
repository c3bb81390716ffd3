"""Every causal-LM architecture of the installed transformers under HiLoRe's exact plans.

For each ``model_type`` that ``ds_hilore.bench.zoo`` builds small (2 layers, hidden 64, dropout 0.1
wherever the config has one, eager attention, fp32), the gradients of every parameter and of
the input embeddings are computed

* without checkpointing (the reference),
* under HF's own non-reentrant gradient checkpointing, and
* with ``ds_hilore.attach(model, {"low_precision": "none"})`` -- default unit discovery -- under
  all-H, all-R, two per-unit H/R alternations and a per-sequence H/E/H split whose loss gives
  the elided sequence weight 0 (in the reference too).

Outcomes (one row each in the table printed at the end with ``-s``):

* exact   -- every plan's loss and gradients are bitwise equal to the reference, or, where HF
             checkpointing itself is not bitwise on this machine, no further from it than HF
             checkpointing is (NOTE [ Exact relative to the machine's own checkpointing ] in
             tests/models.py); and every unit ran the planned action.
* refused -- ``attach`` raised ``HiLoReError`` naming the layer class and why. Allowed.
* skipped -- the architecture cannot be built small, or fails without HiLoRe; the reason is
             shown. Allowed.
* WRONG   -- a gradient further off than that, a plan not applied, a refusal that does not
             name the layer class, or any other exception. Fails the test.

The representative architectures (``REPRESENTATIVE``) always run (~1.5 min); the others carry
the ``sweep`` marker, deselected by default (pytest.ini): ``pytest -m "sweep or not sweep"
tests/test_arch_sweep.py -s`` runs every causal LM of the installed transformers (~15 min of
CPU time on 2 cores).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch
from models import beyond_gc, gc_loss_and_grads, loss_and_grads

import ds_hilore
from ds_hilore import HiLoReError
from ds_hilore.bench import zoo

REPRESENTATIVE = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3", "gpt_neox",
                  "cohere", "opt", "qwen3_moe", "mixtral",
                  "minimax")  # minimax once attached with gradients silently wrong
CONFIG = {"low_precision": "none"}
# per-sequence loss weights: "elided" gives sequence 1 weight 0 (the H/E/H split elides it)
LOSSES = {"plain": None, "elided": torch.tensor([1.0, 0.0, 1.0])}


@dataclass
class Row:
    """One architecture's line of the table."""

    arch: str
    result: str = "?"           # exact | refused | skipped | WRONG
    detail: str = ""
    model: str = ""
    units: int | None = None
    kinds: str = ""
    gc: str = ""                # HF checkpointing vs no checkpointing on this machine
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def table():
    rows: dict[str, Row] = {}
    start = time.perf_counter()
    yield rows
    print("\n" + format_table(rows.values(), time.perf_counter() - start))


def _arch_params():
    for arch in zoo.causal_lm_types():
        marks = () if arch in REPRESENTATIVE else (pytest.mark.sweep,)
        yield pytest.param(arch, marks=marks, id=arch)


def test_representative_architectures_are_registered():
    assert set(REPRESENTATIVE) <= set(zoo.causal_lm_types())


@pytest.mark.parametrize("arch", list(_arch_params()))
def test_exact_plans_as_exact_as_hf_checkpointing(arch, table):
    start = time.perf_counter()
    row = table[arch] = Row(arch)
    try:
        sweep(row)
    finally:
        row.seconds = time.perf_counter() - start
    if row.result == "skipped":
        pytest.skip(row.detail)
    assert row.result in ("exact", "refused"), f"{arch}: {row.detail}"


# ---------------------------------------------------------------------------------- one arch
def sweep(row: Row) -> None:
    """Fill ``row`` with the outcome of one architecture (see the module docstring)."""
    try:
        model = zoo.tiny_causal_lm(row.arch)
    except zoo.ZooSkip as skip:
        row.result, row.detail = "skipped", skip.reason
        return
    row.model = type(model).__name__
    inputs = zoo.tiny_batch(model)
    try:
        references = {loss: _run(model, inputs, loss) for loss in LOSSES}
    except Exception as error:  # noqa: BLE001 -- the model fails on its own, HiLoRe not attached
        row.result, row.detail = "skipped", f"fails without HiLoRe: {_short(error)}"
        return
    baselines = {loss: _gc_run(model, inputs, loss, row) for loss in LOSSES}
    row.gc = _describe_gc(references["plain"], baselines["plain"])
    try:
        runtime = ds_hilore.attach(model, CONFIG)
    except HiLoReError as error:
        _refused(row, model, error)
        return
    except Exception as error:  # noqa: BLE001 -- reported as a failure of ds_hilore
        row.result, row.detail = "WRONG", f"attach raised {_short(error)}"
        return
    try:
        problems = _check_plans(model, runtime, inputs, references, baselines, row)
    finally:
        runtime.detach()
    row.units = len(runtime.units)
    row.kinds = "/".join(dict.fromkeys(u.kind for u in runtime.units))
    if not runtime.units:
        problems.insert(0, "attach found no recovery unit and said nothing")
    row.result = "WRONG" if problems else "exact"
    row.detail = "; ".join(problems[:3]) if problems else "; ".join(row.notes)


def _check_plans(model, runtime, inputs, references, baselines, row: Row) -> list[str]:
    problems = []
    for label, plan, rows in _plans(runtime):
        loss = "elided" if rows else "plain"
        try:
            runtime.set_plan(plan, rows=rows)
            got = _run(model, inputs, loss)
        except Exception as error:  # noqa: BLE001 -- any exception under a plan is a failure
            problems.append(f"{label}: raised {_short(error)}")
            continue
        off = beyond_gc(references[loss], baselines[loss] or references[loss], got)
        if off:
            problems.append(f"{label}: {len(off)} tensors off, e.g. {off[0]}")
        expected = [plan if isinstance(plan, str) else plan[u.name] for u in runtime.units]
        actions = [u.action for u in runtime.units]
        if rows and actions == ["R"] * len(actions):
            row.notes.append("H/E split fell back to R (gradient reached the elided sequence)")
        elif rows and all(a in (e, "R") for a, e in zip(actions, expected)):
            # a layer whose call returns a second tensor that requires grad (attention weights
            # of eager attention) never elides: its units fall back to R, exactly
            row.notes.append(f"H/E split: {actions.count('R')} of {len(actions)} units fell back to R")
        elif actions != expected:
            problems.append(f"{label}: units ran {''.join(actions)}, planned {''.join(expected)}")
    return problems


def _plans(runtime):
    """(label, set_plan's plan, set_plan's rows) for every exact plan of the sweep.

    A generator: the per-unit plans are made after all-H and all-R ran, from the units the
    runtime knows then (units found at the first forward included).
    """
    yield "all-H", "H", None
    yield "all-R", "R", None
    units = runtime.units
    alternate = {u.name: "HR"[i % 2] for i, u in enumerate(units)}
    yield "H/R alternating", alternate, None
    yield "R/H alternating", {name: "RH"["HR".index(a)] for name, a in alternate.items()}, None
    yield "H/E/H rows", "H", {u.name: ("H", "E", "H") for u in units}


def _run(model, inputs, loss: str) -> dict[str, torch.Tensor]:
    value, grads = loss_and_grads(model, inputs, row_weights=LOSSES[loss])
    return {"<loss>": value, **grads}


def _gc_run(model, inputs, loss: str, row: Row) -> dict[str, torch.Tensor] | None:
    """HF checkpointing's result, or None (then the plans must be bitwise exact)."""
    try:
        value, grads = gc_loss_and_grads(model, inputs, row_weights=LOSSES[loss])
    except Exception as error:  # noqa: BLE001 -- HF's own checkpointing fails on this model
        row.notes.append(f"HF checkpointing fails: {_short(error)}")
        return None
    return {"<loss>": value, **grads}


def _describe_gc(ref: dict, gc: dict | None) -> str:
    if gc is None:
        return "fails"
    off = beyond_gc(ref, ref, gc, slack=0.0)
    return "bitwise" if not off else f"{len(off)} off"


def _refused(row: Row, model, error: HiLoReError) -> None:
    message = str(error)
    classes = {type(m).__name__ for m in model.modules()} - {"Module", "ModuleList", "Linear"}
    if any(name in message for name in classes):
        row.result, row.detail = "refused", message
    else:
        row.result = "WRONG"
        row.detail = f"refusal names no layer class of {row.model}: {message}"


def _short(error: BaseException, limit: int = 200) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}"


# ---------------------------------------------------------------------------------- table
def format_table(rows, seconds: float) -> str:
    """The sweep's table and counts, as printed at the end of the module."""
    rows = sorted(rows, key=lambda r: r.arch)
    lines = [f"{'architecture':<26} {'model class':<36} {'units':>5} {'kinds':<12} {'HF GC':<8} "
             f"{'result':<8} detail"]
    for r in rows:
        units = "-" if r.units is None else str(r.units)
        lines.append(f"{r.arch:<26} {r.model[:36]:<36} {units:>5} {r.kinds[:12]:<12} {r.gc:<8} "
                     f"{r.result:<8} {r.detail[:160]}")
    counts = {k: sum(r.result == k for r in rows) for k in ("exact", "refused", "skipped", "WRONG")}
    lines.append(f"{len(rows)} architectures in {seconds:.0f} s: "
                 + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return "\n".join(lines)
