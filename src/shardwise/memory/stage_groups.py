"""The fast simulation of pipeline stages: stages holding the same blocks simulated once
per count of micro-batches in flight, the others derived.

Owns: deciding which stages are the same for memory (`stage_keys`: the fast simulation's
key of each block they hold, the modules outside the blocks, first or last), which of
them to trace (`traced_stages`) and the reports of the others (`derived_stages`).

Why it is exact. A stage's step depends on its blocks and on its schedule's order, which
depends on its index only through the micro-batches it holds in flight (memory/stages.py:
1F1B's stage i of pp holds pp - i, GPipe's every stage all of them). Stages with the same
blocks and the same count run the same step: one is traced, the others copied. Under 1F1B
each segment of the step (a forward or backward with so many micro-batches held) is affine
in the count, so the peak is the highest of affine functions, convex in it: the stages
between the fewest and most in flight are interpolated between those two traced stages;
exact where the same segment peaks at both ends (every case the tests measure), an upper
bound otherwise, and never above both ends, so the stage with the highest peak, which the
plan reports, is always a traced one. The first and last stages (embeddings, head) are
always traced.

Must not: trace anything (simulate_stages runs the traces).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from torch import nn

from shardwise.memory.compose import block_keys
from shardwise.memory.stages import StageSim
from shardwise.plan.planner import PlanNotice, plan_wrap
from shardwise.plan.stages import StagePlan

__all__ = ["derived_stages", "stage_keys", "traced_stages"]


def stage_keys(whole: nn.Module, plan: StagePlan, config: Any) -> list[Any]:
    """What makes two stages the same for memory: the fast simulation's key of each of
    their blocks (memory/compose.py), the modules outside the blocks they hold, and
    whether they are the first or last stage (which receive or send nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanNotice)
        units = plan_wrap(whole, dataclasses.replace(config, pp=1))
    container = whole.get_submodule(plan.container)
    names = [f"{plan.container}.{i}" for i in range(len(list(container.children())))]
    keys = dict(zip(names, block_keys(container, plan.container, units), strict=True))
    last = plan.pp - 1
    return [
        (st.index == 0, st.index == last, st.modules, tuple(keys[b] for b in st.blocks))
        for st in plan.stages
    ]


def traced_stages(
    whole: nn.Module, plan: StagePlan, config: Any, microbatches: int
) -> dict[int, Any]:
    """For each stage: None if it is traced, ("copy", j) if it holds the same blocks as
    stage j with as many micro-batches in flight (its step is the same), ("between", lo,
    hi) if it holds the same blocks as stages lo and hi and lies between their in-flight
    counts (1F1B). Each segment of the step is affine in the count in flight, so the peak
    is convex in it: the interpolation is exact where one segment peaks at both ends, an
    upper bound otherwise, and never above both ends (the reported stage is a traced one)."""
    keys = stage_keys(whole, plan, config)
    groups: dict[Any, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    out: dict[int, Any] = {}
    for members in groups.values():
        by_count: dict[int, int] = {}
        for index in members:
            k = StageSim(plan, index, config.pp_schedule, microbatches, 0).in_flight
            if k in by_count:
                out[index] = ("copy", by_count[k])
            else:
                by_count[k] = index
        counts = sorted(by_count)
        for k in counts:
            inner = counts[0] < k < counts[-1]
            out[by_count[k]] = (
                ("between", by_count[counts[0]], by_count[counts[-1]]) if inner else None
            )
    return out


def _line(x: int, y: int, at: int, span: int) -> int:
    """x + (y - x) * at / span, rounded up where not whole (a bound)."""
    return x + -((x - y) * at // span)


def _lines(x: dict[str, int], y: dict[str, int], at: int, span: int) -> dict[str, int]:
    return {n: _line(x.get(n, 0), y.get(n, 0), at, span) for n in {*x, *y}}


def derived_stages(
    plan: StagePlan,
    schedule: str,
    microbatches: int,
    hidden: int,
    traced: dict[int, Any],
    reports: list[tuple[StageSim, Any]],
) -> list[tuple[StageSim, Any]]:
    """The reports of the stages `traced_stages` derives, from the traced ones."""
    done = {st.index: r for st, r in reports}
    out = []
    for index, how in sorted(traced.items()):
        if how is None:
            continue
        stage = StageSim(plan, index, schedule, microbatches, hidden)
        if how[0] == "copy":
            out.append((stage, done[how[1]]))
            continue
        lo, hi = (StageSim(plan, j, schedule, microbatches, hidden) for j in how[1:])
        a, b = done[lo.index], done[hi.index]
        span, at = hi.in_flight - lo.in_flight, stage.in_flight - lo.in_flight

        out.append(
            (
                stage,
                dataclasses.replace(
                    a,
                    peak=_line(a.peak, b.peak, at, span),
                    at_peak=_lines(a.at_peak, b.at_peak, at, span),
                    category_peaks=_lines(a.category_peaks, b.category_peaks, at, span),
                ),
            )
        )
    return out
