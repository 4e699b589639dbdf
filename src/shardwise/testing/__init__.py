"""Testing distributed code on one machine: spawn helpers, reference models, parity.

spawn.py runs a function in N processes on CPU/gloo (`run_distributed`); models.py holds
the small reference models the suite, the demo and the benchmarks train; parity.py is the
check users run on their own model (`shardwise.testing.parity`); syncs.py counts the calls
that would make the host wait for a GPU (`count_host_syncs`).
"""

from shardwise.testing.spawn import (
    COUNTED_COLLECTIVES,
    RankError,
    assert_same_distribution,
    count_collectives,
    free_port,
    run_distributed,
)
from shardwise.testing.syncs import HostSyncs, count_host_syncs

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
