"""``python -m examples.grpo.paired --seeds 3 --steps N``: does HiLoRe change what is learned?

For each seed, a small GRPO run (``PAIRED_ARGS``: the reversal task) with gradient
checkpointing and with HiLoRe (same seed, same warm start, same prompts); then per seed and on average the final held-out reward of
each, their paired difference, and HiLoRe's measured relative gradient error per step
(against no checkpointing, on each step's first micro-batch). The paper's claim at our scale:
mean paired difference within 0.5 percentage points, mean gradient error <= 0.010.

``--hilore '{"force_plan": "L"}'`` changes keys of the ``"hilore"`` block of
``ds_config_hilore.json`` for this comparison (``L``: pack every unit in int8, a lossy plan);
other extra arguments go to the trainer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from pathlib import Path

from examples.grpo.compare import (
    ARMS,
    PAIRED_ARGS,
    fmt,
    hilore_config_with,
    launch,
    table,
)

TARGET_DIFF_PP = 0.5  # percentage points of held-out reward
TARGET_GRAD_ERROR = 0.010  # mean relative gradient error


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m examples.grpo.paired", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    parser.add_argument("--hilore", type=json.loads, default=None,
                        help='JSON object of "hilore" keys to change, e.g. \'{"force_plan": "L"}\'')
    parser.add_argument("--output_dir", default="output/paired")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks")
    return parser.parse_known_args()


def variant(args) -> str:
    """A name for the HiLoRe settings compared: ``hilore``, or ``hilore_<digest of the changes>``."""
    if not args.hilore:
        return "hilore"
    return "hilore_" + hashlib.sha256(json.dumps(args.hilore, sort_keys=True).encode()).hexdigest()[:8]


def hilore_arm_config(args) -> Path | None:
    if not args.hilore:
        return None
    return hilore_config_with(args.hilore, Path(args.output_dir) / f"ds_config_{variant(args)}.json")


def run_seed(args, seed: int, extra: list[str]) -> dict[str, dict]:
    """Both arms of one seed; a finished run of the same command is reused (the GC arms are
    shared by comparisons of several HiLoRe settings in one --output_dir)."""
    out = Path(args.output_dir) / f"seed{seed}"
    trainer_args = [*PAIRED_ARGS, "--num_train_steps", str(args.steps), "--seed", str(seed),
                    "--warm_start_dir", str(Path(args.output_dir) / "warm_start"), *extra]
    gc, hilore = ARMS
    return {"GC": launch(gc, out / "gc", trainer_args, args.nprocs, reuse=True),
            "HiLoRe": launch(hilore, out / variant(args), [*trainer_args, "--grad_error_interval", "1"],
                             args.nprocs, deepspeed_config=hilore_arm_config(args), reuse=True)}


def report(results: dict[int, dict[str, dict]]) -> tuple[str, dict]:
    rows = [("seed", "held-out before", "GC after", "HiLoRe after", "difference (pp)",
             "grad. error mean / max", "GC tok/s", "HiLoRe tok/s")]
    diffs, errors = [], []
    for seed, arms in results.items():
        gc, hl = arms["GC"], arms["HiLoRe"]
        diff = 100 * (hl["held_out_after"] - gc["held_out_after"])
        diffs.append(diff)
        errors.append(hl["grad_error_measured_mean"])
        rows.append((str(seed), f"{gc['held_out_before']:.4f}", f"{gc['held_out_after']:.4f}",
                     f"{hl['held_out_after']:.4f}", f"{diff:+.2f}",
                     f"{fmt(hl['grad_error_measured_mean'], '.4f')} / {fmt(hl.get('grad_error_measured_max'), '.4f')}",
                     fmt(gc["update_tokens_per_s"], ",.0f"), fmt(hl["update_tokens_per_s"], ",.0f")))
    known = [e for e in errors if e is not None]
    mean_diff = statistics.fmean(diffs)
    mean_error = statistics.fmean(known) if known else None
    rows.append(("mean", f"{_mean(results, 'GC', 'held_out_before'):.4f}",
                 f"{_mean(results, 'GC', 'held_out_after'):.4f}", f"{_mean(results, 'HiLoRe', 'held_out_after'):.4f}",
                 f"{mean_diff:+.2f}", fmt(mean_error, ".4f"), "", ""))
    holds = abs(mean_diff) <= TARGET_DIFF_PP and (mean_error is not None and mean_error <= TARGET_GRAD_ERROR)
    verdict = (f"target (|mean difference| <= {TARGET_DIFF_PP} pp, mean gradient error <= {TARGET_GRAD_ERROR}): "
               + ("holds" if holds else "does NOT hold"))
    numbers = {"mean_difference_pp": mean_diff, "mean_grad_error": mean_error, "target_holds": holds,
               "per_seed": {s: {"difference_pp": d, "grad_error": e} for s, d, e in zip(results, diffs, errors)}}
    return table(rows) + "\n" + verdict, numbers


def _mean(results: dict[int, dict[str, dict]], arm: str, key: str) -> float:
    return statistics.fmean(arms[arm][key] for arms in results.values())


def main() -> None:
    args, extra = parse_args()
    results = {seed: run_seed(args, seed, extra) for seed in range(1, args.seeds + 1)}
    text, numbers = report(results)
    numbers["hilore_changes"] = args.hilore
    Path(args.output_dir, f"paired_{variant(args)}.json").write_text(json.dumps(numbers, indent=1))
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
