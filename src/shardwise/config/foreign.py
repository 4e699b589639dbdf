"""Another tool's configuration file, read by the reader its suffix names.

Owns: `read_foreign`, which sends a `.json` file to config/deepspeed.py, a `.yaml` or
`.yml` file to config/accelerate.py and a `.toml` file to config/torchtitan.py, and
refuses any other suffix naming the three.

Must not: read the environment (the launcher passes the path and the world size).
"""

from __future__ import annotations

from pathlib import Path

from shardwise.config.accelerate import translate_accelerate
from shardwise.config.deepspeed import translate_deepspeed
from shardwise.config.torchtitan import translate_torchtitan
from shardwise.config.translation import Translation

__all__ = ["read_foreign"]


def read_foreign(path: str | Path, *, world: int | None = None) -> Translation:
    """The translation of the file at `path` (see the module docstring). `world`, the
    number of ranks, lets a DeepSpeed train_batch_size be checked or completed."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return translate_deepspeed(path, world=world)
    if suffix in (".yaml", ".yml"):
        return translate_accelerate(path)
    if suffix == ".toml":
        return translate_torchtitan(path)
    raise ValueError(
        f"{path}: a DeepSpeed config is .json, an Accelerate config .yaml or .yml, a "
        "torchtitan config .toml."
    )
