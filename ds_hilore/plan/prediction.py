"""What the scheduler makes of a prediction handed to ``expect``: the rows agreed over ranks
before the forward, which rows run with autograd (NOTE [ Kept rows only ] in
runtime/rows.py), the plan re-solved for the rows kept, and each unit's per-row actions.

Plain functions of the ``Scheduler`` (scheduler.py) they are called from.
"""

from __future__ import annotations

import math

from ds_hilore.plan.allocate import Plan, allocate
from ds_hilore.plan.buckets import Bucket, kept_rows, priced_rooms
from ds_hilore.runtime import rows as runtime_rows

# ``Scheduler.row_values`` / ``rows_agreed``: one entry each, the max over ranks
MISSING, KEPT, RHO, UNSKIPPED, ZERO_HERE, CANNOT_SPLIT = range(6)


def row_values(s, length: int) -> list[float]:
    """[missing, kept, rho, unskipped, zero here, cannot split] of this rank's prediction for
    the microbatch beginning (NOTE [ Freed memory is spent ]): no prediction that could elide
    or split here (missing 1), else its sequences predicted non-zero, its risk factor rho and
    whether a zero microbatch's layers' backward is not known to be skipped; whether a row is
    predicted zero here and the rows can be split, and whether they cannot (NOTE [ Kept rows
    only ] in runtime/rows.py). Agreed over ranks with the bucket: one all-reduce before the
    forward, whatever it plans; in a steady step not agreed (NOTE [ A steady step agrees
    nothing before its forwards ] in steady.py)."""
    expected, rows = s.expected, s.rows_here
    mode = s.runtime.elision_mode(s._device())  # NOTE [ Stand-ins on accelerators ]
    can = s.runtime.can_split() and runtime_rows.splittable(rows, length)
    if not expected or len(expected) != rows or s.config.exposure_source == "hidden_grad" \
            or not (mode is True or can or (mode == "whole" and not any(expected))):
        s.row_values = [1.0, float(rows), 1.0, 1.0, 0.0, 0.0 if can else 1.0]
        return s.row_values
    kept, rho = float(sum(1 for x in expected if x != 0)), 1.0
    step = s.expected_step  # NOTE [ The tolerance of a step, shared by ... ] in risk.py
    count = s.expected_exposed or s.step_exposure.previous_count
    if step and count and sum(expected) > 0:
        rho = 2.0 ** (math.ceil(8 * math.log2(sum(expected) / (step / count)) - 1e-9) / 8)
    skips = s.zero_skips and s.runtime.zero_backward_skip  # NOTE [ A microbatch predicted zero ]
    s.row_values = [0.0, kept, rho, 0.0 if skips else 1.0, float(can and kept < rows),
                    0.0 if can else 1.0]
    return s.row_values


def splits(s) -> bool:
    """Whether some rank runs its rows apart (agreed: the same on every rank; in a steady step,
    whether this rank does): every rank has a prediction and can split, one has a row predicted
    zero, and not every rank's microbatch is predicted zero where its layers' backward is
    skipped instead (NOTE [ A microbatch predicted zero ])."""
    agreed = s.rows_agreed
    if len(agreed) <= CANNOT_SPLIT or agreed[MISSING] or agreed[CANNOT_SPLIT] \
            or not agreed[ZERO_HERE]:
        return False
    return not (agreed[KEPT] == 0 and not agreed[UNSKIPPED])


def split_here(s, batch: int, expected: list[float] | None):
    """This rank's ``RowSplit`` where the ranks split (``splits``), or None."""
    if expected is None or len(expected) != batch or not splits(s):
        return None
    return runtime_rows.plan_split(expected, batch, s.runtime.matched_calls)


def unit_rows(plan: Plan, sequences: list[int], expected, elide: bool,
              kept: list[int]) -> tuple[dict, dict]:
    """(action per unit, per-sequence actions per unit) of ``plan`` for the frames' sequences
    ``sequences`` (batch rows, or the kept rows of a split): S splits by predicted exposure
    (the less exposed half of the sequences kept L, the rest H), ``elide`` the sequences not in
    ``kept`` E."""
    order = sorted(kept, key=lambda i: (expected[i], i)) if expected else kept
    packed = set(order[:len(kept) // 2])  # the less exposed half of the sequences kept
    actions, rows = {}, {}
    for name, action in plan.actions.items():
        actions[name] = "H" if action == "S" else action
        if action in ("S", "H", "L") and (action == "S" or elide):
            per_row = ["L" if (action == "S" and i in packed) or action == "L" else "H"
                       for i in sequences]
            if elide:
                per_row = ["E" if i not in kept else a for i, a in zip(sequences, per_row)]
            rows[name] = tuple(per_row)
    return actions, rows


def plan_for_rows(s, bucket: Bucket, shared: bool, split: bool) -> Plan:
    """NOTE [ Freed memory is spent ]
    A microbatch whose prediction elides sequences, or runs them without autograd (NOTE [ Kept
    rows only ] in runtime/rows.py), keeps only the others' bytes, and one predicted less
    exposed than the step's mean microbatch carries less risk: the bucket's knapsack is
    re-solved for it (pure, cached per (rows kept, risk factor)), with each per-sequence unit's
    bytes and codec times scaled to the rows kept and each risk by rho = P_m / (P_step / N)
    (NOTE [ Risk in step units ] in risk.py; 1 without a step prediction), rounded up to a
    power of 2^(1/8) (at most 9 % more risk than predicted, never less): a handful of factors,
    so a handful of solves (tens of ms each on a CPU), where rounding to 0.01 solved again for
    nearly every microbatch. Not solved at all when every row is kept, rho >= 1 and the
    bucket's plan still fits the risk budget scaled by rho: the feasible set only shrank, so
    the bucket's plan is still the best. Units kept whole (not per sequence) and fast-forward
    tensors keep their full price, so the plan stays within the bucket's headroom (the zero
    rows' layer inputs, which a split does not keep either, are left in its price). The same
    on every rank: the worst case over ranks (most rows kept, largest rho; one row where a
    split keeps one of a microbatch predicted zero) is planned for -- but in a steady step,
    where each rank's plan is its own (ZeRO 0-2: NOTE [ A steady step agrees nothing before its
    forwards ] in steady.py), for this rank's own prediction, with nothing agreed: a rank whose
    rows are mostly zero keeps more of the others than the worst case would let it.

    NOTE [ One recompute set under ZeRO-3 ]
    ZeRO-3 records the order in which a forward and backward fetch submodules (its trace) and,
    while every pass repeats it, keeps parameters resident up to its reuse distance and
    prefetches the next ones; a pass in another order invalidates it, and until a pass is
    recorded and repeated every module call gathers its parameters and releases them after.
    A recomputed unit calls its modules again in the backward, so a microbatch that recomputes
    other units than the last one runs another order. Re-solved freely for each microbatch's
    kept rows and exposure, the plans of the four microbatches of ``hilore bench --model
    paper-cpu --predict --zero-stage 3`` recomputed four different sets: DeepSpeed's trace was
    never complete, 392-415 gathers per micro-step against GC's 25; with this rule, 22, and
    the run went from 1.18x to 1.40x GC. Where the ranks' module calls must match
    (``matched_calls``: ZeRO-3, FSDP, a multi-rank ``attach`` that cannot tell) a re-solved
    plan keeps the bucket plan's R units R, and chooses H, L or S for the others, R only where
    the risk or the memory requires it (more risk than the bucket's, rho > 1; a headroom less a
    credit the bucket's plan spent): the memory the zero rows leave is spent storing in high
    precision what the bucket's plan packs. Units the risk fit sends to R after the forward
    (``Scheduler._fit_risk``, where the measured exposure exceeds the budget) still change the
    order for that micro-step: correctness first, a trace recorded again.

    NOTE [ A microbatch predicted zero ]
    When no sequence of any rank is kept (all predicted 0; in a steady step, of this rank), the
    plan is all R instead of all E. Neither keeps more than the layers' inputs, but E still
    runs every kept unit's capture in the forward (token norms, storage records, derived-tensor
    checks) and the backward decodes a stand-in per storage and re-derives its pointwise
    tensors from them; R captures nothing, and once ω shows every sequence zero its backward
    skips the recompute and reads stand-ins (NOTE [ Exact zeros ] in runtime/storage.py), and
    the layers' backward is skipped (NOTE [ A backward of zeros ] in runtime/zero_backward.py).
    Measured on ``hilore bench --model paper-cpu`` steps (one profile for every method, two
    torch threads, idle CPU, 40 paired rounds): the step x1.090 faster than with E (95 % CI
    1.044-1.154), which had left it behind the exposure-blind allocator (x0.950), although that
    one packs the microbatch's units before ω shows them zero; now ahead of it (x1.036,
    1.015-1.070). Only while the skip is known to happen -- the last microbatch's ω came from
    the loss (the analytic source; a hidden-gradient one never skips a recompute), and the ZeRO
    stage lets a rank skip (not 3) -- on every rank; else such a microbatch runs its layers
    over one row (NOTE [ Kept rows only ]) where rows can be split, or stays E, checked after
    the forward as before. A wrong prediction costs time only: R recomputes."""
    batch = bucket.key[0]
    # ``row_values`` as agreed with the bucket (``_bucket_key``); ``shared``: the bucket
    # lets a prediction elide (the same on every rank)
    missing, kept, rho, unskipped = s.rows_agreed[:4] if shared else (1.0, float(batch), 1.0, 1.0)
    if not missing and kept == 0 and not unskipped:  # NOTE [ A microbatch predicted zero ]
        s.predicted_zero = True
        return Plan.all_r(bucket.plan.actions, bucket.plan.headroom_bytes)
    kept = max(kept, 1.0) if split else kept  # a split keeps a row of a zero microbatch
    if missing or bucket.plan.headroom_bytes <= 0 or (
            kept >= batch and rho >= 1.0 and bucket.plan.risk * rho <= s._risk_budget()):
        return bucket.plan
    key = (id(bucket.plan), int(kept), rho)  # the value holds the plan: its id stays unique
    if key not in s.row_plans:
        if len(s.row_plans) > 64:
            s.row_plans.clear()
        profile = kept_rows(bucket.profile, int(kept), batch)
        recomputed = frozenset(n for n, a in bucket.plan.actions.items() if a == "R") \
            if s.runtime.matched_calls else frozenset()  # NOTE [ One recompute set under ZeRO-3 ]
        # unchecked: within the headroom less any credit (NOTE [ Headroom a checked plan
        # left ] in checks.py); the bucket's own plan, checked, where it fits and is better
        plan = allocate(profile, s.risk.scaled(rho),
                        bucket.plan.headroom_bytes - bucket.headroom_credit, s._risk_budget(),
                        s.runtime._codec is not None, excluded=frozenset(bucket.excluded),
                        byte_scale=bucket.byte_scale,  # NOTE [ Priced for the bucket's longest ]
                        rooms=priced_rooms(bucket), recomputed=recomputed)
        if kept >= batch and bucket.plan.risk * rho <= s._risk_budget() and \
                bucket.plan.utility_s > plan.utility_s:
            plan = bucket.plan
        s.row_plans[key] = (bucket.plan, plan)
    return s.row_plans[key][1]
