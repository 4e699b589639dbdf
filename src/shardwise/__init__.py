"""shardwise: one config value takes a PyTorch model from one process to DDP, ZeRO-2,
FSDP2 or HSDP — with parity to single-process training as the check.

    info = shardwise.init_distributed()
    model = shardwise.wrap(MyModel(), shardwise.ParallelConfig(strategy="full_shard"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # after wrap
"""

from shardwise.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardwise.config import STRATEGIES, ParallelConfig
from shardwise.distributed import DistInfo, get_dist_info, init_distributed, shutdown
from shardwise.engine import Engine, TrainConfig, parse_losses
from shardwise.materialize import InitializationError, init_empty
from shardwise.mesh import MeshSpec, resolve_mesh
from shardwise.precision import PRESETS, Precision
from shardwise.runner import Runner, RunnerConfig, seed_everything
from shardwise.strategies import WrapInfo, sync_module_states, unwrap, wrap, wrap_info
from shardwise.weights import WeightsError, export_weights, load_weights
from shardwise.wrap import PlanNotice, WrapPlan, WrapUnit, plan_wrap, register_wrap_policy

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "STRATEGIES",
    "CheckpointError",
    "DistInfo",
    "Engine",
    "InitializationError",
    "MeshSpec",
    "ParallelConfig",
    "PlanNotice",
    "Precision",
    "Runner",
    "RunnerConfig",
    "TrainConfig",
    "WeightsError",
    "WrapInfo",
    "WrapPlan",
    "WrapUnit",
    "__version__",
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
    "shutdown",
    "sync_module_states",
    "unwrap",
    "wrap",
    "wrap_info",
]
