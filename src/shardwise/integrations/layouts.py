"""What a host (mmengine's Runner, Lightning's Trainer) cannot drive yet, refused the same way
for both.

Owns: `refuse_unbuilt_layouts`, the one refusal of pp, tp and ep inside a host, named for it.
Must not: import a host (each adapter imports this with the host's name).
"""

from __future__ import annotations

from shardwise.config.parallel import ParallelConfig

__all__ = ["refuse_unbuilt_layouts"]


def refuse_unbuilt_layouts(config: ParallelConfig, host: str) -> None:
    """Layouts `host` (e.g. "mmengine's Runner") cannot drive yet, refused with the reason."""
    if config.pp != 1:
        raise NotImplementedError(
            f"ParallelConfig.pp={config.pp} inside {host} is not built yet: the host runs "
            "each batch through the model's forward and its own backward, while a pipeline "
            "stage is stepped by its schedule over micro-batches, and every stage of one "
            "pipeline must read the same rows. Use pp=1 here, or train with shardwise's "
            "Engine and Runner."
        )
    if config.tp != 1:
        raise NotImplementedError(
            f"ParallelConfig.tp={config.tp} inside {host} is not built yet: the host's "
            "sampler splits the data over every rank, while the ranks of a tensor-parallel "
            "group must read the same rows (shardwise's Runner does that). Use tp=1 here, or "
            "train with shardwise's Engine and Runner."
        )
    if config.ep != 1:
        raise NotImplementedError(
            f"ParallelConfig.ep={config.ep} inside {host} is not built yet: no test proves "
            "experts spread over ranks equal to the host's own training there. Use ep=1 "
            "here, or train with shardwise's Engine and Runner."
        )
