"""Unit tests run in one process: no launcher environment, no process group left over."""

import pytest

from shardwise import shutdown

TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    shutdown()
    yield
    shutdown()
