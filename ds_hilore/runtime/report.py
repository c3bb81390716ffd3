"""What a runtime reports: each microbatch's summary (actions and bytes per unit, as they stand
after its forward and its downgrades) and the optimizer step's ``stats``."""

from __future__ import annotations

from typing import Any

from ds_hilore.runtime.codecs import relative_errors
from ds_hilore.runtime.storage import Counters

_COUNTED = ("recomputed_units", "pack_s", "unpack_s", "recompute_s", "nonfinite_slices",
            "backward_skipped")


def summarise(layers, mb) -> None:
    """Write ``mb.summary`` and every unit's reported action and bytes (the latest microbatch)."""
    actions, nbytes = {a: 0 for a in "HLRE"}, {a: 0 for a in "HLRE"}
    for layer in layers:
        frame = mb.frame(layer.index)
        if frame is None and layer.index in mb.checkpointed:  # NOTE [ A layer that keeps nothing ]
            for unit in layer.units:
                unit.action, unit.nbytes = "R", 0
            actions["R"] += len(layer.units)
            continue
        if frame is None and layer.index in mb.whole:  # NOTE [ A layer that keeps everything ]
            for unit, held in zip(layer.units, mb.whole[layer.index]):
                unit.action, unit.nbytes = "H", held
                actions["H"] += 1
                nbytes["H"] += held
            continue
        if frame is None:
            continue
        learnt = []
        for pos, unit in enumerate(layer.units):
            action, held = frame.unit_summary(pos)
            unit.action, unit.nbytes = action, sum(held.values())
            actions[action] += 1
            for k, v in held.items():
                nbytes[k] += v
            # what autograd keeps: not the exposure's token norms, which only a frame computes
            norms = frame.units[pos].token_norms
            kept = held.get("H", 0) - (0 if norms is None else norms.untyped_storage().nbytes())
            learnt.append(kept if action == "H" and not held.get("L") else None)
        if frame.whole_key is not None and None not in learnt:
            layer.learn_whole(frame.whole_key, learnt)
    split = mb.split  # NOTE [ Kept rows only ] in rows.py: its zero rows were never kept
    mb.summary.update(index=mb.index, actions=actions, bytes=nbytes, counters=mb.counters,
                      exposure_source=mb.source,
                      exact_zero_sequences=len(mb.zero_rows) + (len(split.zero) if split else 0),
                      kept_rows=None if split is None else list(split.kept))


def step_stats(summaries: list[dict], policy) -> dict[str, Any]:
    """``HiLoReRuntime.stats`` of the microbatches ``summaries``, with the policy's own."""
    mbs = [_microbatch_stats(m) for m in summaries]
    out = {"actions": _sum_dicts(m["actions"] for m in mbs),
           "bytes": _sum_dicts(m["bytes"] for m in mbs),
           "microbatches": mbs, "peak_bytes": None,
           "grad_error_est": None, "grad_error_measured": None}
    for key in _COUNTED:
        out[key] = sum(m[key] for m in mbs)
    errors = relative_errors([e for m in mbs for e in m.pop("_packed_stats")])
    measured = [e for e in errors if e is not None]  # NOTE [ Measured or not ] in codecs.py
    # 0.0: nothing packed; None: packed, but no microbatch of the step measured the error
    out["packed_rel_error_max"] = max(measured, default=None if errors else 0.0)
    if policy is not None:  # peak, budget, error estimates, plans (ds_hilore.plan)
        out.update(policy.stats)
    return out


def _microbatch_stats(summary: dict) -> dict[str, Any]:
    c: Counters = (summary.get("counters") or Counters()).resolve()
    return {"index": summary.get("index"), "position": summary.get("position"),
            "actions": dict(summary.get("actions", {})),
            "bytes": dict(summary.get("bytes", {})), "recomputed_units": c.recomputed_units,
            "pack_s": c.pack_s, "unpack_s": c.unpack_s, "recompute_s": c.recompute_s,
            "nonfinite_slices": c.nonfinite_slices, "_packed_stats": list(c.packed_stats),
            "exposure_source": summary.get("exposure_source"),
            "exact_zero_sequences": summary.get("exact_zero_sequences", 0),
            # the rows run with autograd where a prediction split them, else None (NOTE
            # [ Kept rows only ] in rows.py)
            "kept_rows": summary.get("kept_rows"),
            # 1 when its layers' backward was skipped (NOTE [ A backward of zeros ] in
            # zero_backward.py)
            "backward_skipped": int(summary.get("backward_skipped", False))}


def _sum_dicts(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
