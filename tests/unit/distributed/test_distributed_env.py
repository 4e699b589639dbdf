"""The launcher's environment as init_distributed reads it (torchrun, SLURM), the timeout
setting, the parent-death race, `shardwise run`/`plan` flag validation and `guard`'s pass-through."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from argparse import Namespace

import pytest

from shardwise import cli
from shardwise.cli.launch import launch_torchrun
from shardwise.distributed import (
    DEFAULT_TIMEOUT_S,
    JobEnv,
    StallError,
    expand_hostlist,
    guard,
    init_distributed,
    shutdown,
)
from shardwise.distributed.process_group import _gpu_index, _read_env, _timeout_from_env
from shardwise.distributed.watchdog import is_comm_failure

SRUN = {
    "SLURM_JOB_ID": "4321",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


def test_srun_task_reads_slurm():
    job = _read_env(SRUN)
    assert job == JobEnv(5, 8, 1, 4, "gpu07", 20000 + 4321 % 10000, "slurm")


def test_srun_uneven_tasks_per_node_and_explicit_master():
    env = {
        **SRUN,
        "SLURM_NTASKS": "7",
        "SLURM_PROCID": "6",
        "SLURM_NODEID": "3",
        "SLURM_LOCALID": "0",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "29555",
    }
    job = _read_env(env)
    assert (job.rank, job.world_size, job.local_world_size) == (6, 7, 1)
    assert (job.master_addr, job.master_port) == ("head", 29555)


def test_srun_step_values_win_and_ntasks_per_node_is_a_fallback():
    env = {**SRUN, "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"}
    del env["SLURM_TASKS_PER_NODE"]
    env["SLURM_NTASKS_PER_NODE"] = "2"
    job = _read_env(env)
    assert (job.rank, job.world_size, job.local_world_size) == (3, 4, 2)


def test_torchrun_variables_win_over_slurm():
    # `srun torchrun ...`: torchrun's numbering is the one the process group uses
    env = {**SRUN, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    job = _read_env(env)
    assert (job.source, job.rank, job.world_size) == ("torchrun", 1, 2)


@pytest.mark.parametrize("step", [None, "batch", "4294967294"])
def test_batch_script_is_not_an_srun_task(step):
    """`python train.py` in the sbatch script itself must not wait for 7 ranks never started."""
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    if step is not None:
        env["SLURM_STEP_ID"] = step
    job = _read_env(env)
    assert (job.source, job.world_size) == ("none", 1)


def test_slurm_rank_out_of_range_names_slurm_procid():
    with pytest.raises(ValueError, match=r"SLURM_PROCID=8 must be in \[0, WORLD_SIZE=8\)"):
        _read_env({**SRUN, "SLURM_PROCID": "8"})


def test_slurm_without_nodelist_asks_for_master_addr():
    env = {k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST is empty.*Set MASTER_ADDR"):
        _read_env(env)


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[9-11],c", ["a1", "b9", "b10", "b11", "c"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("gpu-[001-002].cluster", ["gpu-001.cluster", "gpu-002.cluster"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("node[01-04", "unbalanced brackets"),
        ("node[a-b]", r"\[a-b\] is not a list of numbers"),
        ("node[5-2]", "range 5-2 runs backwards"),
    ],
)
def test_expand_hostlist_rejects_malformed(hostlist, message):
    with pytest.raises(ValueError, match=message):
        expand_hostlist(hostlist)


def test_timeout_setting():
    assert _timeout_from_env({}) == DEFAULT_TIMEOUT_S <= 300
    assert _timeout_from_env({"SHARDWISE_TIMEOUT_S": "42.5"}) == 42.5
    for bad in ("0", "-3", "soon"):
        with pytest.raises(ValueError, match=r"SHARDWISE_TIMEOUT_S=.* must be a positive number"):
            _timeout_from_env({"SHARDWISE_TIMEOUT_S": bad})


def test_init_distributed_reads_the_timeout_setting(monkeypatch):
    shutdown()
    monkeypatch.setenv("SHARDWISE_TIMEOUT_S", "42")
    try:
        assert init_distributed().timeout_s == 42
    finally:
        shutdown()
    assert init_distributed(timeout_s=7).timeout_s == 7  # code wins over the environment
    shutdown()


def test_gpu_index_per_rank():
    assert _gpu_index(3, 8) == 3
    assert _gpu_index(3, 1) == 0  # srun --gpus-per-task=1: each task sees only its own GPU
    with pytest.raises(ValueError, match=r"Local rank 4 has no GPU of its own: .* sees 2 GPU"):
        _gpu_index(4, 2)


_RACE = """
import os, sys
from shardwise.distributed.process_group import _die_with_launcher
_die_with_launcher(os.environ)
print("alive", os.environ.get("SHARDWISE_LAUNCHER_PID"))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("launcher", ["parent", "gone"])
@pytest.mark.heavy
def test_a_worker_whose_launcher_already_died_kills_itself(launcher):
    pid = os.getpid() if launcher == "parent" else 2**22 + 1  # above any pid_max: not our parent
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "x", "SHARDWISE_LAUNCHER_PID": str(pid)}
    out = subprocess.run(
        [sys.executable, "-c", _RACE], env=env, capture_output=True, text=True, timeout=60
    )
    if launcher == "parent":
        assert out.returncode == 0 and out.stdout.strip() == "alive None", out.stderr
    else:
        assert out.returncode == -9 and "alive" not in out.stdout, out.stdout + out.stderr


# --- `shardwise run` / `plan` flags --------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "0"], r"--nnodes='0': use a positive integer N, or MIN:MAX"),
        (["--nnodes", "3:2"], r"--nnodes='3:2': .*1 <= MIN <= MAX"),
        (["--nnodes", "two"], r"--nnodes='two'"),
        (["--max-restarts", "-1"], r"--max-restarts='-1': use a whole number >= 0"),
        (["--node-rank", "-2"], r"--node-rank='-2': use a whole number >= 0"),
        (["--timeout", "0"], r"--timeout='0': use a positive number of seconds"),
        (["--grace", "-1"], r"--grace='-1': use a number of seconds >= 0"),
        (["--grace", "inf"], r"--grace='inf': use a number of seconds >= 0"),
    ],
)
def test_run_rejects_bad_flags(capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["run", *flags, "train.py"])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def _run_args(**kw: object) -> Namespace:
    base = {"nproc": 2, "nnodes": "1", "node_rank": 0, "rdzv_endpoint": None, "max_restarts": 0}
    return Namespace(**{**base, **kw})


def test_elastic_nnodes_pass_through_to_torchrun():
    from torch.distributed.run import get_args_parser

    args = cli.launcher_args(_run_args(nnodes="2:4", rdzv_endpoint="head:29400"))
    assert args[:4] == ["--nproc_per_node", "2", "--nnodes", "2:4"]
    parsed = get_args_parser().parse_args([*args, "train.py"])
    assert (parsed.nnodes, parsed.rdzv_backend, parsed.rdzv_endpoint) == (
        "2:4",
        "c10d",
        "head:29400",
    )
    assert "--standalone" in cli.launcher_args(_run_args(nnodes="1:1"))
    with pytest.raises(ValueError, match=r"--nnodes=1:2 needs --rdzv-endpoint HOST:PORT"):
        cli.launcher_args(_run_args(nnodes="1:2"))
    with pytest.raises(ValueError, match=r"--node-rank=2 must be in \[0, --nnodes=2\)"):
        cli.launcher_args(_run_args(nnodes="2", node_rank=2, rdzv_endpoint="h:1"))


def test_launch_sets_the_environment_for_agent_and_workers(monkeypatch):
    import torch.distributed.run as torchrun

    seen: dict[str, str | None] = {}

    def fake_run(args: object) -> None:
        for key in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "SHARDWISE_TIMEOUT_S"):
            seen[key] = os.environ.get(key)
        seen["pid"] = os.environ.get("SHARDWISE_LAUNCHER_PID")

    monkeypatch.setattr(torchrun, "run", fake_run)
    for key in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "SHARDWISE_TIMEOUT_S"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("SHARDWISE_LAUNCHER_PID", raising=False)
    assert launch_torchrun(["--standalone", "x.py"], timeout_s=90.0) == 0
    assert seen == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "SHARDWISE_TIMEOUT_S": "90.0",
        "pid": str(os.getpid()),
    }
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # the user's choice stays
    launch_torchrun(["--standalone", "x.py"])
    assert seen["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


@pytest.mark.parametrize("world", ["0", "-4"])
def test_plan_rejects_a_non_positive_world(capsys, world):
    assert cli.main(["plan", "shardwise.testing.models:GPT", "--world", world]) == 2
    err = capsys.readouterr().err
    assert f"--world={world}: the world size to plan for must be a positive integer" in err


# --- watchdog.guard when nothing is stuck ----------------------------------------------------


def test_guard_passes_other_errors_through():
    with pytest.raises(ValueError, match="not a comm error"), guard("train step 3"):
        raise ValueError("not a comm error")
    timeout = RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    assert is_comm_failure(timeout) and not is_comm_failure(RuntimeError("shape mismatch"))

    class CheckpointError(RuntimeError):
        pass

    # A library's own error, already reported in its words, is never taken for a stall.
    assert not is_comm_failure(CheckpointError("could not write: gloo timed out"))
    shutdown()  # no process group: nothing to check, the error stays as it was
    with pytest.raises(RuntimeError, match="Timed out") as exc, guard("train step 3"):
        raise timeout
    assert not isinstance(exc.value, StallError)
