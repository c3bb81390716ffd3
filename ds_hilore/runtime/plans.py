"""The capture plan a runtime executes: an action per unit (``set_plan``, the policy's
``apply_plan``, ``force_plan`` over both), per-sequence rows, the plan agreed over ranks, and
downgrades of the microbatch alive."""

from __future__ import annotations

import fnmatch
import hashlib
import logging
from typing import Mapping

from ds_hilore._errors import HiLoReError, HiLoReNameError
from ds_hilore.runtime.bundle import CapturePlan
from ds_hilore.runtime.elision import trailing
from ds_hilore.runtime.units import LayerUnits, Unit

logger = logging.getLogger("ds_hilore")

ACTIONS = ("H", "L", "R")


class Plans:
    """The part of ``HiLoReRuntime`` (core.py) that holds its plan; its state lives on the
    runtime (``_plan``, ``_rows``, ``_plan_source``)."""

    def set_plan(self, plan: Mapping[str, str] | str, rows: Mapping[str, tuple[str, ...]] | None = None):
        """Capture actions for the next microbatches; ``force_plan`` still overrides them.

        The caller takes the choice over: the allocator (``runtime.policy``) stops deciding, as
        with ``force_plan``.

        Args:
            plan: ``"H"``, ``"L"``, ``"R"`` for every unit, or unit name (globs allowed) -> action.
            rows: optional per-sequence actions (``"H"``/``"L"``/``"E"``) for H/L units.
        """
        self.policy = None
        self.apply_plan(plan, rows)

    def apply_plan(self, plan: Mapping[str, str] | str, rows: Mapping[str, tuple[str, ...]] | None = None):
        """``set_plan`` for the policy: the same checks, the policy stays in charge."""
        if not isinstance(plan, str) and self._units:
            names = [u.name for u in self._units]
            unmatched = [p for p in plan if not any(fnmatch.fnmatchcase(n, p) for n in names)]
            if unmatched:
                raise HiLoReError(f"set_plan: patterns {unmatched} match no recovery unit; unit "
                                  f"names look like {names[0]!r}.")
        if isinstance(plan, str):
            self._check_action(plan, "set_plan")
        self._plan = {u.name: self._check_action(_lookup(plan, u.name, self._plan[u.name]), "set_plan")
                      for u in self._units}
        self._plan_source = plan
        rows = dict(rows or {})
        for name, actions in rows.items():
            self._unit(name)
            for action in actions:
                if action not in ("H", "L", "E"):
                    raise HiLoReError(f"set_plan rows[{name!r}]: unknown action {action!r}; "
                                      "per-sequence actions are 'H', 'L' or 'E'.")
                if action == "L":
                    self._check_action(action, f"set_plan rows[{name!r}]")
        self._rows = rows

    def plan_actions(self) -> list[str]:
        """The capture action of every unit, in unit order, after ``force_plan``."""
        return [self.config.force_plan_for(u.name) or self._plan[u.name] for u in self._units]

    def sync_plan(self) -> str:
        """Make every rank capture with rank 0's plan; returns the plan hash.

        A collective: every rank calls it at the same point (``ds_hilore.initialize`` and each
        optimizer step do). ZeRO-3 gathers parameters in a recompute, so ranks whose plans
        differed would issue different collectives and hang.
        """
        if self.collective is not None and self._units:
            actions = self.collective.broadcast_actions([self._plan[u.name] for u in self._units])
            self._plan = dict(zip((u.name for u in self._units), actions))
        digest = self.plan_hash()
        logger.debug("hilore plan %s", digest)
        return digest

    def plan_hash(self) -> str:
        return hashlib.sha1("".join(self.plan_actions()).encode()).hexdigest()[:12]

    def downgrade(self, name: str, action: str, rows=None, mb=None) -> None:
        """Lower the fidelity of a unit captured in the current microbatch (or in ``mb``, one
        of those alive: a forward whose loss comes after a later forward's); frees bytes at once.

        H -> L, H -> R, L -> R, and H/L -> E for sequences whose loss coefficients are zero
        (checked as the runtime's own elisions are: ``_elidable``). ``rows`` (sequence indices)
        apply to L and E; R is per unit. Under several ranks, call it on every rank alike:
        what it sends to R, or asks the backward to check, is the rank's own.
        """
        unit = self._unit(name)
        mb = self._mb if mb is None else mb
        frame = mb.frame(unit.layer_index) if mb is not None else None
        if (frame is None or frame.kept_whole) and mb is not None and unit.layer_index in mb.whole:
            raise HiLoReError(
                f"downgrade({name!r}): its layer ran without a frame this microbatch, keeping "
                "what autograd keeps (every unit H, nothing re-derived or elided: NOTE [ A layer "
                "that keeps everything ] in runtime/calling.py), so nothing of it can be "
                "downgraded; set derive_pointwise to true in the \"hilore\" block to keep the "
                "frames of H units.")
        if frame is None:
            raise HiLoReError(f"downgrade({name!r}): no microbatch of this unit is alive; call it "
                              "between the forward and the backward of a microbatch.")
        pos = unit.pos
        current = frame.plan.actions[pos]
        allowed = {"H": {"L", "R", "E"}, "L": {"L", "R", "E"}, "R": {"R"}}[current]
        if action not in allowed:
            raise HiLoReError(f"downgrade({name!r}, {action!r}): the unit was captured as "
                              f"{current!r}; allowed: {sorted(allowed)} (fidelity only goes down).")
        if action == "R" and rows is not None:
            raise HiLoReError(f"downgrade({name!r}, 'R', rows=...): R is per unit; pass rows=None.")
        if action == "L" and self._codec is None:
            raise HiLoReError(f"downgrade({name!r}, 'L'): low_precision is 'none'; set it to 'int8' "
                              "or 'fp8_e4m3' in the \"hilore\" block.")
        if action == "E":
            rows = self._elidable(name, frame, rows)
            mb.late_due = True  # every rank alike (NOTE [ A late read, due on every rank ] in late.py)
        frame.downgrade(pos, action, rows)
        self._summarise(mb)

    @staticmethod
    def _elidable(name: str, frame, rows) -> list[int]:
        """The sequences ``downgrade(name, "E", rows)`` elides, recorded where the elision
        checks read them (NOTE [ Checked elision ] in elision.py): gradient reaching one at the
        top of the backward sends the frame to R, and coefficients handed later that are not
        zero there recompute it. Refused where no check could see the gradient: a call whose
        other outputs take gradient, or a packed row whose later sequences read these inside
        the layer (NOTE [ Packed sequences ] in packed.py)."""
        rows = sorted(set(range(frame.sequences) if rows is None else rows))
        if not frame.elision_ok:
            raise HiLoReError(f"downgrade({name!r}, 'E'): this layer call returns more than one "
                              "tensor that takes gradient (or transformers records its internal "
                              "outputs), so gradient can reach its sequences where no check sees "
                              "it; use 'R' instead.")
        every = frame.sequences
        if frame.segments is not None and not frame.segments_independent and \
                not (frame.segments_causal and trailing(rows, every) == rows):
            raise HiLoReError(f"downgrade({name!r}, 'E', rows={rows}): sequences packed into one "
                              f"row of {every} whose attention lets the others read them; only the "
                              "last ones of a causal row (or a mask that keeps each sequence to "
                              "itself) can be elided; use 'R' instead.")
        frame.elided_rows |= set(rows)
        frame.rows_dropped |= set(rows)
        frame.elision_checked = True
        return rows

    def _renumber(self) -> None:
        """Number the units found so far; check force_plan once every layer has its units."""
        self._units = tuple(u for layer in self._layers for u in layer.units)
        for index, unit in enumerate(self._units):
            unit.index = index
        self._plan = {u.name: self._plan.get(u.name) or _lookup(self._plan_source, u.name, "R")
                      for u in self._units}
        if self._units and all(layer.units for layer in self._layers):
            unmatched = self.config.unmatched_force_plan_patterns([u.name for u in self._units])
            if unmatched:
                raise HiLoReNameError(f"hilore.force_plan patterns {unmatched} match no recovery unit; "
                                      f"unit names look like {self._units[0].name!r} (all: runtime.units). "
                                      "Fix the globs, or remove the keys that match nothing.")

    def _capture_plan(self, layer: LayerUnits) -> CapturePlan:
        actions = [self.config.force_plan_for(u.name) or self._plan[u.name] for u in layer.units]
        rows = [self._rows.get(u.name) for u in layer.units]
        return CapturePlan(actions, rows)

    def _unit(self, name: str) -> Unit:
        for unit in self._units:
            if unit.name == name:
                return unit
        raise HiLoReError(f"no recovery unit named {name!r}; units look like {self._units[0].name!r}")

    def _check_action(self, action: str, where: str) -> str:
        if action not in ACTIONS:
            raise HiLoReError(f"{where}: unknown action {action!r}; allowed: {list(ACTIONS)}")
        if action == "L" and self._codec is None:
            raise HiLoReError(f"{where}: action 'L' needs low_precision 'int8' or 'fp8_e4m3' in the "
                              "\"hilore\" block (it is 'none').")
        return action


def _lookup(plan: Mapping[str, str] | str, name: str, default: str) -> str:
    if isinstance(plan, str):
        return plan
    found = default
    for pattern, action in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            found = action
    return found
