"""The code blocks and shell commands of README.md and docs/*.md, as the doc tests see them.

Conventions a page follows (docs/testing.md shows them to a writer):

- A fenced block that the tests cannot run is preceded by a visible line
  `*Not run by the tests: <reason>.*`, so the reader sees the reason too; the tests skip
  the block by that line, never silently.
- `<!-- docs-test: file=NAME -->` just above a block (invisible to the reader) writes the
  block to NAME in the page's working directory instead of running it: a script that a
  shell command on the page then runs (`python NAME`, `shardwise run ... NAME`), a YAML
  file a snippet loads, a module `shardwise plan` imports.
- Python blocks without a directive run in order, each in a fresh namespace, as a reader
  who copies one block runs it: a block imports and defines what it uses. Files a block
  writes stay in the page's working directory for the blocks and commands after it.
- Shell commands are the lines of `bash`/`sh` blocks (comments dropped, `\\` continues a
  line) and the `$ ` lines of `console` blocks, whose other lines are the expected output
  (`...` on a line of its own stands for any lines).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = ("bash", "sh", "console")
NOT_RUN = re.compile(r"^\*?Not run by the tests: (?P<reason>.+?)\*?$")
DIRECTIVE = re.compile(r"^<!-- docs-test: (?P<body>.*?) -->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")


@dataclass(frozen=True)
class Command:
    """One shell command as written, where it is, and (console) the output shown."""

    text: str
    origin: str
    expected: tuple[str, ...] | None = None

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)
    not_run: str | None = None
    """The reason shown to the reader, when the block is marked as not run by the tests."""

    @property
    def origin(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[Command]:
        if self.lang not in SHELL:
            return []
        lines = self.text.splitlines()
        if self.lang == "console":
            return _console_commands(lines, self)
        out: list[Command] = []
        pending, start = "", 0
        for i, raw in enumerate(lines):
            if not pending:
                start = i
            line = raw.rstrip()
            if line.endswith("\\"):  # continued on the next line
                pending += line[:-1] + " "
                continue
            text = _strip_comment(pending + line)
            pending = ""
            if text:
                out.append(Command(text, f"{self.page}:{self.line + 1 + start}"))
        return out


def _strip_comment(text: str) -> str:
    """The command without a trailing `# comment` (outside quotes), spaces collapsed."""
    # Cut the original text where the comment starts, so quoting stays as written.
    cut = len(text)
    in_single = in_double = False
    for i, ch in enumerate(text):
        if ch == "'" and not in_double:
            in_single = not in_single
        elif ch == '"' and not in_single:
            in_double = not in_double
        elif ch == "#" and not in_single and not in_double and (i == 0 or text[i - 1].isspace()):
            cut = i
            break
    return " ".join(text[:cut].split())


def _console_commands(lines: list[str], block: Block) -> list[Command]:
    out: list[Command] = []
    current: tuple[str, int] | None = None
    expected: list[str] = []
    for i, line in enumerate([*lines, "$ "]):
        if line.startswith("$ "):
            if current is not None:
                text, at = current
                out.append(Command(text, f"{block.page}:{block.line + 1 + at}", tuple(expected)))
            current, expected = (line[2:].strip(), i), []
        elif current is not None:
            expected.append(line.rstrip())
    return [c for c in out if c.text]


def pages() -> list[Path]:
    """README.md, then every page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def read_blocks(path: Path) -> list[Block]:
    page = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        directives: dict[str, str] = {}
        not_run = None
        k = i - 1
        while k >= 0 and (not lines[k].strip() or DIRECTIVE.match(lines[k].strip())):
            found = DIRECTIVE.match(lines[k].strip())
            if found:
                for part in found.group("body").split():
                    key, _, value = part.partition("=")
                    directives[key] = value
            k -= 1
        if k >= 0 and (marked := NOT_RUN.match(lines[k].strip())):
            not_run = marked.group("reason").rstrip(".")
        blocks.append(
            Block(page, i + 1, match.group("lang"), "\n".join(lines[i + 1 : end]) + "\n",
                  directives, not_run)
        )  # fmt: skip
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in pages() for b in read_blocks(path)]
