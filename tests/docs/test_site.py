"""The documentation site builds without a warning (`make docs`), and holds every page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly(tmp_path):
    # What `make docs` runs (the Makefile's recipe), into a scratch directory.
    recipe = (ROOT / "Makefile").read_text().split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "mkdocs build --strict" in recipe
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert not re.search(r"^WARNING\b", log, re.M), log[-5000:]
    # The API page was generated from the docstrings, and the README's start is on the home page.
    api = (site / "api" / "index.html").read_text()
    for name in (
        "shardwise.wrap",
        "shardwise.save_checkpoint",
        "shardwise.testing.run_distributed",
    ):
        assert f'id="{name}"' in api, name
    home = (site / "index.html").read_text()
    assert "Quickstart: your loop, from one process to FSDP" in home
    assert "docs-test" not in re.sub(r"<!--.*?-->", "", home, flags=re.S)


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f" {page.name}\n" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


def test_the_readme_links_resolve():
    """The README is read on the repository's page too, where its links are plain paths."""
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
