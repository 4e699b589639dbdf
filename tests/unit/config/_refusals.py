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
