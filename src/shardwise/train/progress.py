"""What a run shows while it trains: rank 0's progress bar, its lines, and each step's rates.

Owns: the rich progress bar (rank 0 only), the one-line messages the Runner prints on rank
0's stderr, and the per-update row of rates (samples and tokens per second, peak memory)
that the metrics files record.

Must not: write files (train/metrics.py does) or issue collectives.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch

from shardwise.distributed.process_group import rank_and_world


def say(message: str) -> None:
    """One line on rank 0's stderr (the Runner's only output besides the progress bar)."""
    if rank_and_world()[0] == 0:
        print(f"shardwise: {message}", file=sys.stderr, flush=True)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def count_batch(batch: Any) -> tuple[int, int]:
    """(samples, tokens) in a batch: dim 0 of the first tensor; elements of the first
    integer tensor (token ids) if there is one."""
    tensors: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)

    collect(batch)
    if not tensors:
        return 0, 0
    ints = [t for t in tensors if not t.is_floating_point() and t.dim() >= 2]
    return int(tensors[0].shape[0]) if tensors[0].dim() else 1, int(ints[0].numel()) if ints else 0


class Window:
    """Samples, tokens and time of one optimizer step's micro-batches."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.samples = self.tokens = 0
        self.wait = 0.0
        """Seconds the loop waited for its data (the loader's next batch) in this step."""
        self.start = time.perf_counter()

    def add(self, batch: Any) -> None:
        samples, tokens = count_batch(batch)
        self.samples += samples
        self.tokens += tokens

    def close(
        self, logs: dict[str, float], world: int, device: torch.device, step: int, epoch: int
    ) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        row: dict[str, Any] = {"step": step, "split": "train", "epoch": epoch, **logs}
        row["samples_per_s"] = self.samples * world / elapsed
        if self.tokens:
            row["tokens_per_s"] = self.tokens * world / elapsed
        row["data_wait_s"] = self.wait
        row["peak_mem_mb"] = _peak_memory_mb(device)
        row["dp_world"] = world  # a change marks a node lost or gained (shardwise plot)
        self.restart()
        return row


class Progress:
    """A rich progress bar on rank 0; nothing anywhere else."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            # Not a terminal (CI, a pipe): rich would assume 80 columns and cut the stats.
            console=Console(file=sys.stderr, width=None if sys.stderr.isatty() else 160),
            transient=False,
        )
        # A stream's length is unknown (total 0): the bar counts steps without an end.
        self._task = self._bar.add_task("train", total=total or None, stats="")
        self._bar.start()

    def update(self, row: dict[str, Any]) -> None:
        if self._bar is None:
            return
        rate = (
            f"{row['tokens_per_s']:,.0f} tok/s"
            if "tokens_per_s" in row
            else f"{row['samples_per_s']:,.1f} samples/s"
        )
        stats = (
            f"loss {row.get('loss', float('nan')):.4f}  lr {row.get('lr', 0.0):.2e}  "
            f"gnorm {row.get('grad_norm', float('nan')):.3f}  {rate}  "
            f"wait {row.get('data_wait_s', 0.0):.2f} s  mem {row['peak_mem_mb']:,.0f} MB"
        )
        self._bar.update(self._task, completed=row["step"], stats=stats)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
