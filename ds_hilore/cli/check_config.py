"""``hilore check-config``: validate the "hilore" block of a ds_config file."""

from __future__ import annotations

import argparse
import json
import sys

from ds_hilore.cli.common import EXIT_CONFIG_ERROR

__all__ = ["HELP", "add_arguments", "run"]

HELP = "validate the \"hilore\" block of a ds_config file"
DESCRIPTION = ("Print the resolved \"hilore\" block (defaults filled in) of a ds_config file, or "
               f"the error naming the key and the fix; exit {EXIT_CONFIG_ERROR} on error. Names "
               "checked against a model (force_plan globs, layer_pattern, children) are checked "
               "when HiLoRe attaches.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="DS_CONFIG", help="a ds_config JSON file")


def run(args: argparse.Namespace) -> int:
    from ds_hilore import HiLoReConfig, HiLoReConfigError

    try:
        config = HiLoReConfig.from_ds_config(args.path)
    except HiLoReConfigError as error:
        print(f"error in {args.path}:\n{error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not config.enabled:
        print(f"{args.path}: HiLoRe is off (no \"hilore\" block, or \"enabled\": false).")
    else:
        print(f"{args.path}: the \"hilore\" block is valid; resolved (defaults filled in):")
    print(json.dumps({"hilore": config.to_dict()}, indent=2))
    return 0
