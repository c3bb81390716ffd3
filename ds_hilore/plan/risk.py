"""The risk model: how much relative error of the step's gradient packing a unit (or some of
its sequences) adds, from the codec's measured error, the unit's calibrated susceptibility and
the exposure of the packed sequences to the current update (NOTE [ Risk in step units ]).

    risk(u, L on sequences S of microbatch m) = s_g(u) * eps_u * E_{u,S} / E_step

eps_u is the codec's relative error on the unit's tensors (measured when profiling), E_{u,S} the
exposure of the packed sequences in unit u (|ω| weighted by the unit's input activations,
``ds_hilore.grpo.exposure``), E_step the exposure mass of the optimizer step, and s_g the
susceptibility of the unit's group (kind and depth half), fitted from matched passes. Errors of
several units are summed, an upper estimate (independent errors add in quadrature), so the
estimate errs on the safe side. Before any calibration s is ``prior`` (1.0: one unit of
activation error is one unit of gradient error). Pure Python: no torch.

NOTE [ Risk in step units ]
``grad_error_tolerance`` bounds the relative error of the gradient the optimizer sees: the sum
over the step's micro-steps m and ranks r, e_step = |sum_{m,r} dg_{m,r}| / |sum_{m,r} g_{m,r}|
(DeepSpeed's 1/GAS and the mean over ranks scale both sides alike and cancel).

* Exposure mass of microbatch m: M_m = sum_{i,t} |ω_{i,t}| (masked and clipped tokens have ω = 0
  exactly); of the step, E_step = sum_{m,r} M_{m,r}. A unit's token weights w have mean one
  within the unit and microbatch, so a unit packed whole on m has E_{u,all} ~ M_m, more where
  its activations weigh the exposed tokens more.
* Model: |g_m| is proportional to M_m with the same constant across the step's microbatches,
  and packing u on rows S of m perturbs m's gradient by e_m = s eps_u E_{u,S} / M_m (relative
  to |g_m|). In the step's units that is e_m |g_m| / |g_step| = s eps_u E_{u,S} / E_step: the
  risk above. The step's estimate is the sum of its risks (``grad_error_est``).
* Budget: each of the step's N = GAS x ranks microbatches may spend tolerance / N, so the sum
  fits the tolerance. Multiplying by N: microbatch m's packed units fit when
  sum_u s eps_u E_{u,S} / M_ref <= tolerance, with M_ref = E_step / N the step's mean
  microbatch mass (``StepExposure.reference``). The allocator's plan-time risk s eps share
  (share = the packed part of the unit's rows, 1 when whole) is exactly this for a microbatch
  of mean mass: the bucket's plan fits an average microbatch; one with M_m < M_ref (small or
  clipped ω) has room to pack more, one with M_m > M_ref sends its riskiest units to R.
* M_ref = E_step / N (or / K: the next NOTE). Predicted when the caller gave the step's
  predicted exposure P_step with this microbatch's P_m (``Scheduler.expect``): M_ref = M_m *
  (P_step / N) / P_m. Else from what is known: the masses of this step's microbatches so
  far on this rank (this one included), plus the previous step's mean microbatch mass (all
  ranks) for each microbatch still to come, over N (the previous step's count). So with
  N = 1 (one rank, no gradient accumulation) M_ref = M_m exactly: a step's relative error
  does not shrink with its scale. Before any step ended: the mean of this step's
  microbatches so far.
* Calibration fits s against the same quantity: a matched pass on m measures e_m and
  s = e_m / sum_u eps_u E_{u,S_u} / M_m. Validation measures e_step over every microbatch of
  the validated step; the per-microbatch e_m stays reported too.
* Ranks: the after-forward decision reads the element-wise max over ranks of every unit's
  sum_u s eps E_{u,S} / M_ref (one decision, the riskiest rank's); the step's estimate sums
  risks and masses over ranks; validation measures the error of the gradient summed over the
  step's micro-steps and ranks (NOTE [ The step's error over ranks ] in grad_error.py).
Checkable scale: with M_ref the step's actual mean, sum of a step's risks = stats
``grad_error_est``, to be compared with ``grad_error_measured`` (the same step's e_step).

NOTE [ The tolerance of a step, shared by its exposed microbatches ]
A microbatch predicted zero on every rank (all its groups without reward spread, beta = 0) is
planned all R or E and packs nothing: its share tolerance / N would go unspent, and each
exposed microbatch would be held to tolerance / N although the step's error is theirs alone.
When the caller says how many of the step's N microbatches are predicted non-zero (K, every
rank's: ``Scheduler.expect(..., exposed_microbatches=K)``), the predicted reference is
P_step / K: each exposed microbatch may spend tolerance / K, and the sum over the step still
fits the tolerance (a wrong zero is recomputed after the forward: exact, no risk). Measured on
``hilore bench --model paper-cpu`` (one microbatch of two with A = 0): with N = 2 the exposed
one read as twice the step's mean (rho = 2) and was held to half the tolerance; the 1.10
budget's plan packed 3 units and avoided 22 % of GC's recompute at a step error of 0.0021.
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
        """Fold in one matched pass; returns the sample s (None when nothing was packed).
        ``eps_sum`` = sum_u eps_u E_{u,S_u} / M_m over the packed units (NOTE [ Risk in step
        units ]): the measured microbatch error e_m over it is s."""
        if eps_sum <= 0:
            return None
        s = measured_error / eps_sum
        self.samples.setdefault(group, []).append(s)
        return s

    def risk(self, group: str, eps: float, share: float) -> float:
        """s eps share: with ``share`` = E_{u,S} / M_ref, the risk times N (NOTE [ Risk in step
        units ]), compared with the tolerance."""
        return self.susceptibility(group) * eps * share

    def scaled(self, factor: float) -> "RiskModel":
        """Every susceptibility times ``factor`` (a microbatch whose exposure is ``factor``
        times the step's mean: NOTE [ Risk in step units ])."""
        return RiskModel(self.prior * factor,
                         {g: [x * factor for x in v] for g, v in self.samples.items()})

    def to_dict(self) -> dict:
        return {"prior": self.prior, "samples": {k: list(v) for k, v in self.samples.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "RiskModel":
        return cls(prior=float(data.get("prior", 1.0)),
                   samples={k: [float(x) for x in v] for k, v in data.get("samples", {}).items()})


@dataclasses.dataclass
class StepExposure:
    """The step's exposure for the risk (NOTE [ Risk in step units ]): the reference mass
    M_ref, and each microbatch's M_m and absolute risk sum_u s eps_u E_{u,S} as decided."""

    previous_mean: float | None = None  # M_ref of the last step: its mean microbatch mass, all ranks
    previous_count: int | None = None  # N of the last step: microbatches on all ranks
    masses: list[float] = dataclasses.field(default_factory=list)  # M_m of this step (this rank)
    risks: list[float] = dataclasses.field(default_factory=list)  # sum_u s eps E_{u,S} per m
    riders: list[float] = dataclasses.field(default_factory=list)  # the last close's, summed

    def reference(self, mass: float, predicted: float | None = None,
                  predicted_step: float | None = None, exposed: int | None = None) -> float:
        """M_ref for a microbatch of mass M_m (``mass``); ``predicted`` P_m and
        ``predicted_step`` P_step: the caller's prediction of it and of the step, any unit;
        ``exposed``: how many of the step's microbatches are predicted non-zero (NOTE [ The
        tolerance of a step, shared by its exposed microbatches ])."""
        count = exposed or self.previous_count
        if predicted and predicted_step and count:
            return mass * (predicted_step / count) / predicted
        seen = self.masses + [mass]
        if self.previous_count and self.previous_mean:
            count = max(self.previous_count, len(seen))
            return (sum(seen) + (count - len(seen)) * self.previous_mean) / count
        return sum(seen) / len(seen)

    def add(self, mass: float, risk: float) -> None:
        self.masses.append(mass)
        self.risks.append(risk)

    def to_dict(self) -> dict:
        """The running reference, for a resume (saved between steps: no microbatch is open)."""
        return {"previous_mean": self.previous_mean, "previous_count": self.previous_count}

    @classmethod
    def from_dict(cls, data: dict) -> "StepExposure":
        mean, count = data.get("previous_mean"), data.get("previous_count")
        return cls(None if mean is None else float(mean), None if count is None else int(count))

    def close(self, collective=None, riders: list[float] = ()) -> dict:
        """End of the step: its estimate sum risk / E_step, and the reference of the next.
        A collective (the same call on every rank) when ``collective`` is given; ``riders``
        ride along, summed over ranks into ``self.riders`` (what the next step must agree
        before its forwards: NOTE [ A steady step agrees nothing before its forwards ] in
        steady.py)."""
        totals = [sum(self.risks), sum(self.masses), float(len(self.masses)), *riders]
        if collective is not None:
            totals = collective.all_reduce_sum(totals)
        risk, mass, count = totals[:3]
        self.riders = list(totals[3:])
        per_mb = [r / m if m > 0 else 0.0 for r, m in zip(self.risks, self.masses)]
        if count > 0 and mass > 0:
            self.previous_mean, self.previous_count = mass / count, int(count)
        self.masses, self.risks = [], []
        return {"step": risk / mass if mass > 0 else (0.0 if count else None),
                "microbatches": per_mb}


def quartile_rows(mass: list[float]) -> tuple[set[int], set[int]]:
    """(top, bottom): the ceil(n / 4) most and least exposed rows by mass M_i."""
    k = max(1, -(-len(mass) // 4))
    order = sorted(range(len(mass)), key=lambda i: (mass[i], i))
    return set(order[-k:]), set(order[:k])


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
