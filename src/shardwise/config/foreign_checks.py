"""What the readers of other tools' files say about a key they do not read, or a file
that is not the tool's at all.

Owns: `unknown_key`, the note of a refused unknown key (with the closest key that reader
reads at that level, difflib-style); `READS`, the suffix that picks each tool's reader;
and, naming in one line a file of the wrong kind handed to a reader, `check_suffix` (a
suffix that picks another tool's reader) and `check_kind` (a transformers model config,
a shardwise run file, or another tool's config, whatever its suffix).

Must not: read files, or know how any one tool's keys translate (each reader passes the
keys it reads).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from shardwise.config.names import closest
from shardwise.config.run_file import ConfigError
from shardwise.config.translation import Tool

__all__ = ["READS", "check_kind", "check_suffix", "unknown_key"]

READS: dict[str, Tool] = {
    ".json": "DeepSpeed",
    ".yaml": "Accelerate",
    ".yml": "Accelerate",
    ".toml": "torchtitan",
}
"""The reader each suffix picks (`shardwise run --from`, `config show --from`)."""
_TAKES: dict[Tool, tuple[str, ...]] = {
    "DeepSpeed": (".json",),
    "Accelerate": (".yaml", ".yml", ".json"),  # Accelerate reads a JSON config too
    "torchtitan": (".toml",),
}
_READERS: dict[Tool, str] = {
    "DeepSpeed": "translate_deepspeed",
    "Accelerate": "translate_accelerate",
    "torchtitan": "translate_torchtitan",
}


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'AE' else 'a'} {word}"


def check_suffix(path: Path, tool: Tool) -> None:
    """Refuse, in one line, a path whose suffix is another tool's (`ds_config.json` given
    to the torchtitan reader); a suffix none of the three uses is left to the parser."""
    suffix = path.suffix.lower()
    other = READS.get(suffix)
    if other is None or suffix in _TAKES[tool]:
        return
    raise ConfigError(
        f"{path}: a {suffix} file is {_a(other)} config to shardwise, not {_a(tool)} one "
        f"({' or '.join(_TAKES[tool])}): read it with shardwise.{_READERS[other]} (shardwise "
        "run --from picks the reader by the suffix)."
    )


def unknown_key(key: str, known: Iterable[str], what: str, noun: str = "key") -> str:
    """'not {what} {noun} shardwise reads', and the closest of `known` when one is close
    (`key` is the last part of a dotted name, as the file spells it)."""
    hint = closest(key, known)
    return f"not {what} {noun} shardwise reads" + (f".{hint}" if hint else "")


# Top-level keys that say what a file is. Each set holds keys no other kind has at the top.
_SIGNS: dict[str, tuple[str, ...]] = {
    "a transformers model config": ("model_type", "architectures"),
    "a shardwise run file": ("parallel", "train", "runner", "adapter"),
    "DeepSpeed": (
        "zero_optimization",
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16",
        "bf16",
    ),
    "Accelerate": ("distributed_type", "compute_environment", "fsdp_config", "num_processes"),
    "torchtitan": ("parallelism", "training", "job", "activation_checkpoint"),
}
_FIXES = {
    "a transformers model config": (
        "the script builds the model from it (from_pretrained); give shardwise the training "
        "config (a DeepSpeed .json, an Accelerate .yaml or a torchtitan .toml)"
    ),
    "a shardwise run file": (
        "give it to the script as --config FILE (shardwise.load_config reads it)"
    ),
    "DeepSpeed": "read it as DeepSpeed's (a .json file, --deepspeed or --from)",
    "Accelerate": "read it as Accelerate's (a .yaml file, --accelerate-config or --from)",
    "torchtitan": "read it as torchtitan's (a .toml file, --from)",
}


def check_kind(data: Mapping[str, object], tool: Tool, label: str) -> None:
    """Refuse, in one line, a file that has none of `tool`'s telling keys and some of
    another kind's; `label` names the file (its path, or 'the config given')."""
    keys = set(data)
    if keys & set(_SIGNS[tool]):
        return
    for kind, signs in _SIGNS.items():
        found = [k for k in signs if k in keys]
        if kind == tool or not found:
            continue
        name = kind if kind.startswith("a ") else f"{_a(kind)} config"
        raise ConfigError(
            f"{label} is {name} (it has {', '.join(found)}), not {_a(tool)} config: {_FIXES[kind]}."
        )
