"""The package's shape, from tools/layout.py: no import cycle (function-level and
TYPE_CHECKING imports count), no package importing one above it, no host library outside
integrations/, files and classes within their limits, at most 12 top-level entries, and
docs/architecture.md's diagram generated from the code as it is."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("layout_tool", ROOT / "tools" / "layout.py")
assert _spec is not None and _spec.loader is not None
layout = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("layout_tool", layout)  # dataclasses look their module up
_spec.loader.exec_module(layout)


def test_the_package_has_no_cycle_no_upward_import_and_nothing_oversized():
    found = layout.read_layout()
    assert layout.problems(found) == []
    assert layout.cycles(found) == []
    assert max(found.lines.values()) <= layout.MAX_FILE_LINES
    assert len(layout.top_level_entries()) <= 12


def test_every_package_has_a_row_and_an_allow_list():
    packages = {layout.package_of(m) for m in layout.read_layout().modules}
    rows = {p for row in layout.ROWS for p in row}
    assert packages - {"root"} == rows == set(layout.LAYERS) - {"root"}


def test_the_check_catches_each_kind_of_problem(tmp_path):
    pkg = tmp_path / "src" / "shardwise"

    def write(rel: str, text: str) -> None:
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))

    write("__init__.py", "")
    write("config/__init__.py", "")
    write("config/a.py", "def f():\n    from shardwise.config.b import g\n")  # indented
    write(
        "config/b.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shardwise.config.a import f\n",
    )
    write("plan/__init__.py", "")
    write("plan/p.py", "from shardwise.train.engine import Engine\n")  # upward
    write("train/__init__.py", "")
    write("train/engine.py", "import mmengine\nclass Engine:\n" + "    x = 1\n" * 300)
    found = layout.read_layout(pkg)
    problems = "\n".join(layout.problems(found, pkg))
    assert "import cycle: shardwise.config.a <-> shardwise.config.b" in problems
    assert "plan may not import train: shardwise.plan.p:1 -> shardwise.train.engine" in problems
    assert (
        "shardwise.train.engine imports a host library outside integrations/: mmengine" in problems
    )
    assert "class shardwise.train.engine.Engine has 301 lines (> 250)" in problems


def test_the_architecture_diagram_is_generated_from_the_code():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split(layout.BEGIN)[1].split(layout.END)[0].strip()
    assert block == layout.diagram(layout.read_layout()), (
        "docs/architecture.md's diagram is out of date: run "
        "`python -m tools.layout diagram --update docs/architecture.md`"
    )
