"""shardwise: one config value takes a PyTorch model from one process to DDP, ZeRO-2,
FSDP2 or HSDP — with parity to single-process training as the check.

    info = shardwise.init_distributed()
    model = shardwise.wrap(MyModel(), shardwise.ParallelConfig(strategy="full_shard"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # after wrap
"""

from shardwise.autoplan import AutoPlan, NoPlanFitsError, choose_plan
from shardwise.checkpoint import (
    CheckpointError,
    PendingCheckpoint,
    load_checkpoint,
    save_checkpoint,
    set_aside_newer,
    wait_for_checkpoint,
)
from shardwise.config import STRATEGIES, ParallelConfig
from shardwise.distributed import DistInfo, get_dist_info, init_distributed, shutdown
from shardwise.engine import Engine, NonFiniteError, TrainConfig, parse_losses
from shardwise.materialize import InitializationError, init_empty
from shardwise.mesh import MeshSpec, resolve_mesh
from shardwise.precision import PRESETS, Precision
from shardwise.runner import PREEMPTED_EXIT_CODE, Preempted, Runner, RunnerConfig, seed_everything
from shardwise.simulate import SimReport, simulate_step
from shardwise.strategies import WrapInfo, sync_module_states, unwrap, wrap, wrap_info
from shardwise.watchdog import StallError
from shardwise.weights import WeightsError, export_weights, load_weights
from shardwise.wrap import PlanNotice, WrapPlan, WrapUnit, plan_wrap, register_wrap_policy

__version__ = "0.1.0"

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PRESETS",
    "STRATEGIES",
    "AutoPlan",
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
    "StallError",
    "TrainConfig",
    "WeightsError",
    "WrapInfo",
    "WrapPlan",
    "WrapUnit",
    "__version__",
    "choose_plan",
    "export_weights",
    "get_dist_info",
    "init_distributed",
    "init_empty",
    "load_checkpoint",
    "load_weights",
    "parse_losses",
    "plan_wrap",
    "register_wrap_policy",
    "resolve_mesh",
    "save_checkpoint",
    "seed_everything",
    "set_aside_newer",
    "shutdown",
    "simulate_step",
    "sync_module_states",
    "unwrap",
    "wait_for_checkpoint",
    "wrap",
    "wrap_info",
]
