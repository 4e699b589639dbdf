"""Process-group lifecycle: `init_distributed`, `shutdown`, and who-am-I queries.

Owns: reading torchrun's environment (the only place in shardwise that does),
choosing the backend and device, and the default process group's timeout.

Must not: build meshes or wrap models.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
_DRAIN_S = 0.1

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None
    device: torch.device
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __str__(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
            f"{self.local_world_size}) backend={self.backend} device={self.device}"
        )


_info: DistInfo | None = None
_shutdown_hooks: list[Callable[[], None]] = []


def _register_shutdown_hook(hook: Callable[[], None]) -> None:
    """Run `hook` in `shutdown()` before the process group is destroyed."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {key}={raw!r} is not an integer. torchrun sets it; "
            "if you set it by hand, use a whole number."
        ) from None


def env_world_size(env: Mapping[str, str] | None = None) -> int:
    """WORLD_SIZE as the launcher set it (1 when absent)."""
    return _env_int(os.environ if env is None else env, "WORLD_SIZE", 1)


def _read_env(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    world = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", rank if world > 1 else 0)
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if world < 1:
        raise ValueError(f"Environment variable WORLD_SIZE={world} must be >= 1.")
    if not 0 <= rank < world:
        raise ValueError(f"Environment variable RANK={rank} must be in [0, WORLD_SIZE={world}).")
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(
                f"WORLD_SIZE={world} but {', '.join(missing)} is not set. Launch with "
                "torchrun (or `shardwise run`), which sets the rendezvous address."
            )
    return rank, world, local_rank, local_world


def init_distributed(
    *,
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> DistInfo:
    """Join the job torchrun started, or make a one-process group when there is none.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT. Picks nccl
    when CUDA is available (device from LOCAL_RANK) and gloo otherwise. Every collective
    on the default group then times out after `timeout_s` instead of hanging.
    Idempotent: a second call returns the first call's result.
    """
    global _info
    if _info is not None and dist.is_initialized():
        return _info
    if timeout_s <= 0:
        raise ValueError(f"init_distributed(timeout_s={timeout_s}) must be > 0 seconds.")
    env = os.environ if env is None else env
    rank, world, local_rank, local_world = _read_env(env)

    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"

    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():  # someone else (user code, a framework) set it up: adopt it
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    elif world == 1 and not env.get("MASTER_ADDR"):
        # Plain `python script.py`: a private one-rank group, so the same code paths run.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    _info = DistInfo(rank, world, local_rank, local_world, backend, dev, timeout_s)
    return _info


def shutdown() -> None:
    """Destroy the default process group (idempotent)."""
    global _info
    if dist.is_available() and dist.is_initialized():
        for hook in _shutdown_hooks:
            hook()
        # Gloo's worker threads need the GIL for a moment to drop the tensors of
        # finished collectives. If the last reference to the group dies later inside a
        # DDP Reducer's destructor (which joins those threads while holding the GIL),
        # a worker still waiting for the GIL deadlocks the exit (pytorch#56297). Let
        # them finish now.
        time.sleep(_DRAIN_S)
        dist.destroy_process_group()
    _info = None


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def get_dist_info() -> DistInfo:
    """This process's place in the job, without initialising anything.

    With no process group: world size 1 on the current default device.
    """
    if _info is not None and dist.is_initialized():
        return _info
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        backend = str(dist.get_backend())
        local_rank = _env_int(os.environ, "LOCAL_RANK", dist.get_rank() if world > 1 else 0)
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return DistInfo(
            dist.get_rank(),
            world,
            local_rank,
            _env_int(os.environ, "LOCAL_WORLD_SIZE", world),
            backend,
            dev,
            DEFAULT_TIMEOUT_S,
        )
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return DistInfo(0, 1, 0, 1, None, dev, DEFAULT_TIMEOUT_S)
