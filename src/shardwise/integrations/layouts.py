"""What every host adapter does alike: reading its strategy's arguments into a
`ParallelConfig`, and refusing the layouts a host cannot drive, named for the host.

Owns: `host_config`, `refuse_unbuilt_layouts` and `computes_in_fp16`.
Must not: import a host (each adapter imports this with the host's name).
"""

from __future__ import annotations

from typing import Any

from shardwise.config.parallel import ParallelConfig

__all__ = ["computes_in_fp16", "host_config", "refuse_unbuilt_layouts"]


def computes_in_fp16(config: ParallelConfig) -> bool:
    """Whether `config` computes in float16: its gradients then need a loss scale, which
    shardwise's Engine adds by itself (a ShardedGradScaler) and a host's loop does not."""
    import torch

    return config.precision.param_dtype == torch.float16


def host_config(
    config: ParallelConfig | None, parallel: dict[str, Any], owner: str, host: str
) -> ParallelConfig:
    """`owner(config=...)` or `owner(**ParallelConfig keywords)`, checked for `host`, which
    gives each tensor-parallel group's ranks the same rows through its sampler."""
    if config is not None and parallel:
        raise TypeError(
            f"{owner}: pass either config=ParallelConfig(...) or its keywords "
            f"({', '.join(sorted(parallel))}), not both."
        )
    config = config if config is not None else ParallelConfig(**parallel)
    if not isinstance(config, ParallelConfig):
        raise TypeError(
            f"{owner}(config=...) expects a shardwise.ParallelConfig, got {type(config).__name__}."
        )
    refuse_unbuilt_layouts(config, host, takes_tp=True)
    if computes_in_fp16(config):
        raise ValueError(
            f"{owner}(mixed_precision={config.mixed_precision!r}) computes in float16, whose "
            f"gradients need a loss scale, and {host} scales the loss only under "
            "precision='16-mixed', which it refuses with this kind of strategy: small "
            "gradients would round to zero unseen. Use mixed_precision='bf16' (no scale "
            "needed), or shardwise's Engine and Runner, which scale the loss for fp16."
        )
    return config


def refuse_unbuilt_layouts(config: ParallelConfig, host: str, *, takes_tp: bool = False) -> None:
    """Layouts `host` (e.g. "mmengine's Runner") cannot drive, refused with the reason.
    `takes_tp`: the host's sampler can be given the data-parallel coordinates
    (`wrap_info(model).dp_rank` and `.dp_size`), so tensor parallelism works there."""
    if config.pp != 1:
        raise NotImplementedError(
            f"ParallelConfig.pp={config.pp} inside {host} is not built yet: the host runs "
            "each batch through the model's forward and its own backward, while a pipeline "
            "stage is stepped by its schedule over micro-batches, and every stage of one "
            "pipeline must read the same rows. Use pp=1 here, or train with shardwise's "
            "Engine and Runner."
        )
    if config.tp != 1 and not takes_tp:
        raise NotImplementedError(
            f"ParallelConfig.tp={config.tp} inside {host} is not built: the ranks of a "
            "tensor-parallel group must read the same rows, and the host's samplers "
            "(DefaultSampler, InfiniteSampler) take their rank and world size from the "
            "process group, with no argument to give them the data-parallel ones. Use tp=1 "
            "here, or train with shardwise's Engine and Runner (or Lightning's Trainer or "
            "Fabric with shardwise's strategies)."
        )
    if config.ep != 1:
        raise NotImplementedError(
            f"ParallelConfig.ep={config.ep} inside {host} is not built yet: no test proves "
            "experts spread over ranks equal to the host's own training there. Use ep=1 "
            "here, or train with shardwise's Engine and Runner."
        )
