"""Where the host reads a microbatch's device values, and the one helper that reads them.

NOTE [ Two reads per microbatch ]
A read of a device value stalls the host until the device's queue drains, and under several
ranks an all-reduce of host values does too. So a microbatch reads the device at two points,
and every decision of a point is made from its one read (and under several ranks, its one
all-reduce):

* the coefficients (``Elision.apply``, when ω is handed over, or at the top of the backward for
  the automatic source): each sequence's ω mass M_i (zero: ω ≡ 0, the sequence is elided), the
  exposure of every unit and sequence (what the policy's risk decision reads,
  ``Microbatch.exposure_lists``), the forward's deferred checks (NOTE [ One read per
  microbatch ] in storage.py) and the late flags left by earlier backwards (below). One
  all-reduce then agrees on the elision, the failed checks and the late flags (NOTE
  [ Collective elision ] in agreement.py) -- none where the microbatch's decisions are this
  rank's own (NOTE [ A microbatch of its own ]): its late flags wait for the step's read.
* the top of the backward (``Microbatch.settle``): the leak check at the last layer's output
  (NOTE [ Checked elision ] in elision.py) with any check deferred since the coefficients; one
  all-reduce (NOTE [ One sync at the top of the backward ] in microbatch.py). Where no rank
  elides a sequence (the coefficients' all-reduce says so: no zero sequence anywhere, or
  elision off), nothing is read or all-reduced there.

The per-layer flags of the elision check are known only when the backward ends; reading them
there would be a third read. They stay on the device, folded into one flag, and are read with
the runtime's next read at the coefficients -- or before any torch optimizer steps (a step
pre-hook) or at ``end_step``, whichever comes first -- so their error still comes before a
step can use the wrong gradients.
Not counted here: the policy's own all-reduce before the forward (the shape bucket and the
prediction's rows: plan/scheduler.py; its risk decision rides on the elision's all-reduce at
the coefficients), the loss's own reads (grpo/policy.py), and
rarer paths: packed rows (a read at the first layer, packed.py), coefficients that never come
(the checks are read at the first unpack), hidden states recorded by transformers (a read per
layer, elision.py), calibration microbatches (plan/calibrate.py).
"""

from __future__ import annotations

import functools

import torch


def read_once(parts: list[torch.Tensor | None]) -> list[list[float]]:
    """The values of every tensor in ``parts`` (floating or boolean), flattened, read from the
    device at once: one list of Python floats per part (empty for None). Exact: the parts are
    read in their common floating dtype, at least fp32 (booleans as 0.0 / 1.0); nothing is read
    when every part is None or empty."""
    present = [p.reshape(-1) for p in parts if p is not None]
    if not present or all(p.numel() == 0 for p in present):
        return [[] for _ in parts]
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in present), torch.float32)
    device = present[0].device
    values = torch.cat([p.to(device=device, dtype=dtype) for p in present]).tolist()  # the read
    out, start = [], 0
    for part in parts:
        n = 0 if part is None else part.numel()
        out.append(values[start:start + n])
        start += n
    return out
