"""Testing distributed code on one machine: spawn helpers, reference models, parity.

spawn.py runs a function in N processes on CPU/gloo (`run_distributed`); models.py holds
the small reference models the suite, the demo and the benchmarks train; parity.py is the
check users run on their own model (`shardwise.testing.parity`).
"""

from shardwise.testing.spawn import (
    COUNTED_COLLECTIVES,
    HostSyncs,
    RankError,
    assert_same_distribution,
    count_collectives,
    count_host_syncs,
    free_port,
    run_distributed,
)

__all__ = [
    "COUNTED_COLLECTIVES",
    "HostSyncs",
    "RankError",
    "assert_same_distribution",
    "count_collectives",
    "count_host_syncs",
    "free_port",
    "run_distributed",
]
