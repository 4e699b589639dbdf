"""A `section.key=value` override checked against the schema before its file is read.

Owns: `check_override`, which `shardwise run` calls on the script's overrides before anything
spawns: every key of the path exists, and a value for a field has the field's type, in the
words `load_config` uses (config/run_file.py).

Must not: read a file, build a config, or check what spans fields (that needs the file).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.config.parallel import ParallelConfig
from shardwise.config.run_file import (
    Config,
    _coerce,
    _fields,
    _optional_section,
    _unknown_key,
    parse_override,
)
from shardwise.config.vocabulary import FOREIGN_WORDS, PLACEMENT_WORDS

__all__ = ["check_override"]


def check_override(text: str, cls: type[Any] = Config) -> None:
    """The override `text` against `cls`'s schema without its file: every key of its path
    exists (the ConfigError `load_config` raises, with the closest key), and a value for a
    field that is not a section has the field's type. What spans fields (max_epochs and
    max_steps both None) needs the whole config and is left to `load_config`."""
    parts, value = parse_override(text)
    for i, key in enumerate(parts):
        if cls is ParallelConfig and (key in PLACEMENT_WORDS or key in FOREIGN_WORDS):
            return  # checked by wrap, or translated, with the rest of the section
        fields = _fields(cls)
        if key not in fields:
            raise _unknown_key(cls, key, ".".join(parts[:i]))
        tp = fields[key]
        plain_section = dataclasses.is_dataclass(tp) and isinstance(tp, type)
        section = _optional_section(tp) or (tp if plain_section else None)
        if section is None:
            if i == len(parts) - 1:
                _coerce(value, tp, ".".join(parts), translates=cls is ParallelConfig)
            return  # a sub-key of a value is refused by load_config, in its words
        cls = section
