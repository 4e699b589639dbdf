"""The expert-parallel field of ParallelConfig: `ep`, and the checks that need neither a
model nor a world size.

Owns: `validate_ep` (called by ParallelConfig's validation): ep's type and range, and the
combinations not built yet, refused before any process group exists.
Must not: import torch's distributed modules (config stays light), or check anything that
needs the model (parallelize/experts.py does) or the world size (distributed/mesh.py does).
"""

from __future__ import annotations

from typing import Any

from shardwise.config.vocabulary import integral

__all__ = ["validate_ep"]


def validate_ep(cfg: Any) -> None:
    """A ParallelConfig's ep, as far as it can be checked without a model or a world size
    (`cfg` is not typed as ParallelConfig here, which imports this module)."""
    cfg.ep = integral(cfg.ep, "ParallelConfig.ep")
    if cfg.ep < 1:
        raise ValueError(f"ParallelConfig.ep={cfg.ep} must be >= 1 (1: no expert parallelism).")
    if cfg.ep == 1:
        return
    if cfg.strategy in ("ddp", "no_shard"):
        raise ValueError(
            f"ParallelConfig.ep={cfg.ep} with strategy={cfg.strategy!r}: ep spreads the experts "
            "over the ranks of a shard group, and this strategy shards over none. Use "
            "strategy='full_shard' (or 'shard_grad_op', 'hybrid_shard')."
        )
    unbuilt = {
        "strategy or tp 'auto'": cfg.strategy == "auto" or cfg.tp == "auto",
        "cpu_offload": cfg.cpu_offload not in (None, False),
        "sequence_parallel": cfg.sequence_parallel,
    }
    for what, present in unbuilt.items():
        if present:
            raise NotImplementedError(
                f"ParallelConfig.ep={cfg.ep} with {what} is not built yet: no test proves "
                f"the combination equal to one process. Use ep=1 with {what}, or leave it out."
            )
