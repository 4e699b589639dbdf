"""Metrics files: one CSV row per logged step (always), TensorBoard scalars (when installed).

Owns: `MetricsLogger`, which only rank 0 creates files with, and reading a run's CSV back
(`read_metrics`) for plots. A new column appearing later (a validation metric, say)
rewrites the CSV with the wider header, so every row stays aligned.

Must not: print, or decide when to log (runner.py does).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.csv"


class MetricsLogger:
    """Append rows of scalars to RUN_DIR/metrics.csv and, if available, TensorBoard."""

    def __init__(
        self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool | None = None
    ):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.path = self.run_dir / METRICS_FILE
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []
        self._tb: Any = None
        self._tensorboard = tensorboard
        self._started = False
        if enabled and tensorboard is True:
            _tensorboard_writer(self.run_dir, required=True, probe_only=True)

    @property
    def started(self) -> bool:
        return self._started

    def start(self, keep_until_step: int | None = None) -> None:
        """Open the files, appending to an existing CSV: all its rows are kept, or (resuming)
        the rows up to a step, the whole earlier file then kept beside it as
        metrics.<n>.csv. Nothing is deleted: refusing a fresh run over an old one is the
        Runner's decision, made on every rank before anything is written."""
        if self._started or not self.enabled:
            self._started = True
            return
        self._started = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [
                r
                for r in read_metrics(self.run_dir)
                if keep_until_step is None or r.get("step", 0) <= keep_until_step
            ]
            self.rows = [{k: _int_step(k, v) for k, v in r.items()} for r in kept]
            self.columns = list(dict.fromkeys(k for r in self.rows for k in r))
            if keep_until_step is not None:
                if len(kept) < len(read_metrics(self.run_dir)):
                    self.path.rename(free_name(self.path))  # the rows cut stay on disk
                self._rewrite()
        if self._tensorboard is not False:
            self._tb = _tensorboard_writer(self.run_dir, required=self._tensorboard is True)

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.start()
        self.rows.append(dict(row))
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns.extend(new)
            self._rewrite()
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)
        if self._tb is not None:
            step = int(row.get("step", len(self.rows)))
            split = row.get("split", "train")
            for key, value in row.items():
                if key not in ("step", "split", "epoch") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{split}/{key}", value, step)

    def _rewrite(self) -> None:
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


_INTEGERS = ("step", "epoch", "dp_world")  # written as read: 4, not 4.0, after a rewrite


def _int_step(key: str, value: Any) -> Any:
    return int(value) if key in _INTEGERS and isinstance(value, float) else value


def _tensorboard_writer(run_dir: Path, *, required: bool, probe_only: bool = False) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if required:
            raise ImportError(
                "RunnerConfig.tensorboard=True but TensorBoard is not installed. "
                "Install it with pip install 'shardwise[tensorboard]', or set tensorboard=None "
                "to use it only when present."
            ) from None
        return None
    if probe_only:
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.csv, numbers parsed, empty cells dropped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: RUN_DIR must be a run directory written by shardwise's "
            "Runner (it holds metrics.csv)."
        )
    rows = []
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            row: dict[str, Any] = {}
            for key, value in raw.items():
                if value in ("", None):
                    continue
                try:
                    number = float(value)
                    row[key] = number if not math.isnan(number) else None
                except ValueError:
                    row[key] = value
            rows.append(row)
    return rows


def free_name(path: Path) -> Path:
    """metrics.1.csv, metrics.2.csv (export.1, ...): the first name not taken beside `path`."""
    n = 1
    while (candidate := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    return candidate
