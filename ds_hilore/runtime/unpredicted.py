"""Zero sequences found only after their forward: said once per run, with the line that hands
the prediction over (NOTE [ Zero sequences found late ]).

NOTE [ Zero sequences found late ]
Without a prediction (an unchanged DeepSpeed-Chat or OpenRLHF script) the sequences whose
loss coefficients are all zero are known only once the loss hands them over: their stored
bytes are freed then, and a microbatch whose every sequence is zero skips its layers'
backward, but a zero sequence beside kept ones has its share of the layers' recompute and
backward run anyway, where a prediction before the forward would have run it without
autograd (NOTE [ Kept rows only ] in rows.py). So at the end of the first optimizer step in
which such sequences were found and no prediction was handed, rank 0 says once how many of
the step's sequences (on its rank; the rows of a padded microbatch are alike, so also that
share of its layers' backward) were zero, and the line that hands the prediction over.
Counted from the values the coefficients' read already has: no read, no collective. Where
they were all found in packed rows (several sequences in one row, OpenRLHF's packed samples),
a prediction cannot help -- a row runs its layers whole -- and it says so instead.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("ds_hilore")

HAND_OVER = ("runtime.expect(ds_hilore.grpo.exposure.predicted(advantages, response_mask)) "
             "before each microbatch's forward (runtime = engine.hilore, or "
             "ds_hilore.find_runtime(model))")


class ZeroSeen:
    """The step's sequences, those found zero after their forward, and whether a prediction
    was handed, for one runtime (NOTE [ Zero sequences found late ])."""

    def __init__(self):
        self.sequences = self.zero = 0
        self.packed = 0  # of the zero ones, those in packed rows
        self.predicted = False
        self.said = False

    def found(self, sequences: int, zero: int, packed: bool = False) -> None:
        """A microbatch's coefficients were read: ``zero`` of its ``sequences`` are zero;
        ``packed``: they are segments of packed rows."""
        self.sequences += sequences
        self.zero += zero
        self.packed += zero if packed else 0

    def end_step(self, collective) -> None:
        """Said once per run, on rank 0, for a step that found zero sequences unpredicted."""
        if not self.said and not self.predicted and self.zero and (
                collective is None or getattr(collective, "rank", 0) == 0):
            self.said = True
            if self.packed == self.zero:
                logger.warning(
                    "ds_hilore: %d of this optimizer step's %d sequences (%.0f %%, on rank 0) had "
                    "loss coefficients that are all zero, found only after their forward, in "
                    "packed rows (several sequences in one row): their share of the layers' "
                    "recompute and backward ran anyway (only a row whose every sequence is zero "
                    "skips it). A prediction cannot run part of a row apart; with unpacked rows, "
                    "hand it over to run zero sequences without autograd: %s.", self.zero,
                    self.sequences, 100.0 * self.zero / self.sequences, HAND_OVER)
                self.sequences = self.zero = self.packed = 0
                self.predicted = False
                return
            logger.warning(
                "ds_hilore: %d of this optimizer step's %d sequences (%.0f %%, on rank 0) had loss "
                "coefficients that are all zero, found only after their forward: their share of "
                "the layers' recompute and backward ran anyway (only a microbatch whose every "
                "sequence is zero skips it). Hand the prediction over to run their layers without "
                "autograd: %s. Only where a zero means a zero coefficient (beta = 0, no entropy "
                "bonus).", self.zero, self.sequences, 100.0 * self.zero / self.sequences,
                HAND_OVER)
        self.sequences = self.zero = self.packed = 0
        self.predicted = False
