"""Elastic world size: nodes lost and gained under `shardwise run --nnodes 1:2`, on one host.

Two launchers of 2 processes each form world 4 and train `_resumable_worker.py` (a Runner that
saves after every step and resumes from the latest checkpoint). One launcher is killed at a
random step: the survivor's agent restarts its workers at world 2, and the Runner resumes
from the last checkpoint with twice the accumulation, so every step keeps the global batch.
A launcher that joins later brings the run back to world 4. The run must end with the
parameters of an uninterrupted world-4 run (rel 1e-5), and each step must have trained the
samples it trains there: none skipped, none twice (from the ids the workers log).

A launcher stopped by SIGTERM (a node preempted) stops every rank at one step, saved; the
other node goes on at world 2 from that step. With `shardwise rendezvous` hosting the
store, losing the launcher that would have hosted it does not lose the run. A hybrid layout, which cannot exist at world 2, stops the survivor
with one line, its restarts left unused, and nothing trained at world 2.

`make test-elastic` (and .ci/run); about 5 minutes. ELASTIC_TRIALS=5 repeats the first test.
"""

from __future__ import annotations

import collections
import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.testing import free_port
from shardwise.testing.parity import Trajectory, compare_trajectories

pytestmark = pytest.mark.elastic

WORKER = Path(__file__).with_name("_resumable_worker.py")
SHARDWISE = [sys.executable, "-m", "shardwise.cli"]
TRIALS = int(os.environ.get("ELASTIC_TRIALS", "1"))


def _start(cmd: list[str], log: Path) -> subprocess.Popen[str]:
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd, text=True, start_new_session=True, stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip


def _node(run_dir: Path, endpoint: str, log: Path, *worker_args: str) -> subprocess.Popen[str]:
    flags = ["--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--max-restarts", "3"]
    return _start([*SHARDWISE, "run", *flags, str(WORKER), str(run_dir), *worker_args], log)


def _kill(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _worlds(run_dir: Path) -> list[int]:
    """The data-parallel ranks of each training row of the run's metrics.csv, so far."""
    try:
        with (run_dir / "metrics.csv").open() as f:
            rows = [r for r in csv.DictReader(f) if r.get("split") == "train"]
    except FileNotFoundError:
        return []
    return [int(float(r["dp_world"])) for r in rows if r.get("dp_world")]


def _until(what: str, test: object, timeout_s: float, *procs: subprocess.Popen[str]) -> float:
    """Wait until `test()` holds; the seconds it took."""
    start = time.monotonic()
    while not test():  # type: ignore[operator]
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        if any(p.poll() not in (None, 0) for p in procs):
            raise AssertionError(f"a launcher ended ({[p.poll() for p in procs]}) before {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def _steps(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the ids it trained, from the last generation of workers that trained it."""
    records = [
        json.loads(line) for path in (run_dir / "ids").glob("*.jsonl") for line in path.open()
    ]
    by_step = collections.defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    out = {}
    for step, rs in by_step.items():
        latest = max(r["start"] for r in rs)  # generations start tens of seconds apart
        out[step] = sorted(i for r in rs if r["start"] > latest - 5 for i in r["ids"])
    return out


def _params(run_dir: Path) -> Trajectory:
    from safetensors.torch import load_file

    return Trajectory([], load_file(str(run_dir / "export" / "model.safetensors")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("full") / "run"
    proc = _start([*SHARDWISE, "run", "--nproc", "4", str(WORKER), str(run)], run.parent / "log")
    try:
        assert proc.wait(timeout=300) == 0, (run.parent / "log").read_text()[-3000:]
    finally:
        _kill(proc)
    return run


def _same_training(run: Path, full: Path) -> None:
    report = compare_trajectories(_params(full), _params(run), rtol=1e-5)
    print(f"final parameters: rel {report.max_param_rel:.1e}")
    ours, ref = _steps(run), _steps(full)
    assert ours.keys() == ref.keys() and all(ours[s] == ref[s] for s in ref)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_lost_node_and_a_new_one_keep_the_run(tmp_path: Path, uninterrupted: Path, trial: int):
    kill_at = random.Random(trial).randint(3, 10)
    run, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    node0 = _node(run, endpoint, tmp_path / "node0.log")
    time.sleep(2)  # node 0 hosts the rendezvous (first on the endpoint) and holds rank 0
    node1 = _node(run, endpoint, tmp_path / "node1.log")
    node2 = None
    try:
        _until(f"step {kill_at}", lambda: len(_worlds(run)) >= kill_at, 240, node0, node1)
        lost_at = len(_worlds(run))
        _kill(node1)  # as a node lost
        shrink_s = _until("a step at world 2", lambda: 2 in _worlds(run), 240, node0)
        log0 = (tmp_path / "node0.log").read_text()
        resumed = int(log0.split("resumed from step ")[1].split()[0])
        assert (
            f"shardwise: data-parallel ranks 4 -> 2: resuming after step {resumed} with "
            "accumulate_steps=2 (was 1), so every step still takes the global batch of 8 "
            "samples" in log0
        )
        node2 = _node(run, endpoint, tmp_path / "node2.log")  # a node joins
        grow_s = _until(
            "a step back at world 4",
            lambda: 2 in _worlds(run) and _worlds(run)[-1] == 4,
            240,
            node0,
            node2,
        )
        assert node0.wait(timeout=240) == 0 and node2.wait(timeout=240) == 0
        log0 = (tmp_path / "node0.log").read_text()
        assert "data-parallel ranks 2 -> 4: resuming after step" in log0
        assert "with accumulate_steps=1 (was 2)" in log0
        print(
            f"trial {trial}: killed after step {lost_at}, resumed from step {resumed} "
            f"({lost_at - resumed} step(s) lost) with the first step at world 2 {shrink_s:.0f} s "
            f"after the loss; back at world 4 {grow_s:.0f} s after a node joined"
        )
        assert lost_at - resumed <= 1  # a checkpoint after every step
        worlds = _worlds(run)
        assert worlds[0] == 4 and 2 in worlds and worlds[-1] == 4  # marked in metrics.csv
        _same_training(run, uninterrupted)
    finally:
        _kill(node0, node1, *([node2] if node2 else []))


def test_a_preempted_node_stops_every_rank_at_one_step_and_the_other_goes_on(
    tmp_path: Path, uninterrupted: Path
):
    """SIGTERM to one launcher, as a scheduler reclaiming its node: the Runner stops every
    rank of the job after the same step and saves it; that launcher exits 75; the other
    one's workers exited 75 without its launcher being signalled, so its agent restarts
    them at world 2 from that very step: no step lost, none trained twice."""
    run, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    node0 = _node(run, endpoint, log0)
    time.sleep(2)
    node1 = _node(run, endpoint, log1)
    try:
        _until("step 4", lambda: len(_worlds(run)) >= 4, 240, node0, node1)
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(timeout=120) == 75, log1.read_text()[-3000:]
        assert "shardwise run: SIGTERM: the workers were stopped" in log1.read_text()
        assert node0.wait(timeout=300) == 0, log0.read_text()[-3000:]
        text = log0.read_text()
        saved = int(text.split("stopped after optimizer step ")[1].split()[0])
        assert "shardwise run: 2 rank(s) stopped and saved:" in text
        assert f"restart 1: resumed from step {saved} of" in text, text[-3000:]
        assert f"data-parallel ranks 4 -> 2: resuming after step {saved}" in text
        assert _worlds(run) == [4] * saved + [2] * (24 - saved)
        _same_training(run, uninterrupted)
    finally:
        _kill(node0, node1)


def test_losing_the_node_that_would_host_the_rendezvous(tmp_path: Path, uninterrupted: Path):
    """Without a store of its own, the launcher first on the endpoint hosts it, and the run
    is lost with it; `shardwise rendezvous` keeps the store apart from every node."""
    run, port = tmp_path / "run", free_port()
    endpoint = f"127.0.0.1:{port}"
    store = _start(
        [*SHARDWISE, "rendezvous", "--host", "127.0.0.1", "--port", str(port)],
        tmp_path / "store.log",
    )
    nodes: list[subprocess.Popen[str]] = []
    try:
        _until("the store", lambda: "hosting the store" in (tmp_path / "store.log").read_text(),
               60, store)  # fmt: skip
        nodes = [_node(run, endpoint, tmp_path / f"node{n}.log") for n in (0, 1)]
        _until("step 4", lambda: len(_worlds(run)) >= 4, 240, *nodes)
        _kill(nodes[0])
        assert nodes[1].wait(timeout=300) == 0, (tmp_path / "node1.log").read_text()[-3000:]
        assert "data-parallel ranks 4 -> 2" in (tmp_path / "node1.log").read_text()
        _same_training(run, uninterrupted)
    finally:
        _kill(*nodes, store)


def test_a_layout_impossible_at_the_new_world_stops_with_one_line(tmp_path: Path):
    """hybrid_shard is 2x2 at world 4 and has no 2-D split at world 2. Before, each of the
    survivor's restarts refused it again with a traceback; it must not train something else."""
    run, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    log0 = tmp_path / "node0.log"
    node0 = _node(run, endpoint, log0, "hybrid_shard")
    time.sleep(2)
    node1 = _node(run, endpoint, tmp_path / "node1.log", "hybrid_shard")
    try:
        _until("step 3", lambda: len(_worlds(run)) >= 3, 240, node0, node1)
        _kill(node1)
        assert node0.wait(timeout=300) == 1, log0.read_text()[-3000:]
        log = log0.read_text()
        refusal = "ValueError: ParallelConfig.strategy='hybrid_shard' needs a 2-D mesh"
        assert log.count(refusal) == 1, log[-3000:]
        assert "but world size 2 has no such split" in log
        assert log.rstrip().endswith(
            "shardwise run: not restarted: every rank refused its setting, and a restart "
            "would refuse it again."
        ), log[-3000:]
        assert set(_worlds(run)) == {4}  # nothing trained at world 2
    finally:
        _kill(node0, node1)
