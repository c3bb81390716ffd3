"""``hilore grpo-demo``: how concentrated the loss coefficients of one GRPO update are."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "run"]

HELP = "how concentrated the loss coefficients of a synthetic GRPO batch are"
DESCRIPTION = ("For every GRPO loss type, on a synthetic batch: the share of tokens whose "
               "coefficient ω = dL/dlogp is exactly 0 (groups without reward spread, clipped "
               "tokens, padding), and the share of Σ|ω| on the top 10 % of tokens -- what HiLoRe's "
               "exposure weighs.")
# flag -> (default, the least it takes: two prompts (one never solved, one always), two
# completions for a reward spread, a length whose shortest completions (an eighth) have a token)
_FLAGS = {"prompts": (16, 2), "group": (8, 2), "length": (512, 8)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=_FLAGS["prompts"][0],
                        help=f"prompts in the batch (default {_FLAGS['prompts'][0]})")
    parser.add_argument("--group", type=int, default=_FLAGS["group"][0],
                        help=f"completions per prompt (default {_FLAGS['group'][0]})")
    parser.add_argument("--length", type=int, default=_FLAGS["length"][0],
                        help=f"completion length (default {_FLAGS['length'][0]})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from ds_hilore.bench.grpo_demo import demo
    from ds_hilore.cli.common import one_line_error

    for flag, (default, least) in _FLAGS.items():
        if getattr(args, flag) < least:
            one_line_error(f"--{flag} {getattr(args, flag)}: must be >= {least}; pass e.g. "
                           f"--{flag} {default}.")
    demo(args.prompts, args.group, args.length, args.seed)
    return 0
