"""The one check of a refused translation, shared by the DeepSpeed, Accelerate and
torchtitan tests: exactly these keys refused, each reason containing its words, and the
config refused naming every one of them."""

from __future__ import annotations

import pytest

from shardwise.config.run_file import ConfigError
from shardwise.config.translation import Translation


def assert_refused(translation: Translation, refused: dict[str, str]) -> None:
    got = {r.key: r.note for r in translation.refused}
    assert set(got) == set(refused), translation.table()
    for key, words in refused.items():
        assert words in got[key], (key, got[key])
    message = f"this {translation.source} config cannot mean the same in shardwise; refused:"
    with pytest.raises(ConfigError, match=message) as exc:
        translation.config  # noqa: B018
    assert all(key in str(exc.value) for key in refused)


def unnamed_keys(translation: Translation, data: dict, prefix: str = "") -> list[str]:  # type: ignore[type-arg]
    """The keys of `data` (dotted, at every level) that no row of the table names: a row
    names a key, a block it reads whole, or a pattern of keys ("*_degree", "beta1, beta2")."""
    import fnmatch

    names: list[str] = []
    for r in translation.rows:
        key = r.key.removeprefix("deepspeed_config: ")
        head, _, tail = key.rpartition(".")
        names += [f"{head}.{part}" if head else part for part in tail.split(", ")]
    missing = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if any(fnmatch.fnmatchcase(path, n) for n in names):
            continue
        if isinstance(value, dict) and value:
            missing += unnamed_keys(translation, value, f"{path}.")
        else:
            missing.append(path)
    return missing
