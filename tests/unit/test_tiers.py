"""The unit tier's split: `make unit` leaves out the tests marked `heavy`, and `make test`
(pytest with pyproject's addopts) runs them."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_heavy_tests_leave_only_the_inner_loop():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "heavy" not in options["ini_options"]["addopts"]  # make test keeps them
    assert any(m.startswith("heavy:") for m in options["ini_options"]["markers"])
    unit = (ROOT / "Makefile").read_text().split("\nunit:")[1].split("\n\n")[0]
    assert '-m "not heavy" tests/unit' in unit
