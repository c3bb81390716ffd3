"""``hilore bench``: each activation method through a DeepSpeed engine on ranks the bench
launches itself, the GRPO actor update timed in paired rounds (or over a whole run), and the
verdicts.

The pipeline (``main``), one stage a module, each reading only what the stages above made:

1. options (``options.check_args``): the flags, checked, as a ``Config``;
   on a CPU with ``codec_backend`` "compile", the codec's kernels are built ahead first, once
   per machine (NOTE [ Codec kernels built ahead ] in runtime/codec_ahead.py);
2. ranks (``launch.run_ranks``): ``config.ranks`` processes, each building the seeded model,
   its part of the GRPO data (``data``) and one engine per method (``engines``; the registry:
   ``methods``), then the paired mode (``rounds``: warm-up, peaks, gradients, paired rounds)
   or the whole run (``wholerun``); rank 0 writes every rank's raw samples (``link``);
3. the report (``summary.document``): per round the slowest rank's time, per run the largest
   rank's peak, the rows, the paired comparisons (``paired``) and the targets (``targets``);
4. the output (``report``): the JSON, the table, the plot.

While the ranks run, a ``Conductor`` reads their samples: it rewrites the JSON (``stop.reason``
``"running"``), prints each round with its ETA and says whether the next round runs.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

from ds_hilore.bench import report, summary
from ds_hilore.bench.launch import RankFailure, run_ranks
from ds_hilore.bench.options import BenchError, Config, check_args
from ds_hilore.bench.paired import MIN_ROUNDS
from ds_hilore.bench.targets import decisive

__all__ = ["AUTO_MINUTES", "BenchError", "Conductor", "RankFailure", "main"]

AUTO_MINUTES = 30.0  # --rounds auto without --max-minutes
MAX_ROUNDS = 200  # --rounds auto stops here at the latest


def main(args) -> int:
    """``hilore bench`` (not ``--report``): the pipeline of the module docstring; the exit
    status (1 when nothing was timed)."""
    config = check_args(args)  # 1. options
    if config.codec_backend == "compile" and config.device == "cpu":  # once per machine
        from ds_hilore.runtime.codecs import build_ahead  # NOTE [ Codec kernels built ahead ]

        dtypes = dict.fromkeys([torch_dtype(config.dtype), torch_dtype("fp32")])  # fp32 too:
        build_ahead(["int8"], list(dtypes), say=_say)  # what a bf16 model's norms save
    conductor = Conductor(config, args.json)
    samples = run_ranks(config, conductor)  # 2. the ranks: data, engines, rounds
    if samples is None:
        raise RankFailure("the ranks ended before rank 0 wrote anything")
    document = conductor.document(samples, final=True)  # 3. the report
    return _output(document, args.json, args.plot)  # 4. JSON, table, plot


def _output(document: dict[str, Any], json_path: str | None, plot_path: str | None) -> int:
    if json_path:  # before the table: a table that fails loses nothing
        save(document, json_path)
        _say(f"wrote {json_path}")
    timed = (document["run"]["steps"] if "run" in document else document["rounds"])
    if not timed:
        phase = document["samples"]["shared"].get("phase")
        print(f"hilore bench: error: interrupted while {phase}, before any timed step"
              + (f"; what was measured is in {json_path}" if json_path else ""), file=sys.stderr)
        return 1
    print(report.text(document))
    if plot_path:
        report.draw(document, plot_path)
        _say(f"wrote {plot_path}")
    return 0


def save(document: dict[str, Any], path: str) -> None:
    """The JSON whole or not at all: written aside, then renamed."""
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
        handle.write("\n")
    os.replace(path + ".tmp", path)


def torch_dtype(name: str):
    import torch

    return torch.bfloat16 if name == "bf16" else torch.float32


def _say(message: str) -> None:
    print(f"hilore bench: {message}", file=sys.stderr, flush=True)


class Conductor:
    """The bench's side while the ranks run (``launch.Listener``)."""

    def __init__(self, config: Config, json_path: str | None):
        self.config, self.json_path = config, json_path
        self.begin = time.perf_counter()
        auto = config.rounds == "auto"
        minutes = config.max_minutes or (AUTO_MINUTES if auto else None)
        self.limit_s = None if minutes is None else 60.0 * minutes
        self.target = MAX_ROUNDS if auto else config.rounds
        self.stop: dict[str, Any] = {"reason": "running", "undecided": []}
        self.said_steps = 0

    def document(self, samples: dict[str, Any], final: bool = False) -> dict[str, Any]:
        """The report of ``samples``; ``final``: the rounds' end said (an end the bench did
        not ask for was an interrupt)."""
        stop, phase = dict(self.stop), samples["shared"].get("phase")
        if final and stop["reason"] == "running":
            stop["reason"] = "interrupted" if phase != "done" else (
                "steps" if self.config.run_steps else "rounds")
        if final and phase != "done":
            stop["phase"] = phase
        return summary.document(self.config.to_dict(), samples, stop,
                                time.perf_counter() - self.begin)

    def seen(self, samples: dict[str, Any]) -> None:
        """New samples: the JSON rewritten; in the whole run, a line per step."""
        if self.json_path:
            save(self.document(samples), self.json_path)
        steps = samples["ranks"][0].get("steps", [])
        every = max(1, (self.config.run_steps or 0) // 20)  # at most about 20 lines
        if self.config.run_steps and len(steps) >= self.said_steps + every:
            self.said_steps = len(steps)
            pace = sum(sum(s["wall_s"].values()) for s in steps) / len(steps)  # one rank's
            self._eta_line(f"step {len(steps)}/{self.config.run_steps} of every run",
                           len(steps), self.config.run_steps, pace)

    def word(self, samples: dict[str, Any], index: int) -> bool:
        """Whether round ``index`` runs: not past the count, the decisive comparisons not all
        decided (``--rounds auto``), and one more round ends within the time."""
        if self.stop["reason"] != "running":  # interrupted
            return False
        doc = self.document(samples)
        rounds = doc["rounds"]
        per_round = (sum(sum(r["wall_s"].values()) for r in rounds) / len(rounds)) if rounds else 0.0
        checks = decisive(doc) if doc.get("gc_peak_bytes") else []
        undecided = [f"{c['run']} vs {c['rival']}" for c in checks if not c["decided"]]
        reason = None
        if index >= self.target:
            reason = "rounds"
        elif (self.config.rounds == "auto" and index >= MIN_ROUNDS and checks
              and not undecided):
            reason = "decided"
        elif (self.limit_s is not None and rounds
              and self._elapsed() + per_round > self.limit_s):
            reason = "max_minutes"
        if reason is not None:
            self.stop = {"reason": reason, "undecided": undecided}
            return False
        self._round_line(index, per_round)
        return True

    def interrupted(self) -> None:
        """An interrupt: the rounds end, said so."""
        if self.stop["reason"] == "running":
            self.stop = {"reason": "interrupted", "undecided": []}

    def _elapsed(self) -> float:
        return time.perf_counter() - self.begin

    def _round_line(self, index: int, per_round: float) -> None:
        if self.config.rounds != "auto":
            self._eta_line(f"round {index + 1}/{self.target}", index, self.target, per_round)
            return
        pace = f", {per_round:.1f} s a round" if per_round else ""
        latest = "" if self.limit_s is None else (
            f"; ETA at the latest {_clock(self.limit_s - self._elapsed())} (--max-minutes "
            f"{self.limit_s / 60:g})")
        _say(f"round {index + 1} (auto{pace}): until the decisive comparisons are decided"
             f"{latest}")

    def _eta_line(self, what: str, done: int, total: int, per_item: float) -> None:
        """``what``, with when the remaining items end at ``per_item`` seconds each."""
        eta = f", ETA {_clock(per_item * (total - done))}" if done and per_item else ""
        _say(f"{what}{eta}")


def _clock(seconds: float) -> str:
    """The wall-clock time ``seconds`` from now, HH:MM:SS."""
    return (datetime.datetime.now() + datetime.timedelta(seconds=max(0.0, seconds))
            ).strftime("%H:%M:%S")
