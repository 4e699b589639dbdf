"""Plots of a run: loss (train and validation), learning rate and throughput, to PNG.

Owns: `plot_run(run_dir)`, behind `shardwise plot RUN_DIR`, which marks each change of
the data-parallel ranks (a node lost or gained) on the loss curve. Needs matplotlib (the `plot`
extra); without it, a clear error says how to install it.

Must not: read anything but the run's metrics.csv.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.train.metrics import read_metrics


def _series(rows: list[dict[str, Any]], split: str, key: str) -> tuple[list[float], list[float]]:
    points = [
        (r["step"], r[key])
        for r in rows
        if r.get("split") == split and r.get(key) is not None and "step" in r
    ]
    return [p[0] for p in points], [p[1] for p in points]


def world_changes(rows: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """(step, data-parallel ranks before, after) at each training row whose `dp_world`
    differs from the row before: where a resume continued on other ranks."""
    out, last = [], None
    for r in rows:
        world = r.get("dp_world")
        if r.get("split") != "train" or world is None or "step" not in r:
            continue
        if last is not None and world != last:
            out.append((int(r["step"]), int(last), int(world)))
        last = world
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render RUN_DIR/metrics.csv to a PNG (default RUN_DIR/metrics.png) and return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "shardwise plot needs matplotlib: pip install 'shardwise[plot]'."
        ) from None
    rows = read_metrics(run_dir)
    if not any(r.get("split") == "train" for r in rows):
        raise ValueError(f"{Path(run_dir) / 'metrics.csv'} has no training rows to plot.")
    rate_key = "tokens_per_s" if any("tokens_per_s" in r for r in rows) else "samples_per_s"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for split, style in (("train", "-"), ("val", "o-")):
        x, y = _series(rows, split, "loss")
        if x:
            ax.plot(x, y, style, label=split)
    for step, before, after in world_changes(rows):
        ax.axvline(step, color="grey", linestyle=":", label=f"ranks {before} -> {after}")
    ax.set(title="loss", xlabel="step")
    ax.legend()
    for ax, key, title in (
        (axes[1], "lr", "learning rate"),
        (axes[2], rate_key, rate_key.replace("_", " ")),
    ):
        x, y = _series(rows, "train", key)
        ax.plot(x, y)
        ax.set(title=title, xlabel="step")
    fig.tight_layout()
    path = Path(out) if out is not None else Path(run_dir) / "metrics.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
