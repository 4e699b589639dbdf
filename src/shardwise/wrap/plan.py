"""The wrap plan: which submodules become FSDP2 shard units, as data you can print.

Owns: `WrapUnit`/`WrapPlan` and `plan_wrap`, which walks the model once (post-order:
children before parents, root last) and records each unit. Planning allocates nothing,
so it works on a model built on the meta device.

Must not: call fully_shard or touch process groups; `strategies.py` applies a plan.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from shardwise.config import ParallelConfig
from shardwise.wrap.policies import resolve_policy


@dataclass(frozen=True)
class WrapUnit:
    """One shard unit: a submodule handed to fully_shard, owning its not-yet-owned params."""

    fqn: str
    """Dotted path of the module in the model ('' for the root)."""
    module_class: str
    num_params: int
    """Parameters this unit owns (those not inside a unit below it)."""
    bytes_by_dtype: dict[str, int]
    trainable_params: int
    frozen_params: int
    reshard_after_forward: bool | int

    @property
    def is_root(self) -> bool:
        return self.fqn == ""


@dataclass(frozen=True)
class WrapPlan:
    """Units in application order: post-order (children first), the root last."""

    units: list[WrapUnit]
    strategy: str
    precision: str
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[WrapUnit]:
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)

    @property
    def total_params(self) -> int:
        return sum(u.num_params for u in self.units)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "precision": self.precision,
            "total_params": self.total_params,
            "units": [asdict(u) for u in self.units],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        header = f"{'unit':<40} {'class':<24} {'params':>12} {'frozen':>10} {'reshard':>8}"
        lines = [
            f"WrapPlan: {len(self.units)} unit(s), {self.total_params:,} params, "
            f"strategy={self.strategy}, precision={self.precision}",
            header,
            "-" * len(header),
        ]
        for u in self.units:
            name = "<root>" if u.is_root else u.fqn
            lines.append(
                f"{name:<40} {u.module_class:<24} {u.num_params:>12,} {u.frozen_params:>10,} "
                f"{u.reshard_after_forward!s:>8}"
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def plan_wrap(
    model: nn.Module, config: ParallelConfig, *, reshard_after_forward: bool | int = True
) -> WrapPlan:
    """Decide the shard units of `model` under `config`, without changing the model.

    `reshard_after_forward` is the mesh's choice for non-root units; the root never
    reshards after forward, since backward needs its parameters immediately.
    """
    policy = resolve_policy(config.auto_wrap_policy, model)
    chosen: list[tuple[str, nn.Module]] = [
        (fqn, mod) for fqn, mod in _post_order(model) if fqn and policy(fqn, mod)
    ]
    chosen.append(("", model))

    owned: set[int] = set()  # ids of parameters already inside a unit below
    units: list[WrapUnit] = []
    for fqn, mod in chosen:
        params = [p for p in mod.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        by_dtype: dict[str, int] = {}
        for p in params:
            key = str(p.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
        units.append(
            WrapUnit(
                fqn=fqn,
                module_class=type(mod).__name__,
                num_params=sum(p.numel() for p in params),
                bytes_by_dtype=by_dtype,
                trainable_params=sum(p.numel() for p in params if p.requires_grad),
                frozen_params=sum(p.numel() for p in params if not p.requires_grad),
                reshard_after_forward=False if fqn == "" else reshard_after_forward,
            )
        )
    return WrapPlan(units=units, strategy=config.strategy, precision=str(config.precision))
