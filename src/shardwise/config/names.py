"""shardwise's own words for strategies: the canonical names, their aliases, and spelling help.

Owns: STRATEGIES with their type StrategyName (and StrategySetting, which adds 'auto'),
normalize_strategy (our names, common aliases, FSDP1's
ShardingStrategy names and members), and `closest` for "did you mean" hints. Every module
that needs a strategy's name imports it from here.

Must not: import anything of shardwise, torch.distributed, or read the environment.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Literal, cast, get_args

StrategyName = Literal[
    "ddp", "no_shard", "shard_grad_op", "full_shard", "hybrid_shard", "hybrid_shard_zero2"
]
"""shardwise's own name of each strategy, the canonical form every other spelling becomes."""
StrategySetting = Literal[StrategyName, "auto"]
"""What `ParallelConfig.strategy` holds: a strategy, or 'auto' (chosen by the planner)."""
STRATEGIES: tuple[StrategyName, ...] = get_args(StrategyName)

# FSDP1's ShardingStrategy member names, so configs from FSDP1-era tools keep working.
_FSDP1_STRATEGY_NAMES: dict[str, StrategyName] = {
    "FULL_SHARD": "full_shard",
    "SHARD_GRAD_OP": "shard_grad_op",
    "NO_SHARD": "no_shard",
    "HYBRID_SHARD": "hybrid_shard",
    "_HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
    "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
}
# Common spellings users bring from other frameworks.
_STRATEGY_ALIASES: dict[str, StrategyName] = {
    "fsdp": "full_shard",
    "zero3": "full_shard",
    "zero2": "shard_grad_op",
    "hsdp": "hybrid_shard",
    "ddp_fully_sharded": "full_shard",  # Lightning's fairscale strategy (reshards: ZeRO-3)
    "fsdp_full_shard": "full_shard",
}


def closest(value: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' for the closest choice, or '' when nothing is close."""
    match = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {match[0]!r}?" if match else ""


def normalize_strategy(value: object) -> StrategySetting:
    """Our canonical strategy name (or 'auto') for a name, alias, FSDP1 name or
    `ShardingStrategy`; `value` may be anything, and what is none of those is an error."""
    name = getattr(value, "name", value)  # torch's ShardingStrategy enum members
    if isinstance(name, str):  # str(ShardingStrategy.X), as YAML files of FSDP1 tools hold it
        name = name.removeprefix("ShardingStrategy.")
    if not isinstance(name, str):
        raise TypeError(
            f"ParallelConfig.strategy must be a string or torch ShardingStrategy, "
            f"got {type(value).__name__} ({value!r})."
        )
    if name in _FSDP1_STRATEGY_NAMES:
        return _FSDP1_STRATEGY_NAMES[name]
    key = name.lower().replace("-", "_")
    if key in STRATEGIES or key == "auto":
        return cast(StrategySetting, key)
    if key in _STRATEGY_ALIASES:
        return _STRATEGY_ALIASES[key]
    known = [*STRATEGIES, *_FSDP1_STRATEGY_NAMES]
    raise ValueError(
        f"ParallelConfig.strategy={name!r} is not a known strategy.{closest(key, known)} "
        f"Choose one of {list(STRATEGIES)} or 'auto' (FSDP1 names "
        f"{sorted(_FSDP1_STRATEGY_NAMES)} are accepted too)."
    )
