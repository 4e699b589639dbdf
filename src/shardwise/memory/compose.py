"""The fast simulation: each distinct block traced once or twice, the step's peak composed.

Owns: deciding which blocks of a model's block list are the same (`block_keys`: class,
parameter and buffer shapes and dtypes, the scalar settings of every submodule, and the
wrap plan's units inside the block, activation checkpointing included), finding the
longest run of blocks that repeats with a period of 1 to 4 (`find_run`: one kind of layer,
or alternating kinds such as sliding and global attention, dense and MoE layers), building
the model with that run cut to two short lengths (`truncated`), recording each trace's
memory by segment of the step (`SegmentRecorder`), and composing the step at the full
length from the two traces (`compose`).

How the composition works. The step is cut into segments by the blocks' own hooks: the
forward of block i, the backward of block i, what runs before the first block and after
the last (each in its phase). Every segment of a block at a given distance from the start
or from the end of the run (two periods each side, where prefetching and the first and
last backward differ), and every segment outside the run, holds at each moment the same
tensors whatever the run's length, plus what the run's length adds linearly: the model
states of every block, the activations kept by the blocks before it, the gradients of the
blocks after it. So each segment's peak (and each category at it) is affine in the run's
length, and two traces whose runs differ by one period give it exactly at any length with
the same phase. The blocks in the middle of the run are affine in their position too, so
their segments peak no higher than the first or last of them, which are traced. The step's
peak is the highest composed segment.

What it assumes, and where it falls back. A block's memory depends on its key, not on its
index in the list: attributes named like an index (`layer_idx`) are left out of the key,
so a block whose forward reads its own index to choose what it keeps is composed as its
neighbours are (say so in docs/memory.md). Blocks whose key differs from their neighbours'
(a block of another width, a dense block among MoE ones) are outside the run and traced
whole in both traces. A model with no run longer than the two traces, or whose traces do
not have the same segments, is simulated whole (`path="full"` in the report, with the
reason in its notes).

Must not: change what one trace measures (simulate.py runs each trace exactly as the full
simulation runs the whole model).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import nn

from shardwise.memory.workers import Job

__all__ = [
    "BlockRun",
    "SegmentRecorder",
    "block_keys",
    "compose",
    "find_run",
    "plan_run",
    "reuse_builds",
    "truncated",
]

EDGE_PERIODS = 2
"""Periods of the run at each end traced as their own segments: prefetching makes the
second block from each end differ from the first, and the rest like the second."""
MAX_PERIOD = 4
ONLY_IF_SHORTER = True
"""Compose only when the two traces hold fewer blocks than the run: a shorter run (a
pipeline stage of 8 blocks) is traced whole, which is cheaper. The tests turn it off to
check the composition on small models."""
INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
"""Attributes that hold a block's own index: left out of its key (see the module docstring)."""

Key = tuple[Any, ...]


def _scalar_settings(block: nn.Module) -> tuple[Any, ...]:
    out = []
    for name, module in block.named_modules():
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or attr in INDEX_ATTRS or attr == "training":
                continue
            if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
                out.append((name, attr, repr(value)))
    return tuple(out)


def block_keys(container: nn.Module, name: str, plan: Any) -> list[Key]:
    """One key per entry of `container` (named `name` in the model): what makes two blocks
    the same for memory under `plan` (see the module docstring)."""
    keys = []
    for index, block in enumerate(container.children()):
        prefix = f"{name}.{index}" if name else str(index)
        units = tuple(
            (
                u.fqn[len(prefix) :],
                u.reason,
                u.compute_dtype,
                u.reshard_after_forward,
                u.activation_checkpointing,
                u.trainable_params,
                u.frozen_params,
            )
            for u in plan
            if u.fqn == prefix or u.fqn.startswith(prefix + ".")
        )
        params = tuple(
            (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters()
        )
        buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers())
        classes = tuple(type(m).__name__ for m in block.modules())
        keys.append((classes, params, buffers, _scalar_settings(block), units))
    return keys


@dataclass(frozen=True)
class BlockRun:
    """A run of `container`'s entries [start, end) whose keys repeat every `period`."""

    container: str
    length: int
    period: int
    start: int
    end: int

    @property
    def run(self) -> int:
        return self.end - self.start

    def lengths(self) -> tuple[int, int]:
        """The run's two traced lengths: the shortest with the run's phase and
        EDGE_PERIODS periods at each end, and one period more."""
        short = 2 * EDGE_PERIODS * self.period
        short += (self.run - short) % self.period
        return short, short + self.period

    def keep(self, run: int) -> list[int]:
        """The container's entries kept when the run is cut to `run` blocks: its first
        EDGE_PERIODS periods and its last blocks (a whole number of periods is dropped
        from the middle, so every kept block keeps its phase)."""
        head = EDGE_PERIODS * self.period
        return [
            *range(self.start + head),
            *range(self.end - (run - head), self.length),
        ]

    def role(self, index: int, run: int) -> tuple[str, int] | None:
        """Where entry `index` of the cut container sits: before or after the run, or the
        t-th block from the run's start or end; None in the middle (not composed)."""
        if index < self.start:
            return ("before", index)
        t = index - self.start
        if t >= run:
            return ("after", t - run)
        edge = EDGE_PERIODS * self.period
        if t < edge:
            return ("start", t)
        if run - 1 - t < edge:
            return ("end", run - 1 - t)
        return None

    def describe(self) -> str:
        kinds = "one kind of block" if self.period == 1 else f"{self.period} kinds alternating"
        short, long = self.lengths()
        outside = self.length - self.run
        return (
            f"{self.container}[{self.start}:{self.end}] ({self.run} blocks, {kinds}) traced at "
            f"{short} and {long} blocks and composed"
            + (f"; {outside} other block(s) traced whole" if outside else "")
        )


def find_run(keys: list[Key], container: str) -> BlockRun | None:
    """The longest run of entries holding parameters whose keys repeat with the smallest
    period (1 to MAX_PERIOD); None if no run has 2 * EDGE_PERIODS + 2 periods."""
    best: BlockRun | None = None
    n = len(keys)
    for period in range(1, MAX_PERIOD + 1):
        for i in range(n):
            j = i
            while j + period < n and keys[j] == keys[j + period]:
                j += 1
            run = BlockRun(container, n, period, i, min(j + period, n))
            enough = run.run >= period * (2 * EDGE_PERIODS + 2) and bool(keys[i][1])
            if enough and (best is None or run.run > best.run):
                best = run
    return best


def _container(model: nn.Module, plan: Any) -> tuple[str, nn.Module] | None:
    """The ModuleList (or Sequential) most of the plan's block units are entries of."""
    counts: dict[str, int] = {}
    for unit in plan:
        parent, _, last = unit.fqn.rpartition(".")
        if unit.reason == "policy" and last.isdigit() and parent:  # not the root itself
            counts[parent] = counts.get(parent, 0) + 1
    for parent in sorted(counts, key=lambda p: -counts[p]):
        module = model.get_submodule(parent)
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            return parent, module
    return None


def plan_run(model: nn.Module, config: Any) -> tuple[BlockRun | None, str]:
    """The run to compose in `model` (built on meta) under `config`, or None and why not."""
    from shardwise.plan.planner import PlanNotice, plan_wrap

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanNotice)
        plan = plan_wrap(model, config)
    found = _container(model, plan)
    if found is None:
        return None, "no wrap unit is an entry of a block list (ModuleList)"
    name, container = found
    run = find_run(block_keys(container, name, plan), name)
    if run is None:
        return None, (
            f"{name} has no run of same blocks long enough to compose (each kind needs "
            f"{2 * EDGE_PERIODS + 2} or more in a row)"
        )
    return run, ""


def _swap_blocks(model: nn.Module, container: str, keep: list[int]) -> nn.Module:
    """Put a list of `keep`'s entries in place of the block list `container` (a dotted
    name below the root); returns the list taken out."""
    parent, _, last = container.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    blocks = owner.get_submodule(last)
    kept = [list(blocks.children())[i] for i in keep]
    setattr(
        owner,
        last,
        nn.Sequential(*kept) if isinstance(blocks, nn.Sequential) else nn.ModuleList(kept),
    )
    return blocks


def _cut(factory: Callable[[], nn.Module], container: str, keep: list[int]) -> nn.Module:
    model = factory()
    _swap_blocks(model, container, keep)
    return model


def truncated(factory: Callable[[], nn.Module], run: BlockRun, length: int) -> Any:
    """A factory of the model with the run cut to `length` blocks (picklable when
    `factory` is)."""
    return functools.partial(_cut, factory, run.container, run.keep(length))


def _copied(
    source: nn.Module, container: str, keep: list[int], stage: tuple[Any, ...] | None = None
) -> nn.Module:
    """A copy of `source` (built on meta) with its block list cut to `keep`: parameters
    as new meta parameters (materialised as the simulation's own are), every other tensor
    new and empty in the caller's mode (the simulation's fake tensors), as `source`'s
    factory would have made them there. Building the whole model again for each trace
    costs more than the trace of a large one. With `stage` (pp, split, index) `source` is
    the whole model: the copy is cut into that pipeline stage first, as the simulation's
    stage factory cuts it, and then its block list."""
    memo: dict[int, Any] = {}
    for p in source.parameters():
        if id(p) not in memo:
            empty = torch.empty(p.shape, dtype=p.dtype, device="meta")
            memo[id(p)] = nn.Parameter(empty, p.requires_grad)
    for module in source.modules():
        others = [*module._buffers.values(), *vars(module).values()]
        for t in others:
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = torch.empty(t.shape, dtype=t.dtype)
    if stage is not None:
        from shardwise.memory.stages import _built_stage

        model = _built_stage(lambda: copy.deepcopy(source, memo), *stage)
        _swap_blocks(model, container, keep)
        return model
    blocks = _swap_blocks(source, container, keep)
    try:
        return copy.deepcopy(source, memo)
    finally:
        parent, _, last = container.rpartition(".")
        setattr(source.get_submodule(parent) if parent else source, last, blocks)


# --------------------------------------------------------------------------- recording


SegmentLabel = tuple[int, str, "tuple[str, int] | None"]
"""A segment of the step: (position in the step's order, phase, the block's role)."""


class Segment(TypedDict):
    """One segment's figures: its peak, the categories at it, each category's own peak."""

    peak: int
    at_peak: dict[str, int]
    own: dict[str, int]


@dataclass
class SegmentRecorder:
    """Each segment's peak while a tracked step runs: the segment is (position in the
    step's order, phase, the role of the block whose forward or backward runs)."""

    run: BlockRun
    length: int
    step: int = 0
    phase: str = "F"
    block: tuple[str, int] | None = None
    segments: dict[Any, dict[str, Any]] = field(default_factory=dict)
    _names: dict[Any, str] = field(default_factory=dict, repr=False)

    def set_phase(self, step: int, phase: str) -> None:
        self.step, self.phase, self.block = step, phase, None

    def hook(self, model: nn.Module) -> None:
        """Label the segments by the cut container's blocks in `model` (wrapped)."""
        inner = getattr(model, "module", model)  # DDP
        blocks = inner.get_submodule(self.run.container)
        for index, block in enumerate(blocks.children()):
            role = self.run.role(index, self.length)
            block.register_forward_pre_hook(functools.partial(self._forward, role))
            block.register_forward_hook(functools.partial(self._output, role))

    def _forward(self, role: Any, module: nn.Module, args: Any) -> None:
        if self.phase == "F":
            self.block = role or ("middle", 0)

    def _output(self, role: Any, module: nn.Module, args: Any, out: Any) -> None:
        if self.phase != "F":
            return
        tensors = [out] if isinstance(out, torch.Tensor) else list(_tensors(out))
        for t in tensors:
            if t.requires_grad:
                t.register_hook(functools.partial(self._backward, role))
                return

    def _backward(self, role: Any, grad: torch.Tensor) -> None:
        self.block = role or ("middle", 0)

    def attach(self, tracker: Any, categories: dict[str, str]) -> None:
        """Record the running snapshot into the current segment at every update."""
        original = tracker._update_peak_stats

        def update(peak_state: Any) -> None:
            original(peak_state)
            for dev_snap in tracker._curr_mem_snap.values():
                self._record(dev_snap, categories)

        tracker._update_peak_stats = update

    def finish(self, extra: int) -> dict[Any, dict[str, Any]]:
        """The segments, with `extra` bytes held throughout (DDP's buckets) added."""
        if extra:
            for seg in self.segments.values():
                seg["peak"] += extra
                seg["at_peak"]["ddp_buckets"] = seg["own"]["ddp_buckets"] = extra
        return self.segments

    def _record(self, dev_snap: dict[Any, int], categories: dict[str, str]) -> None:
        label = (self.step, self.phase, self.block)
        seg = self.segments.get(label)
        total = int(dev_snap.get("Total", 0))
        now: dict[str, int] = {}
        names = self._names
        for key, value in dev_snap.items():
            name = names.get(key)
            if name is None:
                name = names[key] = categories.get(getattr(key, "value", str(key)), "other")
            if key != "Total":
                now[name] = now.get(name, 0) + int(value)
        if seg is None:
            seg = self.segments[label] = {"peak": -1, "at_peak": {}, "own": {}}
        if total > seg["peak"]:
            seg["peak"], seg["at_peak"] = total, now
        own = seg["own"]
        for name, value in now.items():
            if value > own.get(name, 0):
                own[name] = value


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif hasattr(value, "to_tuple"):  # transformers' ModelOutput
        yield from _tensors(value.to_tuple())


# --------------------------------------------------------------------------- composing


_PHASES = {"F": "the forward", "B": "the backward", "O": "the optimizer step"}


def _label_text(label: Any) -> str:
    """'the backward of the run's last block' and the like (with the position in a
    pipeline stage's order when there are several forwards)."""
    step, phase, role = label
    where = _PHASES.get(phase, phase)
    if role is not None:
        kind, t = role
        block = {
            "start": f"the run's block {t}",
            "end": "the run's last block" if t == 0 else f"the run's block {t} from its end",
            "before": f"block {t} before the run",
            "after": f"block {t} after the run",
        }.get(kind, "a block in the middle of the run")
        where += f" of {block}"
    return where if step in (0, 1, 2) else f"{where} (step {step} of the stage's order)"


def compose(
    run: BlockRun, short: dict[Any, Any], long: dict[Any, Any], extra: int = 0
) -> dict[str, Any]:
    """The step at the run's full length from its traces at `run.lengths()` (their
    segments): each segment's peak, categories at it and categories' own peaks extended
    linearly; the highest segment is the peak. `extra` (DDP's buckets at each length is
    linear too) is handled by the caller. Raises ValueError if the two traces' segments
    differ (the composition would not be exact)."""
    a_len, b_len = run.lengths()
    steps = (run.run - a_len) // run.period
    composed_keys = {k for k in short if k[2] is None or k[2][0] != "middle"}
    wanted = {k for k in long if k[2] is None or k[2][0] != "middle"}
    if composed_keys != wanted:
        only = sorted(map(_label_text, composed_keys ^ wanted))[:4]
        raise ValueError(f"the traces at {a_len} and {b_len} blocks differ in segments {only}")

    def grow(a: int, b: int) -> int:
        return a + steps * (b - a)

    best: dict[str, Any] | None = None
    own: dict[str, int] = {}
    for label in composed_keys:
        s, t = short[label], long[label]
        peak = grow(s["peak"], t["peak"])
        names = set(s["at_peak"]) | set(t["at_peak"])
        at_peak = {n: grow(s["at_peak"].get(n, 0), t["at_peak"].get(n, 0)) for n in names}
        for n in set(s["own"]) | set(t["own"]):
            own[n] = max(own.get(n, 0), grow(s["own"].get(n, 0), t["own"].get(n, 0)))
        if best is None or peak > best["peak"]:
            best = {"peak": peak, "at_peak": at_peak, "label": label}
    assert best is not None
    return {
        "peak": best["peak"],
        "at_peak": best["at_peak"],
        "category_peaks": own,
        "label": best["label"],
    }


# --------------------------------------------------------------------------- the fast path

_BUILDS: contextvars.ContextVar[dict[Any, nn.Module] | None] = contextvars.ContextVar(
    "shardwise_fast_sim_builds", default=None
)


@contextlib.contextmanager
def reuse_builds(built: dict[Any, nn.Module] | None = None) -> Iterator[None]:
    """Within it, the fast path builds each model factory's model on meta once and copies
    it for every trace: for callers that simulate one factory several times (each stage of
    a pipeline, each strategy of `shardwise plan`, each candidate of `choose_plan`), which
    expect it to build the same model each time. `built`: factories already built on
    meta by the caller (`{factory: model}`), not built again."""
    if _BUILDS.get() is not None:
        yield
        return
    token = _BUILDS.set(dict(built or {}))
    try:
        yield
    finally:
        _BUILDS.reset(token)


def _meta_build(factory: Callable[[], nn.Module]) -> nn.Module:
    builds = _BUILDS.get()
    if builds is not None and factory in builds:
        return builds[factory]
    with torch.device("meta"):
        model = factory()
    if builds is not None:
        builds[factory] = model
    return model


def composed_step(kwargs: dict[str, Any], in_process: bool = True) -> Job:
    """simulate_step's fast path for one model (or one pipeline stage), as a job
    (memory/workers.py): it asks for traces of simulate_step's arguments `kwargs` (with
    `segments` to record them): the run of same blocks at two short lengths, both at once,
    and composes the step; else the whole model (`path="full"`, the reason in the notes)."""
    import dataclasses

    from shardwise.memory.stages import _built_stage

    made = kwargs["model_factory"]
    stage = None
    if isinstance(made, functools.partial) and made.func is _built_stage:
        made, *rest = made.args  # a pipeline stage: the whole model, cut when copied
        stage = tuple(rest)
    source = _meta_build(made)
    with torch.device("meta"):
        model = _built_stage(lambda: copy.deepcopy(source), *stage) if stage else source
    run, why = plan_run(model, kwargs["config"])
    del model
    if run is not None and ONLY_IF_SHORTER and sum(run.lengths()) >= run.run:
        short, long = run.lengths()
        why = (
            f"{run.container} has a run of {run.run} same blocks, and composing traces "
            f"{short} + {long}: tracing it whole is cheaper"
        )
        run = None
    if run is not None:
        wanted = []
        for length in run.lengths():
            factory = (
                functools.partial(_copied, source, run.container, run.keep(length), stage)
                if in_process  # a subprocess builds its own (a model need not pickle)
                else truncated(kwargs["model_factory"], run, length)
            )
            wanted.append(dict(kwargs, model_factory=factory, segments=(run, length)))
        traces = yield wanted
        try:
            step = compose(run, traces[0].segments, traces[1].segments)
        except ValueError as exc:
            why = str(exc)
        else:
            note = f"fast simulation: {run.describe()}; peak in {_label_text(step['label'])}"
            return dataclasses.replace(
                traces[1],
                peak=step["peak"],
                at_peak=step["at_peak"],
                category_peaks=step["category_peaks"],
                path="fast",
                segments={},
                notes=[note, *traces[1].notes],
            )
    (report,) = yield [kwargs]
    note = f"fast simulation not possible, every block traced: {why}"
    return dataclasses.replace(report, path="full", notes=[note, *report.notes])
