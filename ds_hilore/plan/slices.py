"""A planned microbatch's unit-sequence slices as they ran, read against its exposure: the risk
of each unit's packed rows, and where the top and the bottom exposure quartile of the
sequences went (H, L, R: ``stats["exposure_quartiles"]``).

Used by ``Scheduler``: ``_fit_risk`` once the coefficients are known (NOTE [ One microbatch ]
in scheduler.py), ``stats`` for the quartiles.
"""

from __future__ import annotations

from ds_hilore.plan.buckets import Bucket
from ds_hilore.plan.risk import RiskModel, group_of, quartile_rows


def unit_risks(risk_model: RiskModel, mb, bucket: Bucket, mass, exposure) -> dict[str, float]:
    """s eps_u E_{u,S} of every unit with packed rows S (E_{u,S} from the unit's token
    weights; without them the rows' mass sum_{i in S} M_i)."""
    costs = {c.name: c for c in bucket.profile.units}
    n_layers = 1 + max(c.layer for c in costs.values())
    risks = {}
    for frame in mb.live_frames():
        for pos, unit in enumerate(frame.layer.units):
            if frame.plan.actions[pos] == "R" or unit.name not in costs:
                continue
            packed = [i for i, state in enumerate(row_states(frame, pos)) if state == "L"]
            if not packed:
                continue
            values = exposure.get(unit.name) or mass
            exposed = sum(values[i] for i in packed if i < len(values))
            cost = costs[unit.name]
            risks[unit.name] = risk_model.risk(group_of(cost.kind, cost.layer, n_layers),
                                               cost.rel_error, exposed)
    return risks


def count_slices(stats: dict, mb, mass: list[float]) -> None:
    """Where H, L (bytes) and R (unit-sequence slices) went: on the top and the bottom
    exposure quartile of the sequences (by M_i), and in all (``exposure_quartiles``). A
    microbatch without exposure (every ω zero) has no quartiles: not counted, or its
    recomputed units would fill both ends, picked by row index."""
    if len(mass) < 2 or not any(mass):
        return
    top, bottom = quartile_rows(mass)
    tally = stats.setdefault("exposure_slices", {})
    for frame in mb.live_frames():
        if frame.sequences != len(mass):
            continue
        for pos in range(len(frame.layer.units)):
            if frame.plan.actions[pos] == "R":
                states, per_state = ["R"] * frame.sequences, {}
            else:
                states = row_states(frame, pos)
                _, nbytes = frame.unit_summary(pos)
                per_state = {a: nbytes.get(a, 0) / max(1, states.count(a)) for a in "HL"}
            for i, state in enumerate(states):
                if state in ("H", "L", "R"):
                    row = tally.setdefault(state, [0.0, 0.0, 0.0])  # top, bottom, all
                    value = per_state[state] if state != "R" else 1.0
                    row[0] += value if i in top else 0.0
                    row[1] += value if i in bottom else 0.0
                    row[2] += value


def quartile_shares(tally: dict | None) -> dict | None:
    """Shares of H and L bytes (R: of recomputed slices) on the top and the bottom exposure
    quartile of the sequences, over the step's fitted microbatches."""
    if not tally:
        return None
    return {a: {"top": t / n, "bottom": b / n} for a, (t, b, n) in tally.items() if n > 0}


def row_states(frame, pos: int) -> list[str]:
    states = None
    for stored in frame.units[pos].stored:
        if stored.sliceable:
            states = stored.row_states()
            if "L" in states:
                return states
    return states or ["H"] * frame.batch
