"""`ParallelConfig.memory_budget`'s spellings: bytes, a size with its unit, a percentage.

Owns: `parse_memory_budget` and its one-line refusal.

Must not: read the device's memory (memory/auto.py resolves a fraction against it).
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["parse_memory_budget"]

_SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_memory_budget(value: object) -> int | float | None:
    """`memory_budget` as bytes (int), a fraction of the device's memory (float in (0, 1]),
    or None (90% of the device's memory). Accepts ints (bytes), '70GiB', '80 GB', '90%'."""
    if value is None or isinstance(value, bool):
        return None if value is None else _bad_budget(value)
    if isinstance(value, int):
        return value if value > 0 else _bad_budget(value)
    if isinstance(value, float):
        return value if 0 < value <= 1 else _bad_budget(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                return _bad_budget(value)
            return pct / 100 if 0 < pct <= 100 else _bad_budget(value)
        number = text.rstrip("kmgtib")
        unit = text[len(number) :] or "b"
        try:
            amount = float(number)
        except ValueError:
            return _bad_budget(value)
        if unit in _SIZE_UNITS and amount > 0:
            return int(amount * _SIZE_UNITS[unit])
    return _bad_budget(value)


def _bad_budget(value: object) -> NoReturn:
    raise ValueError(
        f"ParallelConfig.memory_budget={value!r} is not valid. Give bytes per rank as an int, "
        "a size such as '70GiB' or '80GB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), a "
        "percentage of the device's memory such as '85%', or None (90% of it)."
    )
