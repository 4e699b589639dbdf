"""`shardwise run` when things go wrong: restarts, a killed launcher, a stalled rank, two nodes.

Each test starts the launcher the way a user does (a subprocess, in its own session so a
timeout kills everything) and writes its small worker script into tmp_path.

No assertion here depends on how fast the machine is: an order between ranks that a test
needs is made by the ranks themselves (one waits for the other's exit), and a limit on a
run's time only ends a run that hangs, far above what a loaded machine takes (a stalled
rank sleeps 600 s; the collective timeout a regression would wait for is 300 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _proc import ROOT, run_in_session

from shardwise.testing import free_port

pytestmark = pytest.mark.launcher  # `make test-launcher` (and .ci/run), not `make test`

SHARDWISE = [sys.executable, "-m", "shardwise.cli"]


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(
        "import os, sys, time\nfrom pathlib import Path\nimport torch\n"
        "import torch.distributed as dist\nimport shardwise\n"
        "OUT = Path(sys.argv[1])\n" + textwrap.dedent(body)
    )
    return path


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen[str]:
    with open(log, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd, cwd=ROOT, text=True, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_for(paths: list[Path], timeout_s: float, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() and p.read_text() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{paths} not written (launcher exit {proc.poll()})")
        time.sleep(0.05)


def _kill_session(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# A restarted rank 1 that comes up late: with torch's shared agent store, rank 0 reads the
# dead rank 1's Gloo address, still in the store from the first attempt, and fails with
# "connectFullMesh failed ... Connection refused". `shardwise run` switches the sharing off.
RESTART_LATE_PEER = """
import json
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if restart == 1 and os.environ["RANK"] == "1":
    time.sleep(3)  # the second attempt's rank 1 joins late, so rank 0 looks first
info = shardwise.init_distributed()
t = torch.ones(1)
dist.all_reduce(t)
if restart == 0 and info.rank == 1:
    os.kill(os.getpid(), 9)
dist.barrier()
(OUT / f"rank{info.rank}").write_text(json.dumps([restart, t.item()]))
shardwise.shutdown()
"""


@pytest.mark.parametrize(
    "share",
    ["default", pytest.param("0", marks=pytest.mark.slow)],  # "0": torch's own default
    ids=["shardwise", "torch-shared-store"],
)
def test_restart_reinitialises_when_a_peer_comes_up_late(tmp_path, share):
    """Fails before the fix: the restart dies in init_process_group (stale Gloo address)."""
    script = _script(tmp_path, RESTART_LATE_PEER)
    env = {} if share == "default" else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share}
    cmd = [*SHARDWISE, "run", "--nproc", "2", "--max-restarts", "1", str(script), str(tmp_path)]
    proc = _start(cmd, tmp_path / "log", **env)
    try:
        rc = proc.wait(timeout=240)
    finally:
        _kill_session(proc)
    log = (tmp_path / "log").read_text()
    if share == "0":  # torch's default, kept when set explicitly: shows the failure is real
        assert rc != 0 and "connectFullMesh" in log, log[-3000:]
        return
    assert rc == 0, log[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}").read_text()) == [1, 2.0]


def test_workers_die_when_the_launcher_is_killed(tmp_path):
    script = _script(
        tmp_path,
        """
        info = shardwise.init_distributed()
        (OUT / f"pid{info.rank}").write_text(str(os.getpid()))
        while True:
            time.sleep(0.2)
        """,
    )
    cmd = [*SHARDWISE, "run", "--nproc", "2", str(script), str(tmp_path)]
    proc = _start(cmd, tmp_path / "log")
    pids: list[int] = []
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 240, proc)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, as an OOM killer would
        proc.wait()
        deadline = time.monotonic() + 60  # ends as soon as they are gone
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), f"workers {pids} outlived their launcher"
    finally:
        _kill_pids(pids)
        _kill_session(proc)


@pytest.mark.slow  # the Runner's version below runs in the default suite
def test_a_stalled_rank_is_named_and_the_job_ends(tmp_path):
    script = _script(
        tmp_path,
        """
        from shardwise.distributed import guard
        info = shardwise.init_distributed()
        (OUT / f"pid{info.rank}").write_text(str(os.getpid()))
        for step in range(3):
            with guard(f"train step {step}"):
                if info.rank == 1 and step == 1:
                    time.sleep(600)
                dist.all_reduce(torch.ones(1))
        """,
    )
    out = run_in_session(  # the stalled rank sleeps 600 s: the job must end well before
        [*SHARDWISE, "run", "--nproc", "2", "--timeout", "3", str(script), str(tmp_path)],
        timeout_s=240,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "StallError: rank 0: train step 1 stalled: rank(s) 1 did not arrive" in out.stderr
    assert "shardwise run --timeout SECONDS" in out.stderr
    assert "  rank 1: stopped because rank 0 ended" in out.stderr
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert not any(_alive(p) for p in pids)


RUNNER_STALL = """
from torch import nn
from torch.utils.data import TensorDataset

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 3:  # rank 1 stalls in its third step
            time.sleep(600)
        return nn.functional.mse_loss(self.b(self.a(x).relu()), y)

info = shardwise.init_distributed()
(OUT / f"pid{info.rank}").write_text(str(os.getpid()))
engine = shardwise.Engine(Net(), lambda p: torch.optim.SGD(p, lr=0.1),
                          shardwise.ParallelConfig(strategy=sys.argv[2]))
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
# stop_on_sigterm=False: the stalled rank then dies at torchrun's SIGTERM instead of waiting
# for its step to end (torchrun's SIGKILL follows 30 s later): a shorter test.
cfg = shardwise.RunnerConfig(max_steps=6, batch_size=4, run_dir=str(OUT / "run"), progress=False,
                             stop_on_sigterm=False)
shardwise.Runner(engine, data, config=cfg).fit()
"""


@pytest.mark.parametrize("strategy", ["full_shard", pytest.param("ddp", marks=pytest.mark.slow)])
def test_a_rank_stalled_inside_a_runner_step_is_named(tmp_path, strategy):
    script = _script(tmp_path, RUNNER_STALL)
    out = run_in_session(  # the stalled rank sleeps 600 s: the job must end well before
        [*SHARDWISE, "run", "--nproc", "2", "--timeout", "3", str(script), str(tmp_path),
         strategy],
        timeout_s=240,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "train step 3 stalled: rank(s) 1 did not arrive" in out.stderr, out.stderr[-3000:]
    # Rank 1 was still in its step when the grace ran out: the launcher stopped it.
    assert "  rank 1: stopped because rank 0 ended" in out.stderr, out.stderr[-3000:]
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert not any(_alive(p) for p in pids)


TWO_NODES = """
info = shardwise.init_distributed()
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
(OUT / f"rank{info.rank}").write_text(f"{info.world_size} {t.item()} {os.getpid()}")
if len(sys.argv) > 2:  # keep training until a node goes away
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)
shardwise.shutdown()
"""


def _two_nodes(tmp_path: Path, nnodes: str, *extra: str) -> list[subprocess.Popen[str]]:
    script = _script(tmp_path, TWO_NODES)
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nproc", "1", "--nnodes", nnodes, "--rdzv-endpoint", endpoint, "--timeout", "20"]
    return [
        _start(
            [
                *SHARDWISE,
                "run",
                *flags,
                "--node-rank",
                str(node),
                str(script),
                str(tmp_path),
                *extra,
            ],
            tmp_path / f"node{node}.log",
        )
        for node in (0, 1)
    ]


def test_two_nodes_on_one_machine(tmp_path):
    """Two launchers with --nnodes MIN:MAX (elastic syntax) form one world of 2."""
    nodes = _two_nodes(tmp_path, "2:2")
    try:
        codes = [p.wait(timeout=240) for p in nodes]
    finally:
        _kill_session(*nodes)
    logs = [(tmp_path / f"node{n}.log").read_text()[-2000:] for n in (0, 1)]
    assert codes == [0, 0], logs
    for rank in (0, 1):
        world, total, _ = (tmp_path / f"rank{rank}").read_text().split()
        assert (world, total) == ("2", "3.0")


@pytest.mark.slow
def test_killing_one_node_ends_the_other(tmp_path):
    """Node 1's launcher is SIGKILLed: its worker dies with it (parent-death signal), node 0's
    worker sees its next all_reduce fail (connection closed) and node 0's launcher exits 1."""
    nodes = _two_nodes(tmp_path, "2", "loop")
    pids: list[int] = []
    try:
        _wait_for([tmp_path / "rank0", tmp_path / "rank1"], 90, nodes[0])
        seen = [(tmp_path / f"rank{r}").read_text().split() for r in (0, 1)]
        assert [s[:2] for s in seen] == [["2", "3.0"], ["2", "3.0"]]
        pids = [int(s[2]) for s in seen]
        os.kill(nodes[1].pid, signal.SIGKILL)
        rc = nodes[0].wait(timeout=240)  # ends a hang only; a loaded machine takes seconds
        assert rc == 1, (tmp_path / "node0.log").read_text()[-3000:]
        assert not any(_alive(p) for p in pids)
    finally:
        _kill_pids(pids)
        _kill_session(*nodes)


def test_srun_style_tasks_form_a_job(tmp_path):
    """Two tasks with only SLURM's variables (as `srun --ntasks 2` sets them) join one group."""
    script = _script(
        tmp_path,
        """
        info = shardwise.init_distributed()
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        (OUT / f"rank{info.rank}").write_text(f"{info.world_size} {info.local_rank} {t.item()}")
        shardwise.shutdown()
        """,
    )
    slurm = {
        "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        assert key not in os.environ
    tasks = [
        _start(
            [sys.executable, str(script), str(tmp_path)],
            tmp_path / f"task{r}.log",
            **slurm,
            SLURM_PROCID=str(r),
            SLURM_LOCALID=str(r),
        )
        for r in (0, 1)
    ]
    try:
        codes = [t.wait(timeout=240) for t in tasks]
    finally:
        _kill_session(*tasks)
    assert codes == [0, 0], [(tmp_path / f"task{r}.log").read_text()[-2000:] for r in (0, 1)]
    for r in (0, 1):
        assert (tmp_path / f"rank{r}").read_text() == f"2 {r} 3.0"


@pytest.mark.slow
def test_soak_restart_trial_resumes_bitwise():
    """One trial of bench/soak.py: rank 1 SIGKILLed at a random step, the job resumes from
    its last checkpoint and ends bitwise equal to an uninterrupted run (~40 s)."""
    out = run_in_session(
        [sys.executable, "bench/soak.py", "--kind", "restart", "--trials", "1"], timeout_s=300
    )
    assert out.returncode == 0 and "1 of 1 restart" in out.stdout, out.stdout + out.stderr


def test_an_error_raised_in_every_rank_is_printed_once(tmp_path):
    """A config typo raises in both ranks: its message once, then the ranks that raised it.
    (A typo in an override is refused by the launcher before anything starts; one in the
    file's `train` section is the workers' to find.)"""
    config = tmp_path / "typo.yaml"
    config.write_text("train:\n  max_stepz: 2\n")
    cmd = [*SHARDWISE, "run", "--nproc", "2", "examples/train_lm.py", "--config", str(config)]
    out = run_in_session(cmd, timeout_s=240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.count("unknown key 'train.max_stepz'") == 1, out.stderr
    assert "Traceback" not in out.stderr  # the user's input, not our code
    assert "shardwise run: 2 rank(s) failed:\n  ranks 0, 1: ConfigError (shown above)" in out.stderr


LATE_ERROR = """
from shardwise.config import ConfigError
if os.environ["RANK"] == "1":
    # Rank 1 reaches the same error only once rank 0 has ended and the launcher has seen it
    # end (reaped it, so its /proc entry is gone): a rank on a machine too busy to run both.
    pid0 = OUT / "pid0"
    while not pid0.exists() or Path(f"/proc/{pid0.read_text()}").exists():
        time.sleep(0.01)
else:
    (OUT / "pid0").write_text(str(os.getpid()))
raise ConfigError("unknown key 'train.max_stepz'. Valid keys in train: [...]")
"""


def test_an_error_a_rank_reaches_after_another_ended_is_still_every_ranks(tmp_path):
    """Before the grace: rank 1 was stopped as soon as the launcher saw rank 0 end, and the
    report read 'rank 0: ConfigError' and 'rank 1: stopped by the launcher'."""
    script = _script(tmp_path, LATE_ERROR)
    out = run_in_session([*SHARDWISE, "run", "--nproc", "2", str(script), str(tmp_path)], 240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.count("unknown key 'train.max_stepz'") == 1, out.stderr
    assert out.stderr.endswith(
        "shardwise run: 2 rank(s) failed:\n  ranks 0, 1: ConfigError (shown above)\n"
    ), out.stderr[-3000:]


def _transcript(page: str, command: str) -> list[str]:
    """The output a docs page's console block shows for `$ command`."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    start = lines.index(f"$ {command}") + 1
    return lines[start : lines.index("```", start)]


def test_a_layout_refused_in_every_rank_is_one_line_and_the_summary():
    """Before: rank 0's 13-line traceback ending in a ValueError from distributed/mesh.py.
    Now the refusal once, and the summary: what docs/troubleshooting.md shows."""
    cmd = [*SHARDWISE, "run", "--nproc", "2", "examples/train_lm.py", "parallel.dp_shard=3"]
    out = run_in_session(cmd, timeout_s=240)
    assert out.returncode == 1, out.stderr[-3000:]
    shown = _transcript("troubleshooting.md", "shardwise " + " ".join(cmd[len(SHARDWISE) :]))
    assert shown[0].startswith("[rank0]: ValueError: ParallelConfig.dp_shard=3 with strategy=")
    assert out.stderr.splitlines() == shown, out.stderr[-3000:]


EP_REFUSED = """
from shardwise.testing.models import TinyMoE
shardwise.init_distributed()
shardwise.Engine(TinyMoE(), lambda p: torch.optim.SGD(p, lr=0.1), shardwise.ParallelConfig(ep=3))
"""


def test_a_refusal_raised_by_shardwise_without_a_mark_is_one_line(tmp_path):
    """Before: 15 lines of `[rank0]: Traceback` above the message (experts.py raises a plain
    ValueError, not marked with `refused`). Every error a `raise` of shardwise's own code
    raises is the message alone."""
    script = _script(tmp_path, EP_REFUSED)
    out = run_in_session([*SHARDWISE, "run", "--nproc", "3", str(script), str(tmp_path)], 240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        "[rank0]: ValueError: ParallelConfig.ep=3 does not divide blocks.0.experts.num_experts=4: "
        "every rank of an ep group holds the same number of whole experts. Choose ep in "
        "[1, 2, 4].",
        "shardwise run: 3 rank(s) failed:",
        "  ranks 0, 1, 2: ValueError (shown above)",
    ], out.stderr[-3000:]


def test_a_refused_layout_is_not_restarted():
    """Before: refused again on each of --max-restarts' attempts (and, after an elastic world
    change, a restart must not train something else). Every rank refused its setting: the
    launcher leaves its restarts unused, once, and says so."""
    cmd = [*SHARDWISE, "run", "--nproc", "2", "--max-restarts", "2", "examples/train_lm.py",
           "parallel.dp_shard=3"]  # fmt: skip
    out = run_in_session(cmd, timeout_s=240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.count("ValueError: ParallelConfig.dp_shard=3") == 1, out.stderr[-3000:]
    assert "restarting the workers" not in out.stderr
    assert out.stderr.rstrip().endswith(
        "shardwise run: not restarted: every rank refused its setting, and a restart would "
        "refuse it again."
    ), out.stderr[-3000:]


KILLED_PEER = """
import signal
from shardwise.distributed import PeerExitedError
info = shardwise.init_distributed()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
survivor = sys.argv[2]  # "collective": rank 0 goes on to its next step; "asleep": it cannot
for step in range(6):
    try:
        with shardwise.guard(f"step {step}"):
            dist.all_reduce(torch.ones(1))
    except PeerExitedError:
        (OUT / "lost_peer").write_text(str(info.rank))
        raise
    if step == 2 and restart == 0:
        if info.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        elif survivor == "asleep":
            time.sleep(600)  # reaches no collective: only the launcher ends it
    time.sleep(0.1)
shardwise.print0(f"finished after restart {restart}")
shardwise.shutdown()
"""
DEAD_PEER_REPORT = (
    "shardwise run: 2 rank(s) failed:\n"
    "  rank 1: was killed by signal 9 (SIGKILL)\n"
    "  rank 0: stopped because rank 1 ended\n"
)


@pytest.mark.parametrize("survivor", ["collective", "asleep"])
def test_a_dead_peer_reads_the_same_whether_the_survivor_noticed_or_was_stopped(tmp_path, survivor):
    """'collective': rank 0's next all_reduce fails within the grace and it raises its own
    PeerExitedError (what a quiet machine showed). 'asleep', with --grace 0: the launcher
    stops it (what a busy machine showed). Both end in the same report, and it is all the
    user reads: no PeerExitedError above it, no torch line per stopped rank.

    Before that: the survivor waited for a 'stall' (the 300 s collective timeout, above this
    run's limit) and advised raising the timeout."""
    script = _script(tmp_path, KILLED_PEER)
    grace = ["--grace", "0"] if survivor == "asleep" else []
    cmd = [*SHARDWISE, "run", "--nproc", "2", *grace, str(script), str(tmp_path), survivor]
    out = run_in_session(cmd, 240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.endswith(DEAD_PEER_REPORT), out.stderr[-3000:]
    assert "PeerExitedError" not in out.stderr and "closing signal" not in out.stderr
    assert "stalled" not in out.stderr and "raise the timeout" not in out.stderr
    # The two runs took the two paths (rank 0 raises within ms of rank 1's death; the
    # grace is 10 s).
    assert (tmp_path / "lost_peer").exists() == (survivor == "collective")


def test_a_restart_says_its_attempt_after_the_same_report(tmp_path):
    script = _script(tmp_path, KILLED_PEER)
    cmd = [*SHARDWISE, "run", "--nproc", "2", "--max-restarts", "1", str(script), str(tmp_path),
           "collective"]  # fmt: skip
    out = run_in_session(cmd, 240)
    assert out.returncode == 0, out.stderr[-3000:]
    restart = "shardwise run: restarting the workers: restart 1 of 1 (0 left)"
    assert DEAD_PEER_REPORT + restart in out.stderr, out.stderr[-3000:]
    assert "finished after restart 1" in out.stdout


# A stop signal that reaches a worker and not the launcher (a scheduler signalling every
# process of a node, or another node's preemption that the Runner spreads to every rank).
PREEMPTED_WORKER = """
import signal
from shardwise import Engine, ParallelConfig, Runner, RunnerConfig
shardwise.init_distributed()
first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
    def forward(self, x):
        if engine.step == 2 and os.environ["RANK"] == "1" and first_attempt:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.lin(x).pow(2).mean()
torch.manual_seed(0)
engine = Engine(Net(), lambda p: torch.optim.SGD(p, lr=0.1), ParallelConfig(strategy="ddp"))
config = RunnerConfig(run_dir=str(OUT / "run"), batch_size=2, max_steps=6, max_epochs=None,
                      save_every=100, progress=False, resume="latest")
Runner(engine, torch.utils.data.TensorDataset(torch.randn(64, 4)), config=config).fit()
# A file, not stdout: on a busy machine the ranks' prints interleave there, piece by piece
# ("finished at stepfinished at step 6").
(OUT / f"finished{os.environ['RANK']}").write_text(str(engine.step))
"""


@pytest.mark.parametrize(("restarts", "code"), [("0", 75), ("1", 0)])
def test_workers_stopped_by_a_signal_the_launcher_missed(tmp_path, restarts, code):
    """Every rank saves at one step and exits 75. That is no failure: with no restart left
    the launcher exits 75 too (what a scheduler requeues on; it was 1), and with one the
    workers resume from that step."""
    script = _script(tmp_path, PREEMPTED_WORKER)
    cmd = [*SHARDWISE, "run", "--nproc", "2", "--max-restarts", restarts, str(script),
           str(tmp_path)]  # fmt: skip
    out = run_in_session(cmd, 240)
    assert out.returncode == code, out.stderr[-3000:]
    report = (
        "shardwise run: 2 rank(s) stopped and saved:\n"
        "  ranks 0, 1: exited with code 75: stopped on a stop signal, after saving a checkpoint\n"
    )
    assert report in out.stderr, out.stderr[-3000:]
    assert "stopped after optimizer step 3 and saved" in out.stderr
    if code:
        assert out.stderr.endswith(
            report + "shardwise run: exiting with 75, as the workers did (no restart left "
            "here): start again with resume='latest'.\n"
        ), out.stderr[-3000:]
        assert not list(tmp_path.glob("finished*"))
    else:
        assert report + "shardwise run: restarting the workers: restart 1 of 1" in out.stderr
        assert "restart 1: resumed from step 3" in out.stderr, out.stderr[-3000:]
        assert [(tmp_path / f"finished{r}").read_text() for r in (0, 1)] == ["6", "6"]


# Ctrl-C: the worker holds step 4 until the Runner has been asked to stop ("once": then it
# finishes the step and saves; "twice": it never does, so only a second SIGINT ends it).
CTRL_C_WORKER = """
from shardwise import Engine, ParallelConfig, Runner, RunnerConfig
shardwise.init_distributed()
twice, rank = sys.argv[2] == "twice", os.environ.get("RANK", "0")
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
    def forward(self, x):
        if engine.step == 3:
            (OUT / f"in_step_4_{rank}").write_text("1")
            while twice or not engine._stop_requested:
                if engine._stop_requested:
                    (OUT / f"asked{rank}").write_text("1")
                time.sleep(0.02)
        return self.lin(x).pow(2).mean()
torch.manual_seed(0)
engine = Engine(Net(), lambda p: torch.optim.SGD(p, lr=0.1), ParallelConfig(strategy="ddp"))
config = RunnerConfig(run_dir=str(OUT / "run"), batch_size=2, max_steps=50, max_epochs=None,
                      save_every=2, progress=False)
Runner(engine, torch.utils.data.TensorDataset(torch.randn(256, 4)), config=config).fit()
(OUT / f"finished{rank}").write_text(str(engine.step))
"""
NO_RUNNER_WORKER = """
shardwise.init_distributed()
(OUT / f"in_step_4_{os.environ['RANK']}").write_text("1")
time.sleep(600)
"""


def _ctrl_c(
    tmp_path: Path, cmd: list[str], ranks: int, times: int
) -> subprocess.CompletedProcess[str]:
    """`cmd` in a session of its own, sent SIGINT as a terminal's Ctrl-C sends it (to the
    foreground process group: the launcher, or the plain python process), `times` times."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, text=True, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        _wait_for([tmp_path / f"in_step_4_{r}" for r in range(ranks)], 200, proc)
        os.killpg(proc.pid, signal.SIGINT)
        if times == 2:
            _wait_for([tmp_path / f"asked{r}" for r in range(ranks)], 200, proc)
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=200)
    finally:
        _kill_session(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("launcher", ["shardwise_run", "python"])
@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_saves_after_the_step_and_twice_stops_at_once(tmp_path, launcher, times):
    """Before: ~40 lines of KeyboardInterrupt traceback per rank, `shardwise run: stopped by
    signal 2`, exit 130, nothing saved. Now the first Ctrl-C is SIGTERM's request (the step
    ends, a checkpoint, exit 75) and the second stops at once (exit 130), each in one line
    from rank 0."""
    script = _script(tmp_path, CTRL_C_WORKER)
    args = [str(script), str(tmp_path), "twice" if times == 2 else "once"]
    ranks = 2 if launcher == "shardwise_run" else 1
    cmd = [*SHARDWISE, "run", "--nproc", "2", *args] if ranks == 2 else [sys.executable, *args]
    out = _ctrl_c(tmp_path, cmd, ranks, times)
    checkpoints = tmp_path / "run" / "checkpoints"
    if times == 1:
        assert (out.returncode, out.stderr) == (
            75,
            f"shardwise: SIGINT: stopped after optimizer step 4 and saved "
            f"{checkpoints / 'step_00000004'}; exiting with code 75. Start the job again "
            "with RunnerConfig.resume='latest' to continue from it.\n",
        )
    else:
        assert (out.returncode, out.stderr) == (
            130,
            "shardwise: SIGINT again: stopped at once after optimizer step 3, without saving; "
            f"the last good checkpoint is {checkpoints / 'step_00000002'} (resume='latest' "
            "continues from it).\n",
        )
    assert not list(tmp_path.glob("finished*"))


def test_ctrl_c_without_a_runner_is_one_line(tmp_path):
    script = _script(tmp_path, NO_RUNNER_WORKER)
    cmd = [*SHARDWISE, "run", "--nproc", "2", str(script), str(tmp_path)]
    out = _ctrl_c(tmp_path, cmd, 2, 1)
    assert (out.returncode, out.stderr) == (
        130,
        "shardwise run: stopped by SIGINT (Ctrl-C); no Runner saved a checkpoint\n",
    )


EXIT_PATHS = """
import atexit
def _after_shardwise():  # registered first, so it runs after shardwise's own exit hook
    print("group alive at exit:", dist.is_initialized(), flush=True)
atexit.register(_after_shardwise)
shardwise.init_distributed()
kind = sys.argv[2]
if kind == "error":
    raise RuntimeError("boom")
if kind == "interrupt":
    raise KeyboardInterrupt
if kind == "preempted":
    sys.exit(shardwise.PREEMPTED_EXIT_CODE)
"""


@pytest.mark.parametrize(
    ("kind", "code"), [("end", 0), ("error", 1), ("interrupt", -signal.SIGINT), ("preempted", 75)]
)
def test_every_exit_path_destroys_the_process_group(tmp_path, kind, code):
    """Before: an error path left with a live group, and gloo's threads aborted some exits."""
    script = _script(tmp_path, EXIT_PATHS)
    out = run_in_session([sys.executable, str(script), str(tmp_path), kind], 240)
    assert out.returncode == code, out.stderr[-2000:]
    assert "group alive at exit: False" in out.stdout, out.stdout + out.stderr[-2000:]


ERRORING_JOB = """
shardwise.init_distributed()
model = shardwise.wrap(torch.nn.Linear(64, 64), shardwise.ParallelConfig(strategy="full_shard"))
model(torch.randn(4, 64)).sum().backward()
raise RuntimeError("boom")
"""


@pytest.mark.slow  # about 100 s; the exit-path test above checks the cause in every run
def test_twenty_erroring_jobs_never_abort(tmp_path):
    """Measured before the fix: 1 of 10 such jobs aborted ('terminate called without an
    active exception', SIGABRT) as Python tore down a live gloo group."""
    script = _script(tmp_path, ERRORING_JOB)
    aborted = []
    for i in range(20):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(script), str(tmp_path)]  # fmt: skip
        out = run_in_session(cmd, 60)
        assert out.returncode == 1, out.stderr[-2000:]
        text = out.stdout + out.stderr
        if "terminate called" in text or "SIGABRT" in text or "Signal 6" in text:
            aborted.append(i)
    assert not aborted, f"jobs {aborted} aborted at exit"


SAVE_STALL = """
import torch.distributed.checkpoint as dcp
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
info = shardwise.init_distributed()
engine = shardwise.Engine(GPT(GPTConfig()), lambda p: torch.optim.AdamW(p, lr=1e-3),
                          shardwise.ParallelConfig(strategy="full_shard"))
engine.train_step(random_lm_batches(GPTConfig(), 1, 4, seed=0)[0])
phase = sys.argv[2]
if phase == "load_checkpoint":
    shardwise.save_checkpoint(OUT / "ck", engine)
if info.rank == 1 and phase == "async":  # its background write never ends
    from torch.distributed.checkpoint import FileSystemWriter
    FileSystemWriter.write_data = lambda *a, **k: time.sleep(600)
elif info.rank == 1 and phase == "export_weights":  # stops after the first gathers
    import shardwise.checkpoint.export as export
    export.DTensor.full_tensor = lambda self: time.sleep(600)
elif info.rank == 1:  # rank 1 stops inside DCP's call (a hung filesystem, a stopped process)
    setattr(dcp, phase.removesuffix("_checkpoint"), lambda *a, **k: time.sleep(600))
if phase == "save_checkpoint":
    shardwise.save_checkpoint(OUT / "ck", engine)
elif phase == "async":
    shardwise.save_checkpoint(OUT / "ck", engine, async_=True)
    shardwise.wait_for_checkpoint()
elif phase == "load_checkpoint":
    shardwise.load_checkpoint(OUT / "ck", engine, verify=False)
else:
    shardwise.export_weights(engine.model, OUT / "export")
"""


@pytest.mark.parametrize(
    "phase",
    [
        "save_checkpoint",
        "load_checkpoint",
        # The same guard on two more phases: about 16 s each, so in the slow tier.
        pytest.param("export_weights", marks=pytest.mark.slow),
        pytest.param("async", marks=pytest.mark.slow),
    ],
)
def test_a_rank_stalled_inside_a_checkpoint_is_named_with_the_phase(tmp_path, phase):
    """Before: 'RuntimeError: Application timeout caused pair closure', naming no rank."""
    script = _script(tmp_path, SAVE_STALL)
    cmd = [*SHARDWISE, "run", "--nproc", "2", "--timeout", "5", str(script), str(tmp_path), phase]
    out = run_in_session(cmd, timeout_s=240)  # rank 1 sleeps 600 s: the job ends before
    assert out.returncode == 1, out.stderr[-3000:]
    named = "finishing an asynchronous checkpoint save" if phase == "async" else phase
    said = f"StallError: rank 0: {named} stalled: rank(s) 1 did not arrive"
    assert said in out.stderr, out.stderr[-3000:]


# Kubeflow Trainer's torch runtime starts the launcher with torchrun's PET_* variables and
# no flags. Each rank writes the world, its local rank, whether something listens on
# PET_MASTER_PORT (the rendezvous store) and an all_reduce of rank + 1.
PET_WORKER = """
import socket
info = shardwise.init_distributed()
try:
    socket.create_connection(("127.0.0.1", int(os.environ["PET_MASTER_PORT"])), 5).close()
    listening = 1
except OSError:
    listening = 0
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
(OUT / f"rank{info.rank}").write_text(f"{info.world_size} {info.local_rank} {listening} {t.item()}")
shardwise.shutdown()
"""


def _pet(nnodes: int, node_rank: int, port: int) -> dict[str, str]:
    return {
        "PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
    }  # fmt: skip


def test_kubeflow_variables_start_their_ranks_on_their_port(tmp_path):
    """Issue 53: PET_NPROC_PER_NODE=3 started 2 ranks, and nothing listened on
    PET_MASTER_PORT. Now: 3 ranks in one world, the store on that port."""
    script = _script(tmp_path, PET_WORKER)
    log = tmp_path / "launcher.log"
    proc = _start([*SHARDWISE, "run", str(script), str(tmp_path)], log, **_pet(1, 0, free_port()))
    try:
        code = proc.wait(timeout=240)
    finally:
        _kill_session(proc)
    assert code == 0, log.read_text()[-3000:]
    seen = sorted(p.name for p in tmp_path.glob("rank*"))
    assert seen == ["rank0", "rank1", "rank2"], log.read_text()[-3000:]
    for r in range(3):
        assert (tmp_path / f"rank{r}").read_text() == f"3 {r} 1 6.0"


def test_kubeflow_two_nodes_and_a_flag_beats_its_variable(tmp_path):
    """Two launchers, node ranks 0 and 1 from PET_NODE_RANK, meet at PET_MASTER_ADDR:PORT
    (node 0 hosts the store). Each is given --nproc 1 against PET_NPROC_PER_NODE=3: the
    flag wins, as in torchrun, so the world is 2, not 6."""
    script = _script(tmp_path, PET_WORKER)
    port = free_port()
    nodes = [
        _start(
            [*SHARDWISE, "run", "--nproc", "1", "--timeout", "20", str(script), str(tmp_path)],
            tmp_path / f"node{node}.log",
            **_pet(2, node, port),
        )
        for node in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=240) for p in nodes]
    finally:
        _kill_session(*nodes)
    logs = [(tmp_path / f"node{n}.log").read_text()[-2000:] for n in (0, 1)]
    assert codes == [0, 0], logs
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"], logs
    for r in (0, 1):
        assert (tmp_path / f"rank{r}").read_text() == "2 0 1 3.0"


def test_a_malformed_kubeflow_variable_is_one_line_and_nothing_starts(tmp_path):
    script = _script(tmp_path, PET_WORKER)
    env = {**_pet(1, 0, free_port()), "PET_NPROC_PER_NODE": "three"}
    log = tmp_path / "launcher.log"
    proc = _start([*SHARDWISE, "run", str(script), str(tmp_path)], log, **env)
    try:
        code = proc.wait(timeout=120)
    finally:
        _kill_session(proc)
    lines = log.read_text().strip().splitlines()
    assert code == 2 and lines == [
        "shardwise run: error: PET_NPROC_PER_NODE='three' (the default of --nproc, as "
        "torchrun reads it): --nproc='three': use a positive integer or 'auto'. Fix the "
        "variable or give --nproc; nothing was started."
    ], lines
    assert not list(tmp_path.glob("rank*"))
