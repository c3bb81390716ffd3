"""What a person watching the run sees: a progress bar, one line per step, a JSONL log
(``metrics.jsonl``: one record per step, step 0 = before training), a final summary
(``summary.json`` and printed) and a PNG of reward and actor-update throughput over steps.
Only rank 0 writes; records hold numbers already reduced over ranks.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

__all__ = ["Report", "format_step", "read_records", "summarise", "plot"]

MiB = 1 << 20


class Report:
    """Rank 0's view of the run; on other ranks every method does nothing."""

    def __init__(self, output_dir: str, total_steps: int, start_step: int, active: bool):
        self.active = active
        self.dir = Path(output_dir)
        self.jsonl = self.dir / "metrics.jsonl"
        self._bar = None
        if not active:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        records = [r for r in read_records(self.jsonl) if r["step"] <= start_step] if start_step else []
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))  # a resume drops later steps
        from tqdm.auto import tqdm

        # A bar only on a terminal: in a log file its redraws would bury the step lines.
        self._bar = tqdm(total=total_steps, initial=start_step, desc="GRPO", unit="step", file=sys.stderr,
                         dynamic_ncols=True, leave=False, disable=not sys.stderr.isatty())

    def log(self, record: dict) -> None:
        """Append ``record`` to the JSONL log and print its line above the progress bar."""
        if not self.active:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._bar.write(format_step(record), file=sys.stdout)
        sys.stdout.flush()
        if record["step"] > 0:
            self._bar.update(1)

    def message(self, text: str) -> None:
        if self.active:
            self._bar.write(text, file=sys.stdout)
            sys.stdout.flush()

    def finish(self, extra: dict) -> dict | None:
        """Summary (printed, ``summary.json``) and the PNG; returns the summary on rank 0."""
        if not self.active:
            return None
        self._bar.close()
        records = read_records(self.jsonl)
        png = self.dir / "grpo.png"
        summary = {**summarise(records), **extra, "png": str(png) if plot(records, png) else None}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(format_summary(summary), flush=True)
        return summary


def read_records(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------- one line
def _num(value, fmt: str, none: str = "n/a") -> str:
    return none if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_step(r: dict) -> str:
    """``step 12/40 | reward 0.612 | held-out 0.700 | ...`` (held-out only on evaluation steps)."""
    if r["step"] == 0:
        return f"step 0/{r['total_steps']} | held-out reward {r['held_out_reward']:.3f} (before training)"
    parts = [f"step {r['step']}/{r['total_steps']}", f"reward {r['train_reward']:.3f}"]
    if r.get("held_out_reward") is not None:
        parts.append(f"held-out {r['held_out_reward']:.3f}")
    parts += [f"loss {r['loss']:+.4f}", f"kl {_num(r['kl'], '.4f')}",
              f"update {_num(r['update_tokens_per_s'], ',.0f', 'metered')} tok/s"]
    if r.get("peak_bytes"):
        parts.append("peak " + "/".join(f"{b / MiB:.0f}" for b in r["peak_bytes"]) + " MiB")
    if r.get("actions"):
        a = r["actions"]
        parts.append(f"H/L/R/E {a['H']}/{a['L']}/{a['R']}/{a['E']}")
        measured = r.get("grad_error_measured")
        if measured is None and a["L"] == 0:
            measured = 0.0  # H and R are exact
        parts.append(f"grad err est {_num(r.get('grad_error_est'), '.4f')} meas {_num(measured, '.4f')}")
    return " | ".join(parts)


# ---------------------------------------------------------------------------------- summary
def summarise(records: list[dict]) -> dict:
    """Held-out reward before/after, throughput, peak memory, actions and gradient error."""
    steps = [r for r in records if r["step"] > 0]
    evals = [(r["step"], r["held_out_reward"]) for r in records if r.get("held_out_reward") is not None]
    timed = [r["update_tokens_per_s"] for r in steps[1:] if r.get("update_tokens_per_s")]  # step 1: warm-up
    timed_cpu = [r["update_tokens_per_cpu_s"] for r in steps[1:] if r.get("update_tokens_per_cpu_s")]
    peaks = [r["peak_bytes"] for r in steps if r.get("peak_bytes")]
    deltas = [r["peak_delta_bytes"] for r in steps if r.get("peak_delta_bytes")]
    errors = [r["grad_error_measured"] for r in steps if r.get("grad_error_measured") is not None]
    actions = {a: sum(r["actions"][a] for r in steps) for a in "HLRE"} if steps and steps[0].get("actions") else None
    return {
        "steps": len(steps),
        "held_out_before": evals[0][1] if evals else None,
        "held_out_after": evals[-1][1] if evals else None,
        "held_out_curve": evals,
        "train_reward_first": steps[0]["train_reward"] if steps else None,
        "train_reward_last": steps[-1]["train_reward"] if steps else None,
        "update_tokens_per_s": statistics.median(timed) if timed else None,
        "update_tokens_per_cpu_s": statistics.median(timed_cpu) if timed_cpu else None,
        "peak_bytes_per_rank": [max(p[i] for p in peaks) for i in range(len(peaks[0]))] if peaks else None,
        "peak_delta_bytes_per_rank": [max(p[i] for p in deltas) for i in range(len(deltas[0]))] if deltas else None,
        "actions": actions,
        "grad_error_measured_mean": statistics.fmean(errors) if errors else
        (0.0 if actions is not None and actions["L"] == 0 else None),
        "grad_error_measured_max": max(errors) if errors else None,
        "update_seconds": sum(r["update_s"] for r in steps),
        "wall_seconds": sum(r["step_s"] for r in steps),
    }


def format_summary(s: dict) -> str:
    peaks = s.get("peak_bytes_per_rank")
    deltas = s.get("peak_delta_bytes_per_rank")
    lines = [
        "summary",
        f"  held-out reward   {_num(s['held_out_before'], '.3f')} -> {_num(s['held_out_after'], '.3f')}",
        f"  train reward      {_num(s['train_reward_first'], '.3f')} (step 1) -> {_num(s['train_reward_last'], '.3f')}",
        f"  actor update      {_num(s['update_tokens_per_s'], ',.0f')} tokens/s, "
        f"{_num(s['update_tokens_per_cpu_s'], ',.0f')} tokens per CPU-second (medians); "
        f"{s['update_seconds']:.1f} s of {s['wall_seconds']:.1f} s",
        "  peak memory       " + ("n/a" if not peaks else
                                  " / ".join(f"{p / MiB:.0f}" for p in peaks) + " MiB per rank, update +"
                                  + " / ".join(f"{d / MiB:.1f}" for d in deltas) + " MiB"),
    ]
    if s.get("actions"):
        a = s["actions"]
        lines.append(f"  HiLoRe actions    H {a['H']}  L {a['L']}  R {a['R']}  E {a['E']} (unit-microbatches)")
        lines.append(f"  gradient error    {_num(s['grad_error_measured_mean'], '.4f')} (mean measured)")
    if s.get("png"):
        lines.append(f"  plot              {s['png']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- plot
def plot(records: list[dict], path: Path) -> bool:
    """Reward (train, held-out) and actor-update tokens/s over steps; False if nothing to plot."""
    steps = [r for r in records if r["step"] > 0]
    if not steps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot([r["step"] for r in steps], [r["train_reward"] for r in steps], label="train (sampled)")
    evals = [(r["step"], r["held_out_reward"]) for r in records if r.get("held_out_reward") is not None]
    top.plot(*zip(*evals), "o-", label="held-out (greedy)")
    top.set_ylabel("reward")
    top.legend()
    timed = [(r["step"], r["update_tokens_per_s"]) for r in steps if r.get("update_tokens_per_s")]
    if timed:
        bottom.plot(*zip(*timed), ".-")
    bottom.set_ylabel("actor update tokens/s")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
