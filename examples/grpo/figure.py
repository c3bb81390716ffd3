"""The demo's figure: both runs overlaid, step by step -- train reward, held-out reward and the
actor update's tokens per second, with HiLoRe's warm-up steps shaded.

    plot(gc_records, hilore_records, "output/demo/demo.png")
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ARM_STYLES", "plot"]

ARM_STYLES = {"GC": dict(color="tab:blue", label="gradient checkpointing"),
              "HiLoRe": dict(color="tab:orange", label="HiLoRe")}


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _shade_warm_up(ax, records: list[dict], label: bool) -> None:
    """A light band over each step in which HiLoRe measured rather than only trained."""
    first = True
    for r in records:
        if r["step"] > 0 and r.get("warm_up"):
            ax.axvspan(r["step"] - 0.5, r["step"] + 0.5, color="tab:orange", alpha=0.12, lw=0,
                       label="HiLoRe measuring (warm-up)" if label and first else None)
            first = False


def plot(gc_records: list[dict], hilore_records: list[dict], path: str | Path) -> Path:
    """Three panels sharing the step axis; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {"GC": gc_records, "HiLoRe": hilore_records}
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    panels = (("train_reward", "train reward\n(sampled completions)", ""),
              ("held_out_reward", "held-out reward\n(greedy completions)", "o"),
              ("update_tokens_per_s", "actor update\ntokens per second", "."))
    for i, (ax, (key, ylabel, marker)) in enumerate(zip(axes, panels)):
        _shade_warm_up(ax, hilore_records, label=i == 2)
        for name, records in runs.items():
            # rewards: HiLoRe dashed over GC's solid line, so that equal curves both show
            line = "--" if name == "HiLoRe" and key != "update_tokens_per_s" else "-"
            ax.plot(*_series(records, key), marker=marker or None, ls=line, **ARM_STYLES[name])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("training step (steps metered for memory have no throughput)")
    axes[0].set_title("The same seeded GRPO run with gradient checkpointing and with HiLoRe")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
