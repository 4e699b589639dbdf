"""What the readers of other tools' files say about a key they do not read.

Owns: `unknown_key`, the note of a refused unknown key (with the closest key that reader
reads at that level, difflib-style).

Must not: read files, or know how any one tool's keys translate (each reader passes the
keys it reads).
"""

from __future__ import annotations

from collections.abc import Iterable

from shardwise.config.names import closest

__all__ = ["unknown_key"]


def unknown_key(key: str, known: Iterable[str], what: str, noun: str = "key") -> str:
    """'not {what} {noun} shardwise reads', and the closest of `known` when one is close
    (`key` is the last part of a dotted name, as the file spells it)."""
    hint = closest(key, known)
    return f"not {what} {noun} shardwise reads" + (f".{hint}" if hint else "")
