"""``python -m examples.grpo.demo`` (``make demo``): the same seeded GRPO run twice -- with
gradient checkpointing and with HiLoRe -- on 2 ranks with ZeRO-2 and LoRA, then side by side:
held-out reward before and after, actor-update tokens/s, peak memory per rank, HiLoRe's
H/L/R/E mix, the gradient error, and where the plots are.

Extra arguments go to the trainer of both runs (e.g. ``--num_train_steps 20``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from examples.grpo.compare import (
    ARMS,
    DEMO_ARGS,
    actions,
    fmt,
    grad_error,
    launch,
    mib,
    table,
)

MiB = 1 << 20


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m examples.grpo.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default="output/demo")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nprocs", type=int, default=2, help="ranks")
    return parser.parse_known_args()


def run_arms(args, extra: list[str]) -> dict[str, dict]:
    out = Path(args.output_dir)
    trainer_args = [*DEMO_ARGS, "--seed", str(args.seed), "--warm_start_dir", str(out / "warm_start"), *extra]
    return {arm.name: launch(arm, out / arm.name.lower(), trainer_args, args.nprocs) for arm in ARMS}


def _speed(gc: dict, hl: dict, key: str) -> tuple[str, str]:
    """GC's and HiLoRe's medians of ``key``; HiLoRe's with its ratio to GC's."""
    a, b = gc.get(key), hl.get(key)
    ratio = f" ({b / a:.2f}x)" if a and b else ""
    return fmt(a, ",.0f"), fmt(b, ",.0f") + ratio


def side_by_side(summaries: dict[str, dict], seconds: float) -> str:
    gc, hl = summaries["GC"], summaries["HiLoRe"]
    rows = [
        ("", "GC", "HiLoRe"),
        ("held-out reward before", fmt(gc["held_out_before"], ".3f"), fmt(hl["held_out_before"], ".3f")),
        ("held-out reward after", fmt(gc["held_out_after"], ".3f"), fmt(hl["held_out_after"], ".3f")),
        ("actor update tokens/s", *_speed(gc, hl, "update_tokens_per_s")),
        ("  per CPU-second (less noisy)", *_speed(gc, hl, "update_tokens_per_cpu_s")),
        ("peak memory per rank, MiB", mib(gc["peak_bytes_per_rank"]), mib(hl["peak_bytes_per_rank"])),
        ("  of which the update, MiB", mib(gc["peak_delta_bytes_per_rank"]), mib(hl["peak_delta_bytes_per_rank"])),
        ("H/L/R/E (unit-microbatches)", actions(gc), actions(hl)),
        ("mean gradient error", grad_error(gc), grad_error(hl)),
        ("actor update / run, s", f"{gc['update_seconds']:.0f} / {gc['wall_seconds']:.0f}",
         f"{hl['update_seconds']:.0f} / {hl['wall_seconds']:.0f}"),
    ]
    plan = hl.get("force_plan")
    note = (f"HiLoRe plan: force_plan {plan} (set in examples/grpo/ds_config_hilore.json)" if plan
            else "HiLoRe plan: chosen by the allocator")
    return "\n".join([table(rows), note, "throughput: medians over steps 2..N (step 1 is metered for "
                      "memory); other jobs on the machine move wall-clock numbers, CPU-seconds much less",
                      f"plots: {gc['png']}, {hl['png']}", f"both runs: {seconds / 60:.1f} min"])


def main() -> None:
    args, extra = parse_args()
    start = time.perf_counter()
    summaries = run_arms(args, extra)
    print("\n" + side_by_side(summaries, time.perf_counter() - start), flush=True)


if __name__ == "__main__":
    main()
