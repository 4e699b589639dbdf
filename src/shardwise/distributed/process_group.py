"""Process-group lifecycle: `init_distributed`, `shutdown`, and who-am-I queries.

Owns: reading the launcher's environment (the only place in shardwise that does):
torchrun's variables, or SLURM's when a task was started by `srun` without torchrun;
choosing the backend and device; the default process group's timeout
(SHARDWISE_TIMEOUT_S, set by `shardwise run --timeout`); and tying a torchrun worker's
life to its launcher (a parent-death signal), so killing the launcher leaves no orphans.

Must not: build meshes or wrap models.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import IO

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout when neither timeout_s nor SHARDWISE_TIMEOUT_S says otherwise."""
TIMEOUT_ENV = "SHARDWISE_TIMEOUT_S"
LAUNCHER_PID_ENV = "SHARDWISE_LAUNCHER_PID"
"""Set by `shardwise run`: the agent's pid, which its workers check they are still children of."""
SLURM_DEFAULT_PORT_BASE = 20000
"""Under srun without MASTER_PORT: port 20000 + SLURM_JOB_ID % 10000, so two jobs that share
a node do not collide."""
_DRAIN_S = 0.1
_PR_SET_PDEATHSIG = 1
# slurmstepd's pseudo step ids of the batch script and the extern step: not an srun task
_SLURM_NON_TASK_STEPS = {"batch", "extern", "4294967294", "4294967291", "4294967295"}


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    """Ranks on this node; None when the launcher did not say (no LOCAL_WORLD_SIZE, as
    under Lightning's launcher, which sets only LOCAL_RANK)."""
    backend: str | None
    device: torch.device
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __str__(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
            f"{self.local_world_size or '?'}) backend={self.backend} device={self.device}"
        )


_info: DistInfo | None = None
_monitor: dist.ProcessGroup | None = None
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


FOREIGN_CONFIG_ENV = "SHARDWISE_FROM"
"""Set by `shardwise run --from FILE` for its workers: the absolute path of another tool's
configuration (DeepSpeed, Accelerate, torchtitan), read by `shardwise.translation_from_env`
and by `shardwise.wrap` when given no config."""


def foreign_config_path(env: Mapping[str, str] | None = None) -> str | None:
    """The file `shardwise run --from` passed its workers (None when it passed none)."""
    return (os.environ if env is None else env).get(FOREIGN_CONFIG_ENV) or None


def env_world_size(env: Mapping[str, str] | None = None) -> int:
    """WORLD_SIZE as the launcher set it (1 when absent)."""
    return _env_int(os.environ if env is None else env, "WORLD_SIZE", 1)


@dataclass(frozen=True)
class JobEnv:
    """What the launcher told this process: torchrun's variables or SLURM's."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None
    source: str
    """'torchrun' (RANK/WORLD_SIZE/...), 'slurm' (an srun task), or 'none' (plain python)."""


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list as names: 'gpu[01-03,07],cpu1' -> gpu01 gpu02 gpu03 gpu07 cpu1.

    Brackets may repeat within a name ('r[1-2]n[1-2]': the product) and keep zero padding.
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(hostlist + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if hostlist[start:i].strip():
                items.append(hostlist[start:i].strip())
            start = i + 1
        if depth not in (0, 1):
            break
    if depth != 0:
        raise ValueError(f"SLURM host list {hostlist!r} has unbalanced brackets.")
    hosts: list[str] = []
    for item in items:
        names = [""]
        for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [literal]
            if group:
                choices = [literal + n for n in _expand_ranges(group, hostlist)]
            names = [n + c for n in names for c in choices]
        hosts.extend(names)
    return hosts


def _expand_ranges(group: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(
                f"SLURM host list {hostlist!r}: [{group}] is not a list of numbers and "
                "ranges like [01-04,07]."
            )
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"SLURM host list {hostlist!r}: range {part} runs backwards.")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _tasks_on_node(spec: str, node: int) -> int | None:
    """SLURM_TASKS_PER_NODE ('2(x3),1') -> the count of node number `node`."""
    nodes: list[int] = []
    for part in spec.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not found:
            return None
        nodes += [int(found.group(1))] * int(found.group(2) or 1)
    return nodes[node] if 0 <= node < len(nodes) else None


def _is_srun_task(env: Mapping[str, str]) -> bool:
    # The batch script itself has SLURM_PROCID=0 and SLURM_NTASKS=N too: a plain `python
    # train.py` there must not wait for N-1 ranks that were never started.
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return bool(env.get("SLURM_PROCID")) and step is not None and step not in _SLURM_NON_TASK_STEPS


def _read_slurm(env: Mapping[str, str]) -> JobEnv:
    world = _env_int(env, "SLURM_STEP_NUM_TASKS", _env_int(env, "SLURM_NTASKS", 1))
    rank = _env_int(env, "SLURM_PROCID", 0)
    local_rank = _env_int(env, "SLURM_LOCALID", 0)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local_world = _tasks_on_node(per_node, _env_int(env, "SLURM_NODEID", 0)) if per_node else None
    if local_world is None:
        local_world = _env_int(env, "SLURM_NTASKS_PER_NODE", world)
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_hostlist(nodelist)
        if world > 1 and not hosts:
            raise ValueError(
                f"SLURM task {rank} of {world}: SLURM_JOB_NODELIST is empty, so the first "
                "node (the rendezvous host) is unknown. Set MASTER_ADDR to it."
            )
        addr = hosts[0] if hosts else "127.0.0.1"
    port = _env_int(env, "MASTER_PORT", 0) or (
        SLURM_DEFAULT_PORT_BASE + _env_int(env, "SLURM_JOB_ID", 0) % 10000
    )
    return JobEnv(rank, world, local_rank, local_world, addr, port, "slurm")


def _read_env(env: Mapping[str, str]) -> JobEnv:
    """The job as the launcher described it: torchrun's variables first, then SLURM's."""
    if "RANK" not in env and "WORLD_SIZE" not in env and _is_srun_task(env):
        job = _read_slurm(env)
        where = "SLURM_PROCID"
    else:
        world = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0)
        job = JobEnv(
            rank,
            world,
            _env_int(env, "LOCAL_RANK", rank if world > 1 else 0),
            _local_world(env, world),
            env.get("MASTER_ADDR") or None,
            _env_int(env, "MASTER_PORT", 0) or None,
            "torchrun" if "RANK" in env or "WORLD_SIZE" in env else "none",
        )
        where = "RANK"
    world, rank = job.world_size, job.rank
    if world < 1:
        raise ValueError(f"Environment variable WORLD_SIZE={world} must be >= 1.")
    if not 0 <= rank < world:
        raise ValueError(f"Environment variable {where}={rank} must be in [0, WORLD_SIZE={world}).")
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if job.source == "torchrun" and missing:
            raise ValueError(
                f"WORLD_SIZE={world} but {', '.join(missing)} is not set. Launch with "
                "torchrun (or `shardwise run`), which sets the rendezvous address."
            )
    return job


def _local_world(env: Mapping[str, str], world: int) -> int | None:
    """LOCAL_WORLD_SIZE, or None when a multi-rank launcher did not set it: guessing the
    whole world would put hybrid_shard's shard groups across nodes."""
    if "LOCAL_WORLD_SIZE" in env or world == 1:
        return _env_int(env, "LOCAL_WORLD_SIZE", 1)
    return None


def default_backend(device_type: str) -> str:
    """The backend `init_distributed` asks for: gloo on CPU; for a CUDA job torch's own
    default pair, gloo for CPU tensors and nccl for CUDA ones. A nccl-only group refuses
    CPU tensors ("No backend type associated with device type cpu"), which CPU offload,
    exports and small host-side agreements use."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def serves_cpu(backend: str | None) -> bool:
    """Whether a group with this backend runs collectives on CPU tensors: not a nccl-only
    group, nor a per-device list without a 'cpu:' entry (torch's default 'undefined'
    pairs gloo with nccl)."""
    name = str(backend)
    if ":" in name:
        return any(part.split(":")[0].strip() == "cpu" for part in name.split(","))
    return name != "nccl"


def device_for_group(
    backend: str | None,
    env: Mapping[str, str],
    cuda_devices: int,
    current: int,
    bound: torch.device | None = None,
) -> torch.device:
    """The device of a rank whose group someone else made: CUDA when the group serves CUDA
    tensors (nccl, a 'cuda:nccl' pair, or torch's default 'undefined' on a CUDA machine),
    at the GPU the group is bound to (`bound`: init_process_group's device_id, as Lightning
    and Fabric pass their root device, which under devices=[1, 3] is not LOCAL_RANK's),
    else at LOCAL_RANK when that names a visible GPU, else the current device."""
    name = str(backend)
    cuda = "nccl" in name or (name in ("undefined", "None", "") and cuda_devices > 0)
    if not cuda or cuda_devices == 0:
        return torch.device("cpu")
    if bound is not None and bound.type == "cuda":
        return bound
    local_rank = _env_int(env, "LOCAL_RANK", -1)
    return torch.device("cuda", local_rank if 0 <= local_rank < cuda_devices else current)


def _bound_device() -> torch.device | None:
    """The device the default group was bound to at init (device_id), if any."""
    return getattr(dist.group.WORLD, "bound_device_id", None)


def _timeout_from_env(env: Mapping[str, str]) -> float:
    raw = env.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):  # timedelta(seconds=inf) is an OverflowError
        raise ValueError(
            f"Environment variable {TIMEOUT_ENV}={raw!r} must be a positive number of seconds "
            f"(the collective timeout; default {DEFAULT_TIMEOUT_S:g})."
        )
    return value


def _gpu_index(
    local_rank: int, visible: int, local_world: int | None = None, per_task: bool = False
) -> int:
    """This rank's GPU: its local rank, or the only one it can see when each task is given
    its own (srun --gpus-per-task=1: `per_task`). Several ranks of a node that all see the
    same single GPU are refused: NCCL stops at init with "Duplicate GPU detected"."""
    if visible == 1 and (per_task or not local_world or local_world == 1):
        return 0
    if visible == 1:
        raise ValueError(
            f"{local_world} processes run on this node but it has 1 GPU visible, and NCCL "
            "cannot put two ranks on one GPU (it stops with 'Duplicate GPU detected'). Start "
            "one process per GPU (--nproc 1 here), or run on CPU with the GPUs hidden "
            "(CUDA_VISIBLE_DEVICES='')."
        )
    if not 0 <= local_rank < visible:
        raise ValueError(
            f"Local rank {local_rank} has no GPU of its own: this process sees {visible} "
            "GPU(s). Start at most one process per visible GPU (--nproc, or srun "
            "--ntasks-per-node equal to --gpus-per-node), or pass init_distributed(device=...)."
        )
    return local_rank


def _die_with_launcher(env: Mapping[str, str]) -> None:
    """Have Linux SIGKILL this torchrun worker when its launcher (the agent) dies.

    torchrun starts each worker in a session of its own, so a scheduler or OOM killer
    that SIGKILLs the launcher's process group does not reach the workers; a worker
    stuck in a collective then lives on. The signal fires when the thread that started
    us exits: torch's agent starts workers from its main thread.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in env:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    # The launcher may have died before prctl took effect: then we were re-parented.
    expected = _env_int(env, LAUNCHER_PID_ENV, 0)
    if env is os.environ:  # our own children (a nested torchrun) have another parent
        os.environ.pop(LAUNCHER_PID_ENV, None)
    parent = os.getppid()
    if parent == 1 or (expected and parent != expected):
        os.kill(os.getpid(), signal.SIGKILL)


def init_distributed(
    *,
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> DistInfo:
    """Join the job torchrun (or srun) started, or make a one-process group when there is none.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; without them,
    in a task started by srun, SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
    SLURM_TASKS_PER_NODE and the first host of SLURM_JOB_NODELIST (port: MASTER_PORT, or
    20000 + SLURM_JOB_ID % 10000). Picks torch's gloo+nccl pair when CUDA is available
    (`default_backend`; the device from the local rank) and gloo otherwise. Every
    collective on the default group then times out after `timeout_s` (default:
    SHARDWISE_TIMEOUT_S, else 300 s) instead of hanging; wrap a step in
    `shardwise.distributed.guard` to have the timeout name the stuck rank.
    Idempotent: a second call returns the first call's result.
    """
    global _info
    if _info is not None and dist.is_initialized():
        return _info
    env = os.environ if env is None else env
    if timeout_s is None:
        timeout_s = _timeout_from_env(env)
    if not 0 < timeout_s < float("inf"):
        raise ValueError(
            f"init_distributed(timeout_s={timeout_s}) must be > 0 seconds, and finite."
        )
    job = _read_env(env)
    _die_with_launcher(env)
    rank, world, local_rank, local_world = (
        job.rank,
        job.world_size,
        job.local_rank,
        job.local_world_size,
    )

    adopted = dist.is_initialized()  # someone else (user code, a framework) set it up
    if device is None and adopted:
        # The device of the group made elsewhere: the GPU it is bound to (Lightning's and
        # Fabric's root device), not necessarily LOCAL_RANK's.
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        current = torch.cuda.current_device() if count else 0
        device = device_for_group(dist.get_backend(), env, count, current, _bound_device())
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            per_task = job.source == "slurm"  # srun binds a GPU per task; torchrun does not
            index = _gpu_index(local_rank, torch.cuda.device_count(), local_world, per_task)
            dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
    if backend is None:
        backend = default_backend(dev.type)

    timeout = timedelta(seconds=timeout_s)
    if adopted:
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    elif world == 1 and not env.get("MASTER_ADDR"):
        # Plain `python script.py`: a private one-rank group, so the same code paths run.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        # torchrun's env:// also honours its agent-store settings; srun tasks give tcp://.
        host = f"[{job.master_addr}]" if ":" in str(job.master_addr) else job.master_addr
        dist.init_process_group(
            backend,
            init_method="env://" if job.source != "slurm" else f"tcp://{host}:{job.master_port}",
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    _make_monitor_group(timeout_s, backend)
    _info = DistInfo(rank, world, local_rank, local_world, backend, dev, timeout_s)
    _shutdown_at_exit()
    return _info


_exit_hook_registered = False


def _shutdown_at_exit() -> None:
    """Destroy the group when Python exits, whatever the path (a normal end, an uncaught
    error, a StallError, sys.exit(75) after preemption, KeyboardInterrupt). Left to
    interpreter teardown, gloo's threads could drop the last reference to a tensor while
    Python shuts down: 'terminate called without an active exception' and SIGABRT, about 1
    in 10 jobs ending in an error at world 2 (torch 2.13, CPU). A shutdown() the script
    already called makes this a no-op."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(shutdown)
        _exit_hook_registered = True


def _make_monitor_group(timeout_s: float, backend: str) -> None:
    """The small gloo group the stall watchdog checks ranks on (distributed/watchdog.py):
    separate from the default group, so it works after a collective there failed. Every
    rank makes it in init_distributed (a collective). Only for gloo jobs: on nccl, torch's
    own watchdog aborts a timed-out collective before any exception reaches `guard`, and a
    gloo mesh across nodes needs a routable interface (GLOO_SOCKET_IFNAME) for nothing."""
    global _monitor
    if wants_monitor(str(backend), dist.get_world_size()):
        _monitor = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def wants_monitor(backend: str, world: int) -> bool:
    """Whether init_distributed makes the watchdog's gloo group: multi-rank gloo jobs only."""
    return world > 1 and "nccl" not in backend


def monitor_group() -> dist.ProcessGroup | None:
    """The watchdog's gloo group, or None when init_distributed did not make the group."""
    return _monitor


def shutdown() -> None:
    """Destroy the default process group (idempotent)."""
    global _info, _monitor
    if dist.is_available() and dist.is_initialized():
        for hook in _shutdown_hooks:
            hook()
        # Gloo's worker threads need the GIL for a moment to drop the tensors of
        # finished collectives. If the last reference to the group dies later inside a
        # DDP Reducer's destructor (which joins those threads while holding the GIL),
        # a worker still waiting for the GIL deadlocks the exit (pytorch#56297). Let
        # them finish now. (A simulation's fake group has no threads to wait for.)
        if dist.get_backend() != "fake":
            time.sleep(_DRAIN_S)
        dist.destroy_process_group()  # every group, the monitor group included
    _info = None
    _monitor = None


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
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        current = torch.cuda.current_device() if count else 0
        dev = device_for_group(backend, os.environ, count, current, _bound_device())
        return DistInfo(
            dist.get_rank(),
            world,
            local_rank,
            _local_world(os.environ, world),
            backend,
            dev,
            DEFAULT_TIMEOUT_S,
        )
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return DistInfo(0, 1, 0, 1, None, dev, DEFAULT_TIMEOUT_S)


def mean_across_ranks(value: float | torch.Tensor) -> float:
    """The mean of a scalar over every rank (a collective: every rank calls it), e.g. a
    loss each rank computed on its own slice of the batch. The value itself where there
    is no process group."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    t = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else None
    if world == 1:
        return float(t) if t is not None else float(value)
    device = torch.device("cpu") if serves_cpu(dist.get_backend()) else get_dist_info().device
    t = (t if t is not None else torch.tensor(float(value))).to(device)
    dist.all_reduce(t)  # SUM (gloo has no AVG)
    return float(t) / world


def print0(
    *values: object,
    sep: str | None = " ",
    end: str | None = "\n",
    file: IO[str] | None = None,
    flush: bool = True,
) -> None:
    """`print` on rank 0 only (flushed unless flush=False), so a loop's lines appear once,
    not once per rank."""
    if rank_and_world()[0] == 0:
        print(*values, sep=sep, end=end, file=file, flush=flush)
