"""The pipeline-parallel fields of ParallelConfig: the schedule words and the checks that
need neither a model nor a world size.

Owns: `PP_SCHEDULES`, `BUILT_SCHEDULES`, `PPSplit` and `validate_pp` (called by
ParallelConfig's validation), and `check_microbatches`, the rules a schedule puts on the
number of micro-batches and the batch (pure, so every rank runs it before any group exists).
Must not: import torch's pipelining (config stays light), or check anything that needs
the model (plan/stages.py does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from shardwise.config.names import closest
from shardwise.config.vocabulary import integral

__all__ = [
    "BUILT_SCHEDULES",
    "PP_SCHEDULES",
    "PPSchedule",
    "PPSplit",
    "check_microbatches",
    "default_microbatches",
    "stages_per_rank",
    "validate_pp",
]

PPSchedule = Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv"]
PP_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "zbv")
"""The schedules `pp_schedule` names (torch's Schedule1F1B, ScheduleGPipe,
ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)."""
BUILT_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")
"""The schedules wrap builds today."""
MULTI_STAGE: tuple[str, ...] = ("interleaved_1f1b", "zbv")
"""Schedules that run two or more stages on each rank."""
PPSplit = Literal["auto"] | Sequence[str]
"""`pp_split`: 'auto', or the module names at which each stage after the first begins."""


def default_microbatches(pp: int) -> int:
    """pp_microbatches=None: twice the stages, the fewest that keep 1F1B's bubble at most
    a third of the step ((pp - 1) / (m + pp - 1) with m = 2 pp)."""
    return 2 * pp


def stages_per_rank(schedule: str, given: int | None) -> int:
    """`pp_stages_per_rank` resolved: None is 2 for a schedule of several stages per rank,
    1 otherwise."""
    if given is not None:
        return given
    return 2 if schedule in MULTI_STAGE else 1


def _check_stages_per_rank(cfg: Any) -> None:
    given = cfg.pp_stages_per_rank
    if given is not None:
        cfg.pp_stages_per_rank = given = integral(given, "ParallelConfig.pp_stages_per_rank")
    per_rank = stages_per_rank(cfg.pp_schedule, given)
    schedule = cfg.pp_schedule
    if schedule in MULTI_STAGE:
        wanted, allowed = (
            ("2", per_rank == 2) if schedule == "zbv" else ("2 or more", per_rank >= 2)
        )
    else:
        wanted, allowed = "1", per_rank == 1
    if not allowed:
        raise ValueError(
            f"ParallelConfig.pp_stages_per_rank={given} with pp_schedule={schedule!r}: that "
            f"schedule runs {wanted} stage(s) per rank. Set pp_stages_per_rank to {wanted} "
            "(None picks it), or choose "
            f"{'interleaved_1f1b' if schedule not in MULTI_STAGE else '1f1b or gpipe'}."
        )


def validate_pp(cfg: Any) -> None:
    """A ParallelConfig's pp, pp_schedule, pp_microbatches and pp_split, as far as they can
    be checked without a model or a world size (`cfg` is not typed as ParallelConfig here,
    which imports this module)."""
    cfg.pp = integral(cfg.pp, "ParallelConfig.pp")
    if cfg.pp < 1:
        raise ValueError(f"ParallelConfig.pp={cfg.pp} must be >= 1 (1: no pipeline stages).")
    if isinstance(cfg.pp_schedule, str) and cfg.pp_schedule.lower() in PP_SCHEDULES:
        cfg.pp_schedule = cfg.pp_schedule.lower()  # torch's class names: Schedule1F1B
    if cfg.pp_schedule not in PP_SCHEDULES:
        raise ValueError(
            f"ParallelConfig.pp_schedule={cfg.pp_schedule!r} is not a schedule shardwise "
            f"knows.{closest(str(cfg.pp_schedule), PP_SCHEDULES)} Choose one of "
            f"{list(PP_SCHEDULES)}."
        )
    if cfg.pp_microbatches is not None:
        cfg.pp_microbatches = integral(cfg.pp_microbatches, "ParallelConfig.pp_microbatches")
        if cfg.pp_microbatches < 1:
            raise ValueError(
                f"ParallelConfig.pp_microbatches={cfg.pp_microbatches} must be >= 1, or None "
                f"(twice the stages)."
            )
    _check_stages_per_rank(cfg)
    stages = cfg.pp * stages_per_rank(cfg.pp_schedule, cfg.pp_stages_per_rank)
    split = cfg.pp_split
    if isinstance(split, str):
        if split != "auto":
            raise ValueError(
                f"ParallelConfig.pp_split={split!r}: give 'auto' or a list of the module names "
                "at which each stage after the first begins, e.g. ['model.layers.2'] for "
                "pp=2 over a 4-layer Hugging Face decoder."
            )
    else:
        names = tuple(split)
        if not all(isinstance(n, str) and n for n in names):
            raise TypeError(
                f"ParallelConfig.pp_split={split!r}: each entry must be a module name (a "
                "non-empty string), e.g. ['model.layers.2']."
            )
        cfg.pp_split = names
        if cfg.pp > 1 and len(names) != stages - 1:
            raise ValueError(
                f"ParallelConfig.pp_split lists {len(names)} module name(s) for {stages} "
                f"stages (pp={cfg.pp} × pp_stages_per_rank={stages // cfg.pp}): give "
                f"{stages - 1}, the first module of each stage after the first, or "
                "pp_split='auto'."
            )
    if cfg.pp == 1:
        return
    if cfg.pp_schedule not in BUILT_SCHEDULES:
        raise NotImplementedError(
            f"ParallelConfig.pp_schedule={cfg.pp_schedule!r} is not built yet: its V shape "
            "puts the first and the last stage on one rank, and no test proves it equal to one "
            f"process. Use {', '.join(repr(s) for s in BUILT_SCHEDULES)}."
        )
    if cfg.tp == "auto" or cfg.strategy == "auto":
        raise NotImplementedError(
            f"ParallelConfig(pp={cfg.pp}) with strategy or tp 'auto' is not built yet: the "
            "planner does not simulate pipeline stages. Give the strategy and tp yourself."
        )


def check_microbatches(pp: int, schedule: str, microbatches: int, batch_rows: int) -> None:
    """The rules a schedule puts on its micro-batches, for a rank's batch of `batch_rows`
    rows: 1F1B needs at least as many micro-batches as stages, interleaved 1F1B a number
    that divides into its rounds (torch's rule), and the batch must split
    into equal micro-batches (the schedule's mean over them equals the batch's mean only
    then)."""
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(
            f"ParallelConfig.pp_microbatches={microbatches} with pp_schedule='1f1b' and pp={pp}: "
            f"1F1B needs at least as many micro-batches as stages. Set pp_microbatches >= {pp} "
            "(None gives twice the stages), or use pp_schedule='gpipe'."
        )
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved_1f1b" and microbatches % rounds != 0:
        fits = [m for m in range(pp, 4 * pp + 1) if m % max(1, m // pp) == 0]
        raise ValueError(
            f"ParallelConfig.pp_microbatches={microbatches} with pp_schedule="
            f"'interleaved_1f1b' and pp={pp}: the schedule runs micro-batches in rounds of "
            f"about pp, and {microbatches} does not divide into its {rounds} rounds. Use one "
            f"of {fits[:6]} (a multiple of pp always works)."
        )
    if batch_rows % microbatches != 0:
        raise ValueError(
            f"ParallelConfig.pp_microbatches={microbatches} does not divide this rank's batch "
            f"of {batch_rows} row(s): each micro-batch must hold the same number of rows. "
            f"Use a batch of a multiple of {microbatches} rows per data-parallel rank, or a "
            "pp_microbatches that divides it."
        )
