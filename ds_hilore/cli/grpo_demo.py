"""``hilore grpo-demo``: how concentrated the loss coefficients of one GRPO update are."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "run"]

HELP = "how concentrated the loss coefficients of a synthetic GRPO batch are"
DESCRIPTION = ("For every GRPO loss type, on a synthetic batch: the share of tokens whose "
               "coefficient ω = dL/dlogp is exactly 0 (groups without reward spread, clipped "
               "tokens, padding), and the share of Σ|ω| on the top 10 % of tokens -- what HiLoRe's "
               "exposure weighs.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=16, help="prompts in the batch (default 16)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--length", type=int, default=512, help="completion length (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from ds_hilore.bench.grpo_demo import demo

    demo(args.prompts, args.group, args.length, args.seed)
    return 0
