"""shardwise: one config value takes a PyTorch model from one process to DDP, ZeRO-2,
FSDP2 or HSDP — with parity to single-process training as the check.

    info = shardwise.init_distributed()
    model = shardwise.wrap(MyModel(), shardwise.ParallelConfig(strategy="full_shard"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # after wrap
"""

from shardwise import _compat
from shardwise.checkpoint import (
    CheckpointError,
    PendingCheckpoint,
    export_weights,
    load_checkpoint,
    save_checkpoint,
    set_aside_newer,
    wait_for_checkpoint,
)
from shardwise.config import (
    PRESETS,
    STRATEGIES,
    ParallelConfig,
    Precision,
    RunnerConfig,
    TrainConfig,
    translate_accelerate,
    translate_deepspeed,
    translate_torchtitan,
)
from shardwise.distributed import (
    DistInfo,
    MeshSpec,
    StallError,
    get_dist_info,
    guard,
    init_distributed,
    mean_across_ranks,
    print0,
    resolve_mesh,
    shutdown,
)
from shardwise.memory import AutoPlan, NoPlanFitsError, SimReport, choose_plan, simulate_step
from shardwise.parallelize import (
    BatchStatisticNotice,
    InitializationError,
    WeightsError,
    WrapInfo,
    global_batch_sum,
    init_empty,
    load_weights,
    pipeline_eval,
    pipeline_step,
    sync_module_states,
    unwrap,
    wrap,
    wrap_info,
)
from shardwise.plan import (
    PlanNotice,
    StagePlan,
    WrapPlan,
    WrapUnit,
    plan_stages,
    plan_wrap,
    register_wrap_policy,
)
from shardwise.train import (
    PREEMPTED_EXIT_CODE,
    Engine,
    NonFiniteError,
    Preempted,
    Runner,
    clip_grad_norm_,
    parse_losses,
    seed_everything,
)

_compat.install()  # old module paths (shardwise.strategies, shardwise.models, ...) forward

__version__ = "0.1.0"

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PRESETS",
    "STRATEGIES",
    "AutoPlan",
    "BatchStatisticNotice",
    "CheckpointError",
    "DistInfo",
    "Engine",
    "InitializationError",
    "MeshSpec",
    "NoPlanFitsError",
    "NonFiniteError",
    "ParallelConfig",
    "PendingCheckpoint",
    "PlanNotice",
    "Precision",
    "Preempted",
    "Runner",
    "RunnerConfig",
    "SimReport",
    "StagePlan",
    "StallError",
    "TrainConfig",
    "WeightsError",
    "WrapInfo",
    "WrapPlan",
    "WrapUnit",
    "__version__",
    "choose_plan",
    "clip_grad_norm_",
    "export_weights",
    "get_dist_info",
    "global_batch_sum",
    "guard",
    "init_distributed",
    "init_empty",
    "load_checkpoint",
    "load_weights",
    "mean_across_ranks",
    "parse_losses",
    "pipeline_eval",
    "pipeline_step",
    "plan_stages",
    "plan_wrap",
    "print0",
    "register_wrap_policy",
    "resolve_mesh",
    "save_checkpoint",
    "seed_everything",
    "set_aside_newer",
    "shutdown",
    "simulate_step",
    "sync_module_states",
    "translate_accelerate",
    "translate_deepspeed",
    "translate_torchtitan",
    "unwrap",
    "wait_for_checkpoint",
    "wrap",
    "wrap_info",
]
