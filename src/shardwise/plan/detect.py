"""Find a model's repeated blocks: what the `auto` policy shards separately.

Owns: reading a model's own `_no_split_modules` declaration (Hugging Face models have
one) and, failing that, spotting same-class children of a ModuleList/Sequential that
hold parameters, or, failing that, a composite block alone in one (a one-layer model, or a
shared block that forward applies at every depth: ALBERT's trains exactly as one unit).
Pure inspection: works on the meta device, changes nothing.

Must not: decide units (planner.py) or know about policies beyond returning classes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn


@dataclass
class DetectedBlocks:
    classes: set[type[nn.Module]] = field(default_factory=set)
    source: str = ""
    """'_no_split_modules', 'repeated children' or 'a lone block in a ModuleList/Sequential'."""
    where: dict[str, str] = field(default_factory=dict)
    """class name -> where it was found (the container FQN, or the declaring class)."""
    counts: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        found = ", ".join(
            f"{self.counts.get(name, 0)}x {name} in {self.where[name]}"
            for name in sorted(self.where)
        )
        return f"auto: {found} (from {self.source})"


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def has_no_forward(module: nn.Module) -> bool:
    """A container without a forward of its own (ModuleList, ModuleDict): never a unit."""
    return type(module).forward is nn.Module.forward


def _blocks_of(container: nn.Module) -> list[nn.Module]:
    """A container's children, looking through those without a forward (a ModuleList of
    ModuleDicts holds its blocks one level down)."""
    out: list[nn.Module] = []
    for child in container.children():
        out.extend(_blocks_of(child) if has_no_forward(child) else [child])
    return out


def _from_no_split_modules(model: nn.Module) -> DetectedBlocks:
    declared: dict[str, str] = {}
    for _, m in model.named_modules():
        for name in getattr(m, "_no_split_modules", None) or ():
            declared.setdefault(str(name), type(m).__name__)
    found = DetectedBlocks(source="_no_split_modules")
    counts: Counter[str] = Counter()
    for fqn, m in model.named_modules():
        name = type(m).__name__
        if fqn and name in declared and _has_params(m):
            found.classes.add(type(m))
            found.where[name] = f"{declared[name]}._no_split_modules"
            counts[name] += 1
    found.counts = dict(counts)
    return found


def _from_repeated_children(model: nn.Module) -> DetectedBlocks:
    candidates: dict[type[nn.Module], str] = {}
    lone: dict[type[nn.Module], str] = {}
    for fqn, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        by_class = Counter(type(c) for c in _blocks_of(m) if _has_params(c))
        for cls, n in by_class.items():
            (candidates if n >= 2 else lone).setdefault(cls, fqn or "<root>")
    source = "repeated children"
    if not candidates:
        # One composite block alone in a container: a one-layer model, or a block that
        # forward applies several times (ALBERT shares one layer group across its depth).
        candidates = {c: w for c, w in lone.items() if _is_composite(model, c)}
        source = "a lone block in a ModuleList/Sequential"
    if not candidates:
        return DetectedBlocks()
    # Prefer composite blocks (a transformer layer) over repeated leaves (Conv2d in a
    # Sequential), and outermost blocks over blocks nested inside them.
    composite = {c: w for c, w in candidates.items() if _is_composite(model, c)}
    chosen = composite or candidates
    outer = _outermost(model, set(chosen))
    found = DetectedBlocks(source=source)
    counts: Counter[str] = Counter()
    for fqn, m in model.named_modules():
        if fqn and type(m) in outer:
            counts[type(m).__name__] += 1
    found.classes = outer
    found.where = {c.__name__: chosen[c] for c in outer}
    found.counts = dict(counts)
    return found


def _is_composite(model: nn.Module, cls: type[nn.Module]) -> bool:
    return any(
        isinstance(m, cls) and any(_has_params(c) for c in m.children()) for m in model.modules()
    )


def _outermost(model: nn.Module, classes: set[type[nn.Module]]) -> set[type[nn.Module]]:
    """Drop classes whose every instance sits inside an instance of another chosen class."""
    inside: dict[type[nn.Module], bool] = {}

    def visit(module: nn.Module, enclosing: type[nn.Module] | None) -> None:
        cls = type(module)
        if cls in classes:
            nested = enclosing is not None and enclosing is not cls
            inside[cls] = inside.get(cls, True) and nested
            enclosing = enclosing or cls
        for child in module.children():
            visit(child, enclosing)

    visit(model, None)
    return {c for c in classes if not inside.get(c, False)}


def detect_blocks(model: nn.Module) -> DetectedBlocks:
    """The model's block classes: `_no_split_modules` if declared and present, else repeats."""
    declared = _from_no_split_modules(model)
    return declared if declared.classes else _from_repeated_children(model)
