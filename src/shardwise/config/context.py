"""The context-parallel fields of ParallelConfig: `cp`, `cp_style`, `cp_load_balance`, and
the checks that need neither a model nor a world size.

Owns: `CPStyle` and `validate_cp` (called by ParallelConfig's validation): the fields' types
and values, and the combinations not built yet, refused before any process group exists.
Must not: import torch's distributed modules (config stays light), or check anything that
needs the model (parallelize/context.py and ulysses.py do) or the world size
(distributed/mesh.py does).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from shardwise.config.vocabulary import integral

__all__ = ["CP_STYLES", "CPStyle", "validate_cp"]

CPStyle = Literal["auto", "ulysses", "ring"]
"""How attention reads the whole sequence under cp: 'ulysses' (an all-to-all gives each
rank every position of 1/cp of the heads), 'ring' (key/value chunks pass round the ranks;
not built yet), or 'auto' (Ulysses, the one built)."""
CP_STYLES: tuple[str, ...] = get_args(CPStyle)


def validate_cp(cfg: Any) -> None:
    """A ParallelConfig's cp fields, as far as they can be checked without a model or a
    world size (`cfg` is not typed as ParallelConfig here, which imports this module)."""
    cfg.cp = integral(cfg.cp, "ParallelConfig.cp")
    if cfg.cp < 1:
        raise ValueError(f"ParallelConfig.cp={cfg.cp} must be >= 1 (1: no context parallelism).")
    if cfg.cp_style not in CP_STYLES:
        raise ValueError(
            f"ParallelConfig.cp_style={cfg.cp_style!r} is not valid. Choose one of "
            f"{list(CP_STYLES)}."
        )
    balance = cfg.cp_load_balance
    if balance is not None and not isinstance(balance, bool):
        raise ValueError(
            f"ParallelConfig.cp_load_balance={balance!r} is not valid. Use True, False or None "
            "(on for causal ring attention)."
        )
    if cfg.cp == 1:
        return
    if cfg.cp_style == "ring":
        raise NotImplementedError(
            f"ParallelConfig.cp_style='ring' (cp={cfg.cp}) is not built yet: torch's ring "
            "context_parallel has no CPU attention path in torch 2.13, so no test here proves "
            "it equal to one process. Use cp_style='ulysses' (or 'auto'), which needs the "
            "attention heads to divide by cp."
        )
    if balance:
        raise ValueError(
            f"ParallelConfig.cp_load_balance=True with cp_style={cfg.cp_style!r}: Ulysses "
            "gives every rank all positions of its heads, so there is nothing to balance; "
            "the setting is ring attention's (not built yet). Leave cp_load_balance=None."
        )
    if cfg.strategy == "ddp":
        raise ValueError(
            f"ParallelConfig.cp={cfg.cp} with strategy='ddp': the cp ranks share parameters "
            "through fully_shard's mesh. Use strategy='no_shard' (it replicates as DDP does) "
            "or a sharded strategy."
        )
    unbuilt = {
        "tp 'auto'": cfg.tp == "auto",
        "sequence_parallel": cfg.sequence_parallel,
        "loss_parallel": cfg.loss_parallel,
        "strategy='auto'": cfg.strategy == "auto",
        "a device_mesh of your own": cfg.device_mesh is not None,
        "compile": cfg.compile not in (False, None),
    }
    for what, present in unbuilt.items():
        if present:
            raise NotImplementedError(
                f"ParallelConfig.cp={cfg.cp} with {what} is not built yet: no test proves the "
                f"combination equal to one process. Use cp over the data-parallel strategies "
                f"(full_shard, shard_grad_op, hybrid_shard, no_shard) and tp, or cp=1."
            )
