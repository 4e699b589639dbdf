"""Every Python snippet and shell command in README.md and docs/*.md runs as written.

One driver process (`_doc_driver.py`) runs the pages in turn, each in a fresh working
directory with `examples/` linked in: each Python block in a fresh namespace, in document
order with the page's commands (so `shardwise plot runs/exp1` sees the files the snippet
above it trained), console transcripts compared with the output. Commands another test runs are
left to it (`_covered.py`, checked in test_commands.py); blocks marked
`*Not run by the tests: ...*` are skipped by that visible line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _covered import COVERED
from _doc_blocks import ROOT, Block, all_blocks, pages, read_blocks
from _doc_driver import DocFailure, check_transcript

DRIVER = Path(__file__).with_name("_doc_driver.py")
RUNNABLE = ("python", "yaml", "bash", "sh", "console")


def _steps(blocks: list[Block]) -> list[dict]:
    steps: list[dict] = []
    for block in blocks:
        if block.not_run or block.lang not in RUNNABLE:
            continue
        if "file" in block.directives:
            steps.append({"kind": "file", "file": block.directives["file"],
                          "origin": block.origin, "text": block.text})  # fmt: skip
        elif block.lang == "python":
            steps.append({"kind": "python", "origin": block.origin, "text": block.text})
        for command in block.commands():
            if command.text not in COVERED:
                steps.append({"kind": "shell", "origin": command.origin, "text": command.text,
                              "expected": command.expected})  # fmt: skip
    return steps


def _drive(plan: list[dict], scratch: Path) -> dict[str, dict]:
    """The pages of `plan` run by the driver, in a process of its own."""
    (scratch / "plan.json").write_text(json.dumps(plan))
    out = scratch / "results.json"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(scratch / "plan.json"), str(out)],
        capture_output=True, text=True, timeout=600, cwd=scratch,
    )  # fmt: skip
    got = json.loads(out.read_text()) if out.exists() else {}
    for page in plan:
        got.setdefault(
            page["page"],
            {"ok": False, "ran": [], "error": f"the driver died (exit {proc.returncode}) "
             f"before this page:\n{proc.stderr[-5000:]}"},
        )  # fmt: skip
    return got


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    plan = []
    for path in pages():
        page = path.relative_to(ROOT).as_posix()
        steps = _steps(read_blocks(path))
        if steps:
            workdir = tmp_path_factory.mktemp(path.stem)
            (workdir / "examples").symlink_to(ROOT / "examples")
            plan.append({"page": page, "workdir": str(workdir), "steps": steps})
    return _drive(plan, tmp_path_factory.mktemp("driver"))


PAGES_THAT_RUN = [
    p.relative_to(ROOT).as_posix() for p in pages() if _steps(read_blocks(p))
]  # the others hold tables and prose only, or only commands that other tests run


@pytest.mark.parametrize("page", PAGES_THAT_RUN)
def test_page_runs_as_written(results, page):
    result = results[page]
    print(f"{page}: {result.get('seconds', 0):.1f} s, ran {result['ran']}")  # -rP shows it
    assert result["ok"], result["error"]


def test_every_python_block_is_run_or_marked():
    """A Python block is run in its page, written to a file that a command of the page
    runs or imports, or marked not run with a reason: never left out silently."""
    for block in all_blocks():
        if block.lang not in ("python", "yaml") or block.not_run:
            continue
        name = block.directives.get("file")
        if name is None:
            assert block.lang == "python", f"{block.origin}: a YAML block needs file=NAME"
            continue
        page = read_blocks(ROOT / block.page)
        users = [c.text for b in page for c in b.commands()]
        users += [b.text for b in page if b.lang == "python" and "file" not in b.directives]
        stem = name.removesuffix(".py")
        assert any(name in u or f"{stem}:" in u for u in users), (
            f"{block.origin}: {name} is written but no command or snippet of the page uses it"
        )


def test_blocks_marked_not_run_show_the_reason():
    marked = [b for b in all_blocks() if b.not_run]
    assert marked, "the SLURM example is marked; the marker must still be recognised"
    for block in marked:
        assert len(block.not_run) > 10, f"{block.origin}: say why it is not run"
        lines = (ROOT / block.page).read_text().splitlines()[: block.line - 1]
        shown = [line for line in lines if line.startswith("*Not run by the tests:")]
        assert shown, f"{block.origin}: the reason must be a visible line, not a comment"


def test_every_fence_has_a_known_language():
    for block in all_blocks():
        assert block.lang in (*RUNNABLE, "text", "mermaid"), (
            f"{block.origin}: ```{block.lang}: give the block a language the doc tests know "
            "(python, yaml, bash, sh, console; text for output)"
        )


# --- the driver itself ------------------------------------------------------------------

_TWO_BLOCKS = """\
# A page

```python
import json

settings = {"lr": 0.1}
with open("settings.json", "w") as f:
    json.dump(settings, f)
```

Then:

```python
%s
```
"""


def _run_synthetic_page(tmp_path: Path, second_block: str) -> dict:
    page = tmp_path / "page.md"
    page.write_text(_TWO_BLOCKS % second_block)
    workdir = tmp_path / "work"
    workdir.mkdir()
    steps = _steps(read_blocks(page))
    assert [s["kind"] for s in steps] == ["python", "python"]
    return _drive([{"page": "page.md", "workdir": str(workdir), "steps": steps}], tmp_path)[
        "page.md"
    ]


def test_a_block_that_needs_an_earlier_blocks_names_fails(tmp_path):
    """Each block runs in a fresh namespace, as a reader who copies it runs it: `json` and
    `settings` are the first block's, so the second block alone is refused, naming where."""
    result = _run_synthetic_page(tmp_path, 'print(json.dumps(settings["lr"]))')
    assert not result["ok"]
    assert result["error"].startswith("page.md:13: ")
    assert "NameError: name 'json' is not defined" in result["error"]
    assert result["ran"] == [result["ran"][0]] and result["ran"][0].startswith("page.md:3 ")


def test_a_block_reads_the_files_an_earlier_block_wrote(tmp_path):
    result = _run_synthetic_page(
        tmp_path,
        'import json\n\nassert json.load(open("settings.json")) == {"lr": 0.1}',
    )
    assert result["ok"], result["error"]
    assert len(result["ran"]) == 2


# --- the transcript comparison itself --------------------------------------------------


def test_transcripts_match_with_elisions_and_close_figures():
    out = "header\nrow a 100.0 KiB\nrow b 7\nfooter\n"
    check_transcript(out, ["header", "...", "row b 7", "..."])
    check_transcript(out, ["header", "row a 102.0 KiB", "row b 7", "footer"])  # within 5%
    check_transcript(out, ["...", "footer"])


@pytest.mark.parametrize(
    "expected",
    [
        ["header", "row a 110.0 KiB", "row b 7", "footer"],  # a figure 10% off
        ["header", "row a 100.0 MiB", "..."],  # a word differs
        ["header", "row b 7", "..."],  # a line missing, no elision
        ["header", "..."][:1],  # the output goes on past the transcript
        ["...", "row c 7", "..."],  # not there at all
    ],
)
def test_transcripts_that_differ_fail(expected):
    out = "header\nrow a 100.0 KiB\nrow b 7\nfooter\n"
    with pytest.raises(DocFailure):
        check_transcript(out, expected)
