"""Cut a model into pipeline stages: which blocks and which other modules each stage holds.

Owns: finding the model's list of repeated blocks (the planner's `detect_blocks`), the
balanced split of those blocks over `pp` stages or the user's `pp_split`, and where the
modules outside the list go: those registered before it (the embeddings) to the first
stage, those after it (final norm, head) to the last, and those without parameters (rotary
embeddings, masks) to every stage, because each stage runs the model's own forward. Names
are never changed: a stage's parameters keep the names they have in the whole model, so
checkpoints move between pp degrees. Pure inspection: works on the meta device.

Must not: change the model (parallelize/pipeline.py builds the stage), or know the world.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from torch import nn

from shardwise.plan.detect import detect_blocks

__all__ = ["StagePlan", "plan_stages"]

_EXAMPLE = "e.g. pp_split=['model.layers.2'] to start the second stage at layer 2"


@dataclass(frozen=True)
class Stage:
    """One stage: its index, its blocks and the other modules it holds."""

    index: int
    blocks: tuple[str, ...]
    modules: tuple[str, ...]
    """Modules outside the block list that this stage holds (embeddings, norm, head)."""
    params: int


@dataclass(frozen=True)
class StagePlan:
    """The model's stages, in order; every stage keeps the whole model's names."""

    container: str
    """The ModuleList/Sequential of repeated blocks that is split."""
    stages: tuple[Stage, ...]
    before: tuple[str, ...]
    """Modules with parameters that run before the blocks: the first stage's."""
    after: tuple[str, ...]
    """Modules with parameters that run after the blocks: the last stage's."""
    tied: tuple[tuple[str, str], ...]
    """(first-stage name, last-stage name) of each parameter both ends share (tied
    embeddings): both stages hold it, and its gradients are summed between them."""
    per_rank: int = 1
    """Stages each pipeline rank holds: rank r holds stages r, r + degree, ... (torch's
    placement for interleaved schedules)."""

    @property
    def pp(self) -> int:
        """The number of stages (pp × per_rank)."""
        return len(self.stages)

    @property
    def degree(self) -> int:
        """The pipeline-parallel degree: ranks in one pipeline."""
        return len(self.stages) // self.per_rank

    def held_by(self, pp_rank: int) -> list[int]:
        """The indices of the stages pipeline rank `pp_rank` holds, in order."""
        return list(range(pp_rank, len(self.stages), self.degree))

    def owned(self, index: int) -> set[str]:
        """The block and module names stage `index` holds."""
        stage = self.stages[index]
        return {*stage.blocks, *stage.modules}

    def __str__(self) -> str:
        lines = [f"pipeline: {self.pp} stages over {self.container}"]
        if self.per_rank > 1:
            lines[0] += (
                f", {self.per_rank} per rank (rank r holds stages r, r + {self.degree}, ...)"
            )
        for s in self.stages:
            blocks = s.blocks[0] if len(s.blocks) == 1 else f"{s.blocks[0]} .. {s.blocks[-1]}"
            extra = f" + {', '.join(s.modules)}" if s.modules else ""
            lines.append(f"  stage {s.index}: {blocks}{extra} ({s.params:,} parameters)")
        for first, last in self.tied:
            lines.append(f"  tied: {first} (stage 0) = {last} (stage {self.pp - 1})")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _refuse(message: str) -> ValueError:
    return ValueError(f"ParallelConfig.pp_split: {message}")


def _block_list(model: nn.Module) -> tuple[str, nn.Module]:
    """The one ModuleList/Sequential holding the model's repeated blocks."""
    found = detect_blocks(model)
    lists = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential))
        and len(m) > 0
        and all(type(c) in found.classes for c in m.children())
    ]
    if len(lists) != 1:
        what = (
            f"{len(lists)} lists of blocks ({', '.join(f or '<root>' for f, _ in lists)})"
            if lists
            else "no list of repeated blocks"
        )
        raise _refuse(
            f"'auto' splits a model at its one list of repeated blocks, and "
            f"{type(model).__name__} has {what}. Give the split yourself as the names of the "
            f"blocks at which each later stage begins ({_EXAMPLE}), or use pp=1."
        )
    return lists[0]


def _siblings(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Modules with parameters beside the path to `container`: (before it, after it), by
    registration order at each level (the order the model's forward runs them)."""
    before: list[str] = []
    after: list[str] = []
    parts = container.split(".") if container else []
    module, prefix = model, ""
    for part in parts:
        side = before
        for name, child in module.named_children():
            if name == part:
                side = after
                continue
            if any(True for _ in child.parameters()):
                side.append(f"{prefix}{name}")
        module = getattr(module, part)
        prefix = f"{prefix}{part}."
    if any(True for _ in model.parameters(recurse=False)) or _holds_own_params(model, parts):
        raise _refuse(
            "a module on the path to the block list holds parameters of its own, which no "
            f"stage could own alone; give pp=1 for {type(model).__name__}."
        )
    return before, after


def _holds_own_params(model: nn.Module, parts: list[str]) -> bool:
    module = model
    for part in parts[:-1]:
        module = getattr(module, part)
        if any(True for _ in module.parameters(recurse=False)):
            return True
    return False


def _sizes(n_blocks: int, pp: int) -> list[int]:
    """Blocks per stage, as equal as possible; the earlier stages take the remainder."""
    base, extra = divmod(n_blocks, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _starts(
    container: str, n_blocks: int, pp: int, split: str | Sequence[str], per_rank: int = 1
) -> list[int]:
    """The index of each stage's first block (`pp` stages in all)."""
    if n_blocks < pp:
        many = f"pp={pp}" if per_rank == 1 else f"pp={pp // per_rank} × {per_rank} per rank = {pp}"
        fix = "pp" if per_rank == 1 else "pp × pp_stages_per_rank"
        raise _refuse(
            f"{many} stages but {container} holds {n_blocks} block(s): each stage needs at "
            f"least one. Use {fix} <= {n_blocks}."
        )
    if split == "auto":
        sizes = _sizes(n_blocks, pp)
        return [sum(sizes[:s]) for s in range(pp)]
    names = [f"{container}.{i}" for i in range(n_blocks)]
    starts = [0]
    for name in split:
        if name not in names[1:]:
            raise _refuse(
                f"{name!r} is not a block at which a later stage can begin: give names from "
                f"{names[1]!r} to {names[-1]!r} ({_EXAMPLE})."
            )
        starts.append(names.index(name))
    if starts != sorted(set(starts)):
        raise _refuse(
            f"{list(split)} must name blocks in increasing order, each once ({_EXAMPLE})."
        )
    return starts


def _ties(model: nn.Module, before: list[str], after: list[str]) -> list[tuple[str, str]]:
    """Parameters registered under both a first-stage and a last-stage module."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)

    def under(name: str, roots: list[str]) -> bool:
        return any(name.startswith(f"{r}.") for r in roots)

    tied = []
    for group in names.values():
        first = [n for n in group if under(n, before)]
        last = [n for n in group if under(n, after)]
        if first and last:
            tied.append((first[0], last[0]))
    return tied


def plan_stages(
    model: nn.Module, pp: int, split: str | Sequence[str] = "auto", per_rank: int = 1
) -> StagePlan:
    """Cut `model` into `pp` × `per_rank` stages (see the module docstring); a ValueError
    naming `pp_split` for a model that cannot be cut that way."""
    pp *= per_rank
    blocks: nn.Module | None
    if split == "auto":
        container, blocks = _block_list(model)
    else:
        first = split[0] if split else ""
        container = first.rsplit(".", 1)[0] if "." in first else ""
        blocks = dict(model.named_modules()).get(container)
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise _refuse(
                f"{first!r} is not a block of a ModuleList or Sequential: name the blocks at "
                f"which each later stage begins ({_EXAMPLE})."
            )
    if not container:
        raise _refuse(
            f"the blocks are the {type(model).__name__} itself, and a pipeline's last stage "
            "runs the model's forward on the batch, targets included, to return the loss, "
            "which a bare list of blocks cannot. Hold the blocks in a module of your own "
            "(self.blocks = ...) whose forward takes the targets and returns the loss."
        )
    n_blocks = len(list(blocks.children()))
    starts = _starts(container, n_blocks, pp, split, per_rank)
    before, after = _siblings(model, container)
    modules = dict(model.named_modules())
    stages = []
    for s, start in enumerate(starts):
        end = starts[s + 1] if s + 1 < pp else n_blocks
        held = [f"{container}.{i}" for i in range(start, end)]
        extra = (before if s == 0 else []) + (after if s == pp - 1 else [])
        seen: set[int] = set()
        params = 0
        for name in held + extra:
            for p in modules[name].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params += p.numel()
        stages.append(Stage(s, tuple(held), tuple(extra), params))
    ties = tuple(_ties(model, before, after))
    return StagePlan(container, tuple(stages), tuple(before), tuple(after), ties, per_rank)
