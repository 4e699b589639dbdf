"""The package's shape, measured from the code: imports, layers, cycles, sizes.

    python -m tools.layout check              # exit 1 on any violation, with one line each
    python -m tools.layout diagram            # the import diagram (Mermaid) on stdout
    python -m tools.layout diagram --update docs/architecture.md

Every import of a shardwise module counts, wherever it is written: at module level, inside
a function, or under TYPE_CHECKING. `LAYERS` below is the allow-list of which package may
import which; the unit tier runs `check`, and docs/architecture.md's diagram is generated
from the same data, so neither can drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "shardwise"

# Package -> the packages it may import (besides itself). "root" is shardwise/__init__.py
# and _compat.py: the public API, which imports everything and which nothing imports.
_BELOW_CLI = (
    "integrations", "train", "checkpoint", "memory", "testing", "parallelize", "plan", "config",
    "distributed",
)  # fmt: skip
_BELOW_CLI = ("integrations", "train", "checkpoint", "memory", "testing", "parallelize")
_BELOW_CLI += ("plan", "config", "distributed")
LAYERS: dict[str, tuple[str, ...]] = {
    "config": (),
    "distributed": (),
    "plan": ("config", "distributed"),
    "parallelize": ("plan", "config", "distributed"),
    "memory": ("parallelize", "plan", "config", "distributed"),
    "checkpoint": ("parallelize", "plan", "config", "distributed"),
    "testing": ("parallelize", "config", "distributed"),
    "train": ("checkpoint", "parallelize", "config", "distributed"),
    "integrations": ("train", "checkpoint", "parallelize", "config", "distributed"),
    "cli": ("root", *_BELOW_CLI),
    "root": ("cli", *_BELOW_CLI),
}
# Rows of the picture, top to bottom (a package imports only rows below its own).
ROWS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("integrations",),
    ("train",),
    ("checkpoint", "memory", "testing"),
    ("parallelize",),
    ("plan",),
    ("config", "distributed"),
)
HOSTS = ("mmengine", "lightning", "pytorch_lightning", "ray")
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 250
MAX_TOP_LEVEL = 12


@dataclass
class Layout:
    modules: dict[str, Path] = field(default_factory=dict)
    """Dotted module name -> file."""
    imports: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    """Module -> {imported shardwise module: line}."""
    hosts: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: defaultdict(list))
    lines: dict[str, int] = field(default_factory=dict)
    classes: dict[str, int] = field(default_factory=dict)
    """'module.Class' -> lines."""


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "_compat":
        return "root"
    return parts[1]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def read_layout(package: Path = PACKAGE) -> Layout:
    layout = Layout()
    files = sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
    for path in files:
        layout.modules[_module_name(path, package)] = path
    for path in files:
        me = _module_name(path, package)
        source = path.read_text()
        tree = ast.parse(source)
        layout.lines[me] = len(source.splitlines())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                end = node.end_lineno or node.lineno
                layout.classes[f"{me}.{node.name}"] = end - node.lineno + 1
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package
                    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
                targets = [t if _resolve(t, layout.modules) == t else base for t in targets]
            for target in targets:
                top = target.split(".")[0]
                if top in HOSTS:
                    layout.hosts[me].append((target, node.lineno))
                if top != package.name:
                    continue
                resolved = _resolve(target, layout.modules)
                if resolved and resolved != me:
                    layout.imports[me].setdefault(resolved, node.lineno)
    return layout


def cycles(layout: Layout) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in layout.imports.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(layout.modules):
        if v not in index:
            visit(v)
    return found


def package_edges(layout: Layout) -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> 'module:line -> module' for each import across packages."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for src, targets in layout.imports.items():
        for dst, line in targets.items():
            a, b = package_of(src), package_of(dst)
            if a != b:
                edges[(a, b)].append(f"{src}:{line} -> {dst}")
    return edges


def problems(layout: Layout, package: Path = PACKAGE) -> list[str]:
    out: list[str] = []
    for component in cycles(layout):
        out.append(f"import cycle: {' <-> '.join(component)}")
    for (a, b), where in sorted(package_edges(layout).items()):
        if a not in LAYERS:
            out.append(f"package {a!r} is not in tools/layout.py LAYERS ({where[0]})")
        elif b not in LAYERS[a]:
            out.append(f"{a} may not import {b}: {'; '.join(where[:3])}")
    for module, found in sorted(layout.hosts.items()):
        if package_of(module) != "integrations":
            names = ", ".join(f"{t} (line {n})" for t, n in found)
            out.append(f"{module} imports a host library outside integrations/: {names}")
    for module, n in sorted(layout.lines.items()):
        if n > MAX_FILE_LINES:
            out.append(
                f"{layout.modules[module].relative_to(package.parent.parent)} has {n} lines "
                f"(> {MAX_FILE_LINES})"
            )
    for cls, n in sorted(layout.classes.items()):
        if n > MAX_CLASS_LINES:
            out.append(f"class {cls} has {n} lines (> {MAX_CLASS_LINES})")
    for module, path in sorted(layout.modules.items()):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if path.name not in ("__init__.py", "__main__.py") and not (
            "Owns" in doc and "Must not" in doc
        ):
            out.append(f"{module} has no docstring saying what it Owns and what it Must not do")
    entries = top_level_entries(package)
    if len(entries) > MAX_TOP_LEVEL:
        out.append(
            f"src/shardwise has {len(entries)} top-level entries (> {MAX_TOP_LEVEL}): {entries}"
        )
    return out


def top_level_entries(package: Path = PACKAGE) -> list[str]:
    skip = {"__pycache__", "py.typed"}
    return sorted(p.name for p in package.iterdir() if p.name not in skip)


def diagram(layout: Layout) -> str:
    """A Mermaid flowchart of the packages, rows top to bottom as in ROWS, one arrow per
    package pair that imports (the root `shardwise` is the public API)."""
    edges = package_edges(layout)
    lines = ["```mermaid", "flowchart TD", '    root["shardwise (public API)"]']
    for i, row in enumerate(ROWS):
        lines.append(f'    subgraph row{i}[" "]')
        lines += [f"        {p}" for p in row]
        lines.append("    end")
    for a, b in sorted(edges):
        if a != "root":
            lines.append(f"    {a} --> {b}")
    lines.append("```")
    return "\n".join(lines)


BEGIN = "<!-- import diagram: generated by `python -m tools.layout diagram --update` -->"
END = "<!-- end of import diagram -->"


def update(doc: Path, text: str) -> bool:
    """Replace the block between BEGIN and END; True if the file changed."""
    old = doc.read_text()
    head, _, rest = old.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{doc} has no line {BEGIN!r} to put the diagram after")
    new = f"{head}{BEGIN}\n{text}\n{END}{tail}"
    if new != old:
        doc.write_text(new)
    return new != old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="report cycles, layer violations, host imports and sizes")
    draw = sub.add_parser("diagram", help="print the package import diagram")
    draw.add_argument("--update", type=Path, help="write it into this Markdown file")
    args = parser.parse_args(argv)
    layout = read_layout()
    if args.command == "diagram":
        text = diagram(layout)
        if args.update:
            print(f"{args.update}: {'updated' if update(args.update, text) else 'up to date'}")
        else:
            print(text)
        return 0
    found = problems(layout)
    for line in found:
        print(line)
    n_cycles = len(cycles(layout))
    biggest = max(layout.lines.values())
    largest_class = max(layout.classes.values(), default=0)
    print(
        f"{len(layout.modules)} modules, {sum(layout.lines.values())} lines, "
        f"{len(top_level_entries())} top-level entries; {n_cycles} import cycle(s); largest file "
        f"{biggest} lines, largest class {largest_class} lines; {len(found)} problem(s)"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
