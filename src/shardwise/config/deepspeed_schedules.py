"""DeepSpeed's learning-rate schedules as functions of the optimizer step, for a torch
LambdaLR that gives each step the lr DeepSpeed would (config/deepspeed.py builds them).

Owns: `deepspeed_lr`, WarmupLR, WarmupDecayLR and WarmupCosineLR as deepspeed/runtime/
lr_schedules.py computes them (read from its source; DeepSpeed is not imported).

Must not: import deepspeed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["SCHEDULE_PARAMS", "deepspeed_lr"]

SCHEDULE_PARAMS = (
    "warmup_min_lr",
    "warmup_max_lr",
    "warmup_num_steps",
    "warmup_type",
    "total_num_steps",
    "warmup_min_ratio",
    "cos_min_ratio",
    "last_batch_iteration",
)
"""The parameters of WarmupLR, WarmupDecayLR and WarmupCosineLR, together."""


def deepspeed_lr(kind: str, p: dict[str, Any]) -> Callable[[int, float], float]:
    """DeepSpeed's lr at optimizer step s, given the optimizer's lr (deepspeed/runtime/
    lr_schedules.py): the scheduler steps after each optimizer step, so step s runs at
    the lr of iteration s - 1, and the constructor's, iteration -1, for step 0."""
    unknown = sorted(set(p) - set(SCHEDULE_PARAMS))
    if unknown:
        raise ValueError(f"{kind} has no parameter {unknown[0]!r}")
    warm = max(2, int(p.get("warmup_num_steps", 1000)))
    kind_of_warmup = p.get("warmup_type", "log")
    if kind_of_warmup not in ("log", "linear"):
        raise ValueError(f"warmup_type={kind_of_warmup!r}: DeepSpeed takes 'log' or 'linear'")

    def rise(i: int) -> float:
        if kind_of_warmup == "log":
            return math.log(i + 1) / math.log(warm)
        return i / warm

    if kind == "WarmupCosineLR":
        total = int(p["total_num_steps"])
        low, end = float(p.get("warmup_min_ratio", 0.0)), float(p.get("cos_min_ratio", 1e-4))

        def cosine(step: int, base: float) -> float:
            i = step - 1
            if i < 0:
                return 0.0
            if i < warm:
                return base * (low + rise(i) * (1 - low))
            ratio = (1 + math.cos(math.pi * (i - warm + 1) / (total - warm))) / 2
            return base * max(0.0, end + (1 - end) * ratio)

        return cosine
    low, top = float(p.get("warmup_min_lr", 0.0)), p.get("warmup_max_lr", 1e-3)
    total = int(p["total_num_steps"]) if kind == "WarmupDecayLR" else 0

    def warmup(step: int, base: float) -> float:
        high = base if top is None else float(top)  # None: 'auto', the optimizer's lr
        i = step - 1
        if i < 0:
            return low
        if i < warm:
            return low + (high - low) * rise(i)
        if kind == "WarmupLR":
            return high
        return low + (high - low) * max(0.0, (total - i) / max(1.0, total - warm))

    return warmup
