"""``python -m ds_hilore.grpo --demo``: coefficient statistics of a synthetic GRPO batch."""

import argparse
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_hilore.grpo",
                                     description="GRPO losses with exact per-token coefficients")
    parser.add_argument("--demo", action="store_true", help="print coefficient statistics of a synthetic batch")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.demo:
        parser.print_help()
        return
    from ds_hilore.bench.grpo_demo import demo

    demo(args.prompts, args.group, args.length, args.seed)


if __name__ == "__main__":
    main()
