"""The risk model: how much relative gradient error packing a unit (or some of its sequences)
adds, from the codec's measured error, the unit's calibrated susceptibility and the exposure of
the packed sequences to the current update.

    risk(u, L on sequences S) = s_g(u) * eps_u * share_u(S),
    share_u(S) = sum_{i in S} E_{u,i} / sum_i E_{u,i}

eps_u is the codec's relative error on the unit's tensors (measured when profiling), E_{u,i} the
exposure of sequence i in unit u (|ω| weighted by the unit's input activations), and s_g the
susceptibility of the unit's group (kind and depth half), fitted from matched passes: the
measured relative gradient error e of a pass with a subset U of the group's units in L, against
the exact gradient, gives s = e / sum_{u in U} eps_u. Errors of several units are summed, an
upper estimate (independent errors add in quadrature), so the estimate errs on the safe side.
Before any calibration s is ``prior`` (1.0: one unit of activation error is one unit of
gradient error). Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import statistics


def group_of(kind: str, layer: int, layers: int) -> str:
    """Units share a susceptibility by kind and depth half: ``"mlp:low"``, ``"attn:high"``."""
    return f"{kind}:{'low' if 2 * layer < layers else 'high'}"


@dataclasses.dataclass
class RiskModel:
    prior: float = 1.0
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # group -> s

    def susceptibility(self, group: str) -> float:
        """s of a group: the median of its samples; else of its kind's (other depth); else of
        all samples; else the prior."""
        if self.samples.get(group):
            return statistics.median(self.samples[group])
        kind = group.split(":")[0]
        same = [s for g, values in self.samples.items() if g.split(":")[0] == kind for s in values]
        every = [s for values in self.samples.values() for s in values]
        return statistics.median(same or every) if (same or every) else self.prior

    def add(self, group: str, measured_error: float, eps_sum: float) -> float | None:
        """Fold in one matched pass; returns the sample s (None when nothing was packed)."""
        if eps_sum <= 0:
            return None
        s = measured_error / eps_sum
        self.samples.setdefault(group, []).append(s)
        return s

    def risk(self, group: str, eps: float, share: float) -> float:
        return self.susceptibility(group) * eps * share

    def to_dict(self) -> dict:
        return {"prior": self.prior, "samples": {k: list(v) for k, v in self.samples.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "RiskModel":
        return cls(prior=float(data.get("prior", 1.0)),
                   samples={k: [float(x) for x in v] for k, v in data.get("samples", {}).items()})


def share(exposure: list[float], rows: list[int]) -> float:
    """The part of a unit's exposure that sits in ``rows`` (0 when the unit has none)."""
    total = sum(exposure)
    return sum(exposure[i] for i in rows) / total if total > 0 else 0.0


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation of two equally long lists (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va > 0 and vb > 0 else 0.0
