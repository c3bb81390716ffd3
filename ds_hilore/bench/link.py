"""Between the bench's process and its ranks: files in one run folder.

NOTE [ The run folder ]
The bench writes ``config.json`` and starts the ranks. Rank 0 gathers every rank's raw
samples and writes them, whole, to ``samples.json`` (written aside, then renamed) after each
phase, round and whole-run step, with the phase it is in. Before each paired round it writes
``"waiting": k`` and waits for the bench's word: a file ``go-k`` (run round k) or ``stop``
(the rounds are over: the count was reached, the decisive comparisons are decided, the time is
up, or the bench was interrupted). The bench decides from the samples (its summary and
verdicts are not the ranks' business), so every rank runs the same rounds: rank 0 broadcasts
the word. Between warm-up steps, passes and whole-run steps rank 0 looks for ``stop`` alone
(an interrupt) and broadcasts what it found. The ranks ignore SIGINT: a Ctrl-C reaches every
process of the terminal's group, and a rank that ended in the middle of a collective would
leave the others waiting in it; the bench turns it into ``stop``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["CONFIG", "SAMPLES", "Link", "answer", "read_samples", "request_stop", "write_json"]

CONFIG, SAMPLES, STOP = "config.json", "samples.json", "stop"
POLL_S = 0.01


def write_json(path: Path, document: dict[str, Any]) -> None:
    """``document`` written whole or not at all (aside, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document), encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------- the bench
def read_samples(run_dir: Path) -> dict[str, Any] | None:
    """What rank 0 last wrote, or None before it wrote anything."""
    try:
        return json.loads((run_dir / SAMPLES).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


def answer(run_dir: Path, round_index: int, go: bool) -> None:
    """The word on round ``round_index``: run it, or stop the rounds."""
    (run_dir / (f"go-{round_index}" if go else STOP)).touch()


def request_stop(run_dir: Path) -> None:
    (run_dir / STOP).touch()


# ---------------------------------------------------------------------------------- the ranks
class Link:
    """A rank's side of the run folder; every method is a collective (all ranks call it)."""

    def __init__(self, run_dir: Path, device: str):
        import torch.distributed as dist

        self.dir, self.device, self.dist = Path(run_dir), device, dist
        self.rank = dist.get_rank()
        self.parent = os.getppid()

    def say(self, message: str) -> None:
        """A progress line on rank 0's stderr."""
        if self.rank == 0:
            print(f"hilore bench: {message}", file=sys.stderr, flush=True)

    def publish(self, record: dict, shared: dict, phase: str, waiting: int | None = None) -> None:
        """Every rank's ``record`` gathered; rank 0 writes them with ``shared`` (what every
        rank holds alike) and the ``phase``."""
        every = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(every, record)
        if self.rank == 0:
            write_json(self.dir / SAMPLES, {"phase": phase, "waiting": waiting, "ranks": every,
                                            "shared": shared})

    def stopped(self) -> bool:
        """The bench asked the ranks to stop (an interrupt)."""
        return self._broadcast((self.dir / STOP).exists() if self.rank == 0 else None)

    def go(self, round_index: int, record: dict, shared: dict) -> bool:
        """Publish, then the bench's word on round ``round_index``: True to run it."""
        self.publish(record, shared, "paired rounds", waiting=round_index)
        word = None
        if self.rank == 0:
            go = self.dir / f"go-{round_index}"
            while not go.exists() and not (self.dir / STOP).exists():
                if os.getppid() != self.parent:  # the bench is gone: nobody will answer
                    break
                time.sleep(POLL_S)
            word = go.exists() and not (self.dir / STOP).exists()
        return self._broadcast(word)

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]
