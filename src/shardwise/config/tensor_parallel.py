"""The tensor-parallel fields of ParallelConfig: the plan type, the plan words, and the
checks that need neither a model nor a world size.

Owns: `TPPlan`, `TP_STYLE_NAMES` and `validate_tp` (called by ParallelConfig's validation).
Must not: import torch's tensor-parallel styles at module level (config stays light), or
check anything that needs the model (parallelize/tensor.py does, at wrap time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from shardwise.config.vocabulary import integral

__all__ = ["TP_STYLE_NAMES", "TPPlan", "validate_tp"]

TPPlan = Literal["auto"] | Mapping[str, object] | Callable[..., object]
"""`tp_plan`: 'auto' (the model's own), {module name or pattern: 'colwise' | 'rowwise' |
a torch ParallelStyle}, or a callable (model, tp_mesh) that parallelises the model."""
TP_STYLE_NAMES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
    "moe_tp_experts",
    "packed_colwise",
)
"""The plan words shardwise turns into torch's ParallelStyles (transformers' words)."""


def validate_tp(cfg: Any) -> None:
    """A ParallelConfig's tp, tp_plan, loss_parallel and sequence_parallel, as far as
    they can be checked without a model or a world size (`cfg` is not typed as
    ParallelConfig here, which imports this module)."""
    if cfg.tp == "auto":
        if cfg.strategy != "auto":
            raise ValueError(
                f"ParallelConfig(tp='auto', strategy={cfg.strategy!r}): the planner chooses "
                "tp together with the strategy. Set strategy='auto' too, or give tp a number."
            )
    else:
        cfg.tp = integral(cfg.tp, "ParallelConfig.tp")
        if cfg.tp < 1:
            raise ValueError(
                f"ParallelConfig.tp={cfg.tp} must be >= 1 (1: no tensor parallelism), or 'auto'."
            )
    plan = cfg.tp_plan
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(
                f"ParallelConfig.tp_plan={plan!r}: use 'auto' (the model's own plan), a dict "
                "{module pattern: 'colwise' | 'rowwise' | ParallelStyle}, or a callable "
                "(model, tp_mesh)."
            )
    elif isinstance(plan, Mapping):
        from torch.distributed.tensor.parallel import ParallelStyle

        for key, style in plan.items():
            if not isinstance(style, ParallelStyle) and style not in TP_STYLE_NAMES:
                raise ValueError(
                    f"ParallelConfig.tp_plan[{key!r}]={style!r}: use one of "
                    f"{', '.join(TP_STYLE_NAMES)} or a torch ParallelStyle."
                )
    elif not callable(plan):
        raise TypeError(
            f"ParallelConfig.tp_plan={plan!r}: use 'auto', a dict or a callable (model, tp_mesh)."
        )
    if cfg.loss_parallel and cfg.tp == 1:
        raise ValueError(
            "ParallelConfig.loss_parallel=True needs tp > 1: it splits the output head's "
            "logits over the tensor-parallel ranks. Set tp, or leave loss_parallel off."
        )
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ValueError(
            "ParallelConfig.sequence_parallel=True needs tp > 1: it splits the sequence "
            "over the tensor-parallel ranks. Set tp, or leave sequence_parallel off."
        )
    if cfg.sequence_parallel and callable(plan) and not isinstance(plan, Mapping):
        raise ValueError(
            "ParallelConfig.sequence_parallel=True with a callable tp_plan: shardwise adds "
            "its sequence-parallel styles to a plan it reads ('auto' or a dict), not to what "
            "a callable applies. Apply your own SequenceParallel styles in the callable and "
            "leave sequence_parallel off, or give the plan as a dict."
        )
    if cfg.tp != 1:
        if cfg.strategy == "ddp":
            raise ValueError(
                f"ParallelConfig.tp={cfg.tp} with strategy='ddp': DistributedDataParallel "
                "cannot hold tensor-parallel (DTensor) parameters. Use strategy='no_shard' "
                "(it replicates as DDP does, over the data-parallel ranks) or a sharded "
                "strategy."
            )
        if cfg.device_mesh is not None:
            raise ValueError(
                f"ParallelConfig.tp={cfg.tp} with a device_mesh: shardwise builds the "
                "(replicate, shard, tp) mesh itself. Leave device_mesh=None."
            )
