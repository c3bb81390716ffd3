"""The whole-run mode on one rank (``--run-steps N``): fresh engines, N optimizer steps each
from the very first, HiLoRe's warm-up included, interleaved step by step.

Step i of every run comes back to back, on the same data (sequence length ``lengths[i]``,
drawn per step from ``--lengths``: several shape buckets arise, each profiled and planned when
it first comes), the order rotating by one from step to step, each step between barriers.
Per step and run the rank keeps its (wall, CPU) seconds and, for a HiLoRe allocator, the
warm-up work its stats show (``stats.step_work``). Nothing is warmed or measured beforehand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_hilore.bench import data, stats
from ds_hilore.bench.engines import Run, close_run, rank_steps, timed_step
from ds_hilore.bench.methods import METHODS
from ds_hilore.bench.models import lm_of
from ds_hilore.runtime.codecs import compile_failures
from ds_hilore.bench.rounds import Interrupted, open_runs

__all__ = ["whole_run"]


def whole_run(config, base: torch.nn.Module, link) -> None:
    """The whole run (see the module docstring); ``link``: the run folder's ``Link``."""
    vocab = lm_of(base).get_output_embeddings().weight.shape[0]
    lengths = data.step_lengths(list(config.lengths), config.run_steps, config.seed)
    steps = rank_steps(config, vocab, dist.get_rank(), lengths)
    record = {"rank": dist.get_rank(), "steps": []}
    shared = {"runs": [], "skipped": {}, "notes": {}, "lengths": lengths,
              "tokens": [s.tokens for s in steps], "hilore": {}, "phase": "opening the engines"}
    runs: list[Run] = []
    try:
        open_runs(runs, base, config, None, record, shared, link)
        live = [r for r in runs if r.engine is not None]
        shared["phase"] = "running the whole run"
        link.say(f"whole run: {len(steps)} steps of {len(live)} runs, lengths {sorted(set(lengths))}")
        readings = {r.label: None for r in live}
        for step in steps:
            record["steps"].append(_one_step(live, step, readings, config.device))
            _digests(live, shared)
            link.publish(record, shared, "whole run")
            if link.stopped():
                raise Interrupted
        shared["phase"] = "done"
    except Interrupted:
        link.say(f"interrupted while {shared['phase']}")
    finally:
        shared["codec_compile_failures"] = compile_failures()  # they run eager
        link.publish(record, shared, shared["phase"])
        for run in runs:
            close_run(run)


def _one_step(live: list[Run], step, readings: dict, device: str) -> dict:
    """Step ``step.index`` of every run, the order rotated by the index: this rank's seconds
    and each allocator's warm-up work (``readings``: each run's last stats, updated)."""
    shift = step.index % len(live)
    order = live[shift:] + live[:shift]
    entry = {"step": step.index, "seq_len": step.seq_len, "order": [r.label for r in order],
             "wall_s": {}, "cpu_s": {}, "work": {}}
    for run in order:
        entry["wall_s"][run.label], entry["cpu_s"][run.label] = timed_step(run, step, device)
        runtime = run.engine.hilore
        if runtime is not None and METHODS[run.method].allocator:
            after = runtime.stats
            validates = runtime.config.plan_validation_microbatches > 0
            entry["work"][run.label] = stats.step_work(readings[run.label], after, validates,
                                                       [step.seq_len])
            readings[run.label] = after
    return entry


def _digests(live: list[Run], shared: dict) -> None:
    if dist.get_rank() == 0:
        for run in live:
            if run.engine.hilore is not None:
                shared["hilore"][run.label] = stats.digest(run.engine.hilore.stats)
