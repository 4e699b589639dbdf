"""Another tool's configuration file, read by the reader its suffix names.

Owns: `read_foreign`, which sends a `.json` file to config/deepspeed.py, a `.yaml` or
`.yml` file to config/accelerate.py and a `.toml` file to config/torchtitan.py, and
refuses any other suffix naming the three; and `check_flag`, which refuses a file whose
suffix names another tool than the flag it was given with (`--deepspeed file.yaml`): the
suffix decides which reader reads it, in the launcher and in every worker alike.

Must not: read the environment (the launcher passes the path and the world size).
"""

from __future__ import annotations

from pathlib import Path

from shardwise.config.accelerate import translate_accelerate
from shardwise.config.deepspeed import translate_deepspeed
from shardwise.config.foreign_checks import READS
from shardwise.config.torchtitan import translate_torchtitan
from shardwise.config.translation import Translation

__all__ = ["check_flag", "read_foreign"]

_FLAGS = {"DeepSpeed": "--deepspeed", "Accelerate": "--accelerate-config", "torchtitan": "--from"}
_SUFFIXES = {"DeepSpeed": ".json", "Accelerate": ".yaml or .yml", "torchtitan": ".toml"}


def check_flag(flag: str, path: str | Path) -> None:
    """Refuse, in one line, a file given with `--deepspeed` or `--accelerate-config` whose
    suffix names the other tool's reader (`--from` takes any of the three)."""
    named = {"--deepspeed": "DeepSpeed", "--accelerate-config": "Accelerate"}.get(flag)
    suffix = Path(path).suffix.lower()
    read_as = READS.get(suffix)
    if named is None or read_as is None or read_as == named:
        return  # --from, or a suffix read_foreign refuses with its own message
    article = "an" if read_as[0] in "AE" else "a"
    named_article = "an" if named[0] in "AE" else "a"
    raise ValueError(
        f"{flag} {path}: a {suffix} file is read as {article} {read_as} config, and {flag} "
        f"names {named_article} {named} one ({_SUFFIXES[named]}). Pass it with "
        f"{_FLAGS[read_as]}, or give the {named} config as {_SUFFIXES[named]}."
    )


def read_foreign(path: str | Path, *, world: int | None = None) -> Translation:
    """The translation of the file at `path` (see the module docstring). `world`, the
    number of ranks, lets a DeepSpeed train_batch_size be checked or completed, and
    torchtitan's shard degree -1 beside replicas be resolved."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return translate_deepspeed(path, world=world)
    if suffix in (".yaml", ".yml"):
        return translate_accelerate(path)
    if suffix == ".toml":
        return translate_torchtitan(path, world=world)
    raise ValueError(
        f"{path}: a DeepSpeed config is .json, an Accelerate config .yaml or .yml, a "
        "torchtitan config .toml."
    )
