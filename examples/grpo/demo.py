"""``python -m examples.grpo.demo`` (``make demo``): the same seeded GRPO run twice -- with gradient
checkpointing and with HiLoRe -- on 2 ranks with ZeRO-2 and LoRA, where activations matter
(``DEMO_ARGS``: answers of up to 200 tokens, 8 sequences per microbatch), the two runs taking each
step in turns (NOTE [ Runs in turns ] in examples/grpo/turns.py), then side by side: the actor
update's time per step (paired, steady steps) and over the whole run (HiLoRe's warm-up included),
peak memory per rank against the budget, held-out reward, the FLOP regime, and one figure with both
runs overlaid. Writes ``summary.json`` and ``demo.png`` under ``--output_dir``
(NOTE [ The demo's accounting ] in examples/grpo/accounting.py says what each figure means).

Extra arguments go to the trainer of both runs (e.g. ``--num_train_steps 20``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ds_hilore.runtime.codecs import build_ahead
from examples.grpo.accounting import account
from examples.grpo.compare import ARMS, DEMO_ARGS, fmt, launch_in_turns, table
from examples.grpo.figure import plot
from examples.grpo.report import read_records

MiB = 1 << 20


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m examples.grpo.demo", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--output_dir", default="output/demo")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nprocs", type=int, default=2, help="ranks")
    return parser.parse_known_args()


def run_arms(args, extra: list[str]) -> dict[str, Path]:
    """Both runs, started together and taking each step in turns; their output folders."""
    out = Path(args.output_dir)
    # the codec's kernels, once per machine, before the runs (NOTE [ Codec kernels built ahead ]
    # in ds_hilore/runtime/codec_ahead.py): the HiLoRe run then loads them, as later runs would
    if not torch.cuda.is_available():  # CPU kernels only
        build_ahead(["int8"], [torch.float32], say=lambda line: print(line, flush=True))
    trainer_args = [*DEMO_ARGS, "--seed", str(args.seed), "--warm_start_dir", str(out / "warm_start"), *extra]
    dirs = {arm.name: out / arm.name.lower() for arm in ARMS}
    launch_in_turns(ARMS, list(dirs.values()), trainer_args, args.nprocs)  # NOTE [ Runs in turns ]
    return dirs


def conclude(dirs: dict[str, Path], output_dir: Path, seconds: float) -> dict:
    """The accounting of both runs, the figure, and ``summary.json``; returns the summary."""
    records = {name: read_records(d / "metrics.jsonl") for name, d in dirs.items()}
    summaries = {name: json.loads((d / "summary.json").read_text()) for name, d in dirs.items()}
    numbers = account(records["GC"], records["HiLoRe"], summaries["GC"], summaries["HiLoRe"])
    numbers["figure"] = str(plot(records["GC"], records["HiLoRe"], output_dir / "demo.png"))
    numbers["minutes"] = seconds / 60
    (output_dir / "summary.json").write_text(json.dumps(numbers, indent=1))
    return numbers


# ---------------------------------------------------------------------------------- the table
def _per_step(p: dict) -> str:
    if p["median"] is None:
        return "n/a (no steady step)"
    interval = "no interval below 6 steps" if p["low"] is None else f"95 % interval {p['low']:.3f}-{p['high']:.3f}"
    return f"{p['median']:.3f}x ({interval}; {p['n']} steps: {p['verdict']})"


def _peaks(p: dict) -> tuple[str, str]:
    if not p["gc_bytes"] or not p["hilore_bytes"]:
        return "n/a", "n/a"
    gc = " / ".join(f"{b / MiB:.0f}" for b in p["gc_bytes"])
    hl = " / ".join(f"{b / MiB:.0f}" for b in p["hilore_bytes"])
    ratios = " / ".join(f"{r:.3f}x" for r in p["ratio"])
    return gc, (f"{hl} ({ratios} GC's; largest {p['largest_ratio']:.3f}x, budget "
                f"{fmt(p['memory_budget'], '.2f')}x)")


def _reward(q: dict, arm: str) -> str:
    return f"{fmt(q[arm + '_before'], '.3f')} -> {fmt(q[arm + '_after'], '.3f')}"


def _gflops(value) -> str:
    return fmt(None if value is None else value / 1e9, ",.1f")


def text(numbers: dict) -> str:
    """The printed summary: the table, then how to read it."""
    w, p, q, r, mix = (numbers[k] for k in ("whole_run", "per_step", "quality", "regime", "plan_mix"))
    same = "the same trajectory, bitwise" if q["bitwise"] else ("the same" if q["same_after"] else "differs")
    rows = [("", "GC", "HiLoRe"),
            ("actor update, whole run, s", f"{w['gc_s']:.1f}",
             f"{w['hilore_s']:.1f} (GC / HiLoRe {fmt(w['speedup'], '.3f')}x)"),
            ("  HiLoRe's warm-up: steps, s above GC", "-",
             f"{len(w['warm_up_steps'])} steps, {w['warm_up_cost_s']:+.1f} s"),
            ("per steady step, GC time / HiLoRe time", "1", _per_step(p)),
            ("peak memory per rank, MiB", *_peaks(numbers["peaks"])),
            ("held-out reward before -> after", _reward(q, "gc"), f"{_reward(q, 'hilore')} ({same})"),
            ("recomputed GFLOPs (one step, all ranks)", _gflops(r["gc_recomputed_flops"]),
             _gflops(r["hilore_recomputed_flops"]) + (f" ({r['recompute_avoided']:.0%} avoided)"
                                                     if r["recompute_avoided"] is not None else "")),
            ("plan, unit-microbatches H/L/R/E", "-", "n/a" if not mix else f"{mix['H']}/{mix['L']}/{mix['R']}/{mix['E']}")]
    share = fmt(None if r["gc_recompute_share"] is None else 100 * r["gc_recompute_share"], ".0f")
    regime = (f"regime: GC recomputes {share} % of its update's FLOPs ({_gflops(r['gc_update_flops'])} GFLOPs "
              f"a step, all ranks); {r['sequences_per_microbatch']} sequences (~"
              f"{fmt(r['tokens_per_microbatch'], '.0f', '?')} tokens) per microbatch")
    return "\n".join([
        table(rows), regime,
        "update times: each step's slowest rank, generation and evaluation left out; steady steps: no warm-up "
        "work on any rank and not metered for memory; ratios above 1: HiLoRe faster",
        f"figure: {numbers['figure']}; summary: {Path(numbers['figure']).with_name('summary.json')}",
        f"both runs: {numbers['minutes']:.1f} min"])


def main() -> None:
    args, extra = parse_args()
    start = time.perf_counter()
    dirs = run_arms(args, extra)
    print("\n" + text(conclude(dirs, Path(args.output_dir), time.perf_counter() - start)), flush=True)


if __name__ == "__main__":
    main()
