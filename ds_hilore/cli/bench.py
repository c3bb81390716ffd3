"""``hilore bench``: activation methods through DeepSpeed engines on several ranks (the flags are
``ds_hilore.bench.options``'; the run is ``ds_hilore.bench.bench.main``)."""

from __future__ import annotations

import argparse
import sys

from ds_hilore.cli.common import EXIT_CONFIG_ERROR

__all__ = ["HELP", "add_arguments", "run"]

HELP = "time activation methods through DeepSpeed engines on several ranks"
DESCRIPTION = (
    "Launch --ranks processes (gloo on a CPU, NCCL on GPUs) and run the GRPO actor update "
    "(forward, loss, engine.backward, engine.step) of each activation method (no checkpointing, "
    "HF GC, HiLoRe and its variants at each memory budget, ...) through its own DeepSpeed "
    "engine (ZeRO --zero-stage) on copies of one model, on GRPO-shaped steps. Paired mode "
    "(default): warm-up, peak memory, the step's gradient error against no checkpointing, then "
    "paired rounds (every method one step per round, the order rotating; a step's time the "
    "slowest rank's) and, per pair, the median paired ratio with its 95 % interval. Whole-run "
    "mode (--run-steps): fresh engines, HiLoRe's warm-up included, and what the warm-up cost "
    "against GC. Prints a table; --json and --plot write the report and the plot.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ds_hilore.bench.options import add_arguments as add_bench_arguments

    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ds_hilore.bench import bench, report

    try:
        if args.report:
            return report.show(args.report, args.plot)
        return bench.main(args)
    except (bench.BenchError, report.BenchReportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except bench.RankFailure as error:
        print(f"hilore bench: error: {error}", file=sys.stderr)
        return 1
