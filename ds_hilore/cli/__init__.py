"""The ``hilore`` command: one module per subcommand, each with ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> exit status``; shared helpers in ``common``.

    hilore env                                  versions, accelerator, whether the codec compiles
    hilore check-config ds_config.json          validate the "hilore" block; exit 2 on error
    hilore units --model qwen2                  recovery units HiLoRe finds in a model
    hilore profile --model paper-cpu --seq-len 256 --micro-batch 8
                                                what each unit costs, what HiLoRe plans
    hilore bench --model paper-cpu              activation methods through DeepSpeed on 2 ranks
    hilore bench --model paper-cpu --run-steps 40 --lengths 128,256,512
    hilore grpo-demo                            how concentrated one GRPO update's coefficients are

``--model`` means one thing everywhere (NOTE [ One meaning of --model ] in common.py).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Sequence

from ds_hilore.cli.common import EXIT_CONFIG_ERROR, one_line_error

__all__ = ["COMMANDS", "EXIT_CONFIG_ERROR", "build_parser", "main"]

# subcommand -> its module (under ds_hilore.cli), in the order ``hilore --help`` lists them
COMMANDS = {"env": "env", "check-config": "check_config", "units": "units", "profile": "profile",
            "bench": "bench", "grpo-demo": "grpo_demo"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hilore`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.module.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hilore", description="HiLoRe for DeepSpeed: store (H), pack (L) or recompute (R) "
        "the activations of each recovery unit -- a replacement for gradient checkpointing. "
        "`hilore COMMAND --help` says what each command does.")
    parser.error = one_line_error  # an unknown flag after any command: one line, exit 2
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"ds_hilore.cli.{module_name}")
        command = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(command)
        command.set_defaults(module=module)
        command.error = one_line_error  # a bad flag: one line naming it, exit 2
    return parser
