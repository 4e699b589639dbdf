"""DistributedDataParallel: the `ddp` strategy.

Owns: building torch's DistributedDataParallel from a ParallelConfig (DDP's own keywords
pass through, autocast for mixed precision, a compress hook only when the reduce dtype asks
for one), the parameters it must ignore, and releasing DDP's reducers at shutdown.

Must not: decide the strategy or the device (apply.py does), or hand-write collectives.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.config.parallel import ParallelConfig
from shardwise.distributed.process_group import DistInfo, _register_shutdown_hook
from shardwise.parallelize.autocast import apply_autocast
from shardwise.plan.planner import WrapPlan

_live_ddp: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def _release_ddp_reducers() -> None:
    """Free DDP's Reducer while the default group is still referenced elsewhere.

    Otherwise the Reducer can hold the group's last reference, and its destructor (run
    with the GIL held) joins gloo threads that may be waiting for the GIL: a hang at
    exit (pytorch#56297). The DDP modules are unusable after shutdown anyway.
    """
    for ddp in list(_live_ddp):
        for attr in ("logger", "reducer"):
            if hasattr(ddp, attr):
                setattr(ddp, attr, None)
    _live_ddp.clear()


_register_shutdown_hook(_release_ddp_reducers)


def apply_ddp(
    model: nn.Module, config: ParallelConfig, info: DistInfo, plan: WrapPlan, mesh: Any = None
) -> nn.Module:
    precision = config.precision
    apply_autocast(model, precision, info.device.type)
    if plan.ignored_params:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, plan.ignored_params
        )
    ddp = DistributedDataParallel(
        model,
        device_ids=[info.device.index] if info.device.type == "cuda" else None,
        process_group=None if mesh is None else mesh.get_group(),
        find_unused_parameters=bool(config.find_unused_parameters),
        bucket_cap_mb=config.bucket_cap_mb,
        **_buffer_words(config),
        gradient_as_bucket_view=bool(config.gradient_as_bucket_view),
        static_graph=bool(config.static_graph),
        init_sync=config.sync_module_states,
    )
    reduce_dtype = precision.reduce_dtype
    if reduce_dtype in (torch.bfloat16, torch.float16):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = (
            default_hooks.bf16_compress_hook
            if reduce_dtype == torch.bfloat16
            else default_hooks.fp16_compress_hook
        )
        ddp.register_comm_hook(None, hook)
    _live_ddp.add(ddp)
    return ddp


def ddp_group(ddp: nn.Module) -> torch.distributed.ProcessGroup:
    """The process group a DistributedDataParallel module averages its gradients over."""
    group = ddp.process_group
    assert isinstance(group, torch.distributed.ProcessGroup)
    return group


def _buffer_words(config: ParallelConfig) -> dict[str, Any]:
    """`broadcast_buffers=False` when the user turned it off; nothing otherwise: torch
    deprecates the word (a FutureWarning on every run), and its default, buffers synced
    from rank 0 before each forward, is what True meant."""
    return {"broadcast_buffers": False} if config.broadcast_buffers is False else {}
