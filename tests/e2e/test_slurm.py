"""Under a real SLURM (munged, slurmctld and slurmd started on this host by the suite):
the three launch forms, and a job preempted with SIGUSR1, requeued and resumed.

- `srun -n 2 python examples/port/train.py`: one task per rank, init_distributed reading
  SLURM's variables, equal to the plain one-process script;
- `shardwise run` inside `salloc`, and `sbatch` of a script that runs `shardwise run` once
  per node: equal to it too;
- `sbatch` of `srun python _resumable_worker.py`, sent `scancel --signal=USR1` after a few
  steps: every rank saves and exits 75, the cluster requeues the job (`RequeueExit=75`),
  and the requeued job resumes and ends with the parameters of an uninterrupted job, bit
  for bit. Also with the signal sent to the batch shell alone (`scancel --batch`, as
  `#SBATCH --signal=B:USR1@60`), in a script that ran `exec srun ... shardwise run`.

`make test-slurm` (and .ci/run); installs slurm-wlm and munge with apt-get if missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _slurm_cluster import SlurmCluster, install

from shardwise.testing.parity import Trajectory, compare_trajectories

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
PORT = ROOT / "examples" / "port"
WORKER = Path(__file__).with_name("_resumable_worker.py")
PY = sys.executable


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    why = install()
    if why is not None:
        pytest.skip(why)
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield slurm
    slurm.stop()


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def _trajectory(stdout: str, out: Path) -> Trajectory:
    return Trajectory(_losses(stdout), _weights(out))


def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"^loss (\S+)$", text, re.MULTILINE)]


@pytest.fixture(scope="module")
def plain(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Trajectory:
    out = tmp_path_factory.mktemp("plain") / "out"
    done = cluster.run(PY, str(PORT / "train_plain.py"), str(out), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _trajectory(done.stdout, out)


def _equal_to_plain(stdout: str, out: Path, plain: Trajectory) -> None:
    assert len(_losses(stdout)) == 4, stdout[-2000:]
    compare_trajectories(plain, _trajectory(stdout, out), rtol=1e-5)


def test_srun_tasks_train_equal_to_one_process(cluster, plain, tmp_path):  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    done = cluster.run("srun", "-n", "2", PY, str(PORT / "train.py"), str(out), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _equal_to_plain(done.stdout, out, plain)


def test_shardwise_run_inside_salloc(cluster, plain, tmp_path):  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    cmd = ["salloc", "-n", "2", PY, "-m", "shardwise.cli", "run", "--nproc", "2",
           str(PORT / "train.py"), str(out)]  # fmt: skip
    done = cluster.run(*cmd, timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _equal_to_plain(done.stdout, out, plain)


def _sbatch(cluster: SlurmCluster, tmp: Path, body: str, *options: str) -> str:
    script = tmp / "job.sbatch"
    script.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in options) + body)
    done = cluster.run("sbatch", "--parsable", f"--output={tmp}/slurm-%j.out",
                       "--open-mode=append", str(script))  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _wait_state(cluster: SlurmCluster, job: str, states: set[str], timeout_s: float) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while True:
        info = cluster.job(job)
        if info.get("JobState") in states:
            return info
        assert time.monotonic() < deadline, f"job {job} not in {states}: {info}"
        time.sleep(0.5)


def test_sbatch_runs_shardwise_run_once_per_node(cluster, plain, tmp_path):  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    body = (
        f"srun --ntasks-per-node=1 {PY} -m shardwise.cli run --nproc 2 {PORT / 'train.py'} {out}\n"
    )
    job = _sbatch(cluster, tmp_path, body, "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2")
    info = _wait_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    _equal_to_plain(log, out, plain)


def _steps_done(run: Path) -> int:
    try:
        return sum(",train," in line for line in (run / "metrics.csv").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _finished(cluster: SlurmCluster, tmp: Path, job: str) -> tuple[dict, str]:  # type: ignore[type-arg]
    info = _wait_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}, 400)
    log = (tmp / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    return info, log


@pytest.fixture(scope="module")
def uninterrupted(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job = _sbatch(cluster, tmp, f"srun {PY} {WORKER} {tmp / 'run'}\n", "--ntasks=2", "--requeue")
    info, _ = _finished(cluster, tmp, job)
    assert int(info["Restarts"]) == 0
    return tmp / "run"


# How the signal reaches the workers:
# - "tasks": `scancel --signal=USR1` (as `#SBATCH --signal=USR1@60`) signals every process
#   of the job's steps: the srun tasks are the ranks themselves;
# - "batch": `scancel --batch --signal=USR1` (as `#SBATCH --signal=B:USR1@60`) signals only
#   the batch shell. With `exec srun`, that shell is srun, which forwards USR1 to its tasks,
#   here `shardwise run` launchers; each one forwards it to its workers.
# Each form: the batch script, its #SBATCH options and scancel's arguments.
PREEMPTED = {
    "tasks": ("srun {py} {worker} {run}\n", ["--ntasks=2"], ["--signal=USR1"]),
    "batch": (
        "exec srun --ntasks-per-node=1 {py} -m shardwise.cli run --nproc 2 {worker} {run}\n",
        ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2"],
        ["--batch", "--signal=USR1"],
    ),
}


@pytest.mark.parametrize("form", PREEMPTED)
def test_a_job_preempted_with_usr1_is_requeued_and_resumes_exactly(  # type: ignore[no-untyped-def]
    cluster, uninterrupted, tmp_path, form
):
    body, options, scancel = PREEMPTED[form]
    run = tmp_path / "run"
    job = _sbatch(
        cluster, tmp_path, body.format(py=PY, worker=WORKER, run=run), "--requeue", *options
    )
    deadline = time.monotonic() + 240
    while _steps_done(run) < 4:
        assert time.monotonic() < deadline, cluster.job(job)
        time.sleep(0.2)
    signalled = cluster.run("scancel", *scancel, job)
    assert signalled.returncode == 0, signalled.stderr
    info, log = _finished(cluster, tmp_path, job)
    print(f"preempted job ({form}): Restarts={info['Restarts']}")
    assert int(info["Restarts"]) == 1, log[-3000:]  # requeued once, by RequeueExit=75
    assert re.search(r"SIGUSR1: stopped after optimizer step \d+ and saved", log), log[-3000:]
    assert "resumed from step" in log
    ours, ref = _weights(run / "export"), _weights(uninterrupted / "export")
    assert all(torch.equal(ours[k], ref[k]) for k in ref)  # bit for bit: the same world


def test_the_documented_sbatch_job_runs_as_written(cluster, tmp_path):  # type: ignore[no-untyped-def]
    # docs/examples.md's command, from a directory laid out as the repository root.
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / ".venv").symlink_to(Path(PY).parents[1])
    done = subprocess.run(
        ["sbatch", "examples/slurm/train_cpu.sbatch"],
        env=cluster.env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = done.stdout.split("Submitted batch job")[1].split()[0]
    info = _wait_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
    log = (tmp_path / f"shardwise-cpu-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "done: step 20" in log, log[-3000:]
    assert (tmp_path / "runs" / "slurm-cpu" / "export" / "model.safetensors").is_file()
