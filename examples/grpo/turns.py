"""Runs that take their steps in turns (``make demo``): ``--turns FOLDER --turn ARM/ARMS``.

NOTE [ Runs in turns ]
The demo pairs step i of the GC run with step i of the HiLoRe run. Run one after the other,
the two steps of a pair are minutes apart, and whatever changes the machine's speed in between
(another process, the CPU's clock) lands in one run's time only. So the demo starts both runs
at once and they take turns: run k works on phase p only after run k - 1 finished it (run 0
after the last run finished phase p - 1), so the two steps of a pair run back to back, each
while the other run waits, asleep. Phase 0 is the evaluation before training, phases 1..N the
training steps, phase N + 1 what follows them (the FLOP count).

The turn is one line in ``FOLDER/turn`` ("phase arm"), replaced atomically by the rank 0 of
the run that ends its turn; rank 0 of the waiting run reads it every few milliseconds, and its
other ranks wait for it at a barrier of their own process group (gloo on a CPU: a blocking read,
no spinning; a barrier's timeout, 30 minutes under DeepSpeed, bounds a phase of the other run).
``FOLDER/ready.ARM`` says a run is set up (the demo starts the next run only then: two runs must
not build the same warm start at once). ``launch_in_turns`` (compare.py) starts the runs and
writes the first turn; a run that fails ends the others.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["Turns", "first_turn", "parse_turn"]

POLL_S = 0.005


def parse_turn(text: str) -> tuple[int, int]:
    """``"ARM/ARMS"`` (``--turn``) -> (arm, arms)."""
    arm, _, arms = text.partition("/")
    try:
        pair = int(arm), int(arms)
    except ValueError:
        pair = (-1, 0)
    if not 0 <= pair[0] < pair[1]:
        raise ValueError(f"--turn {text!r}: expected ARM/ARMS with 0 <= ARM < ARMS, e.g. 0/2")
    return pair


def first_turn(folder: Path) -> None:
    """Phase 0 to run 0 (written by the launcher once every run is set up)."""
    _write(Path(folder), 0, 0)


class Turns:
    """This run's place in the turns; without a folder every turn is taken at once."""

    def __init__(self, folder: str | os.PathLike | None, arm: int = 0, arms: int = 1):
        self.folder = None if folder is None else Path(folder)
        self.arm, self.arms = arm, arms

    def ready(self) -> None:
        """Say this run is set up (rank 0)."""
        if self.folder is not None and _rank() == 0:
            (self.folder / f"ready.{self.arm}").write_text("")

    @contextlib.contextmanager
    def turn(self, phase: int):
        """Run the body in this run's turn of ``phase``, then hand the turn on."""
        if self.folder is None:
            yield
            return
        if _rank() == 0:
            while _read(self.folder) != (phase, self.arm):
                time.sleep(POLL_S)
        _barrier()
        yield
        _barrier()  # every rank's work of the phase is done
        if _rank() == 0:
            last = self.arm + 1 == self.arms
            _write(self.folder, phase + 1 if last else phase, 0 if last else self.arm + 1)


def _read(folder: Path) -> tuple[int, int] | None:
    try:
        phase, arm = (folder / "turn").read_text().split()
        return int(phase), int(arm)
    except (FileNotFoundError, ValueError):
        return None


def _write(folder: Path, phase: int, arm: int) -> None:
    tmp = folder / f"turn.{os.getpid()}"
    tmp.write_text(f"{phase} {arm}\n")
    os.replace(tmp, folder / "turn")  # atomic: a reader sees the old line or the new one


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
