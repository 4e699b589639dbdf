"""The running job: the process group, its device mesh, and the stall watchdog.

process_group.py reads the launcher's environment (the only place that does) and owns
init/shutdown; mesh.py turns a strategy and the world into the named DeviceMesh;
watchdog.py names the rank a timed-out collective waited for; worker_errors.py reports a
worker's uncaught error to `shardwise run` (installed here, in its workers only).
"""

from shardwise.distributed.mesh import (
    REPLICATE_DIM,
    SHARD_DIM,
    MeshSpec,
    divisors,
    from_user_mesh,
    resolve_mesh,
    strategy_reshards,
)
from shardwise.distributed.process_group import (
    DEFAULT_TIMEOUT_S,
    LAUNCHER_PID_ENV,
    SLURM_DEFAULT_PORT_BASE,
    TIMEOUT_ENV,
    DistInfo,
    JobEnv,
    env_world_size,
    expand_hostlist,
    get_dist_info,
    init_distributed,
    mean_across_ranks,
    monitor_group,
    print0,
    rank_and_world,
    shutdown,
)
from shardwise.distributed.watchdog import MAX_CHECK_S, PeerExitedError, StallError, guard
from shardwise.distributed.worker_errors import install_if_launched

install_if_launched()  # a no-op outside a worker of `shardwise run`

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LAUNCHER_PID_ENV",
    "MAX_CHECK_S",
    "REPLICATE_DIM",
    "SHARD_DIM",
    "SLURM_DEFAULT_PORT_BASE",
    "TIMEOUT_ENV",
    "DistInfo",
    "JobEnv",
    "MeshSpec",
    "PeerExitedError",
    "StallError",
    "divisors",
    "env_world_size",
    "expand_hostlist",
    "from_user_mesh",
    "get_dist_info",
    "guard",
    "init_distributed",
    "mean_across_ranks",
    "monitor_group",
    "print0",
    "rank_and_world",
    "resolve_mesh",
    "shutdown",
    "strategy_reshards",
]
