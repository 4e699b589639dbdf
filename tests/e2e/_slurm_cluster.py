"""A real SLURM on this host for tests/e2e/test_slurm.py: munged, slurmctld and one slurmd.

`SlurmCluster(tmp).start()` installs `slurm-wlm` and `munge` with apt-get when they are
missing, writes a munge key and a slurm.conf under `tmp` (one node: this host, its CPUs,
ports of its own), starts the three daemons in the foreground as children of their own
sessions, and waits for the node to be idle; `stop()` ends them by their own pids. Clients
(`srun`, `sbatch`, `salloc`, `scontrol`) find the cluster through `env` (SLURM_CONF).

The cluster requeues a job that exits with shardwise's preemption code (`RequeueExit=75`),
and a short credential lifetime (`cred_expire=10`) lets a requeued job start again within
seconds instead of slurmctld's default two minutes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def install() -> str | None:
    """None when SLURM's daemons are here (installed now if need be), else why not."""
    if all(shutil.which(d) for d in DAEMONS) and shutil.which("srun"):
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "SLURM is not installed, and apt-get (as root) is not available to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr[-1000:]}"
    return None


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _config(self) -> str:
        host, r = socket.gethostname(), self.root
        cpus = os.cpu_count() or 1
        return "\n".join(
            [
                "ClusterName=shardwise",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={r}/munge.sock,cred_expire=10",
                f"StateSaveLocation={r}/state",
                f"SlurmdSpoolDir={r}/spool",
                f"SlurmctldPidFile={r}/slurmctld.pid",
                f"SlurmdPidFile={r}/slurmd.pid",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                f"SlurmctldLogFile={r}/slurmctld.log",
                f"SlurmdLogFile={r}/slurmd.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "JobRequeue=1",
                "RequeueExit=75",  # shardwise's PREEMPTED_EXIT_CODE: saved, run me again
                "MinJobAge=600",  # scontrol still shows a finished job
                f"NodeName={host} CPUs={cpus} RealMemory=1000 State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=FORCE:4",
                "",
            ]
        )

    def _daemon(self, *cmd: str) -> None:
        with open(self.root / f"{Path(cmd[0]).name}.out", "wb") as log:  # the child keeps a copy
            self.procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
                )
            )

    def start(self, timeout_s: float = 60) -> SlurmCluster:
        r = self.root
        for d in ("state", "spool"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.conf.write_text(self._config())
        self._daemon("munged", "--foreground", "--force", f"--key-file={key}",
                     f"--socket={r}/munge.sock", f"--pid-file={r}/munged.pid",
                     f"--log-file={r}/munged.log", f"--seed-file={r}/munge.seed")  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not (r / "munge.sock").exists():
            self._check(deadline, "munged's socket")
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        self._daemon("slurmd", "-D", "-f", str(self.conf))
        while "idle" not in self.run("sinfo", "-h", "-o", "%T").stdout:
            self._check(deadline, "the node to be idle")
        return self

    def _check(self, deadline: float, what: str) -> None:
        ended = [p.args for p in self.procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text()[-1500:]}" for p in self.root.glob("*.out")
            )
            self.stop()
            raise RuntimeError(f"SLURM did not start: waiting for {what}; ended: {ended}\n{logs}")
        time.sleep(0.2)

    def run(self, *cmd: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", job_id, "-o").stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.procs.clear()
