"""The error every run-file section raises, and the check of a closed set's value.

Owns: `ConfigError` and `check_choice`, shared by run_file.py and the sections beside it
(optimizer.py), so neither imports the other for them.

Must not: import anything of shardwise besides `names`, or read the environment.
"""

from __future__ import annotations

from typing import Any, get_args

from shardwise.config.names import closest


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key."""


def check_choice(value: object, choices: Any, where: str) -> None:
    """A ConfigError naming `where`, the value and the allowed set, unless `value` is one of
    the `Literal` type `choices`."""
    allowed = get_args(choices)
    if value not in allowed:
        hint = closest(str(value), [str(a) for a in allowed])
        raise ConfigError(f"{where}={value!r} is not allowed.{hint} Choose one of {list(allowed)}.")
