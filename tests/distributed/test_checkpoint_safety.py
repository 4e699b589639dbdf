"""Checkpoint directory safety, paths that stay inside, re-export, asynchronous saves.

One spawned 2-rank group (full_shard) runs the collective cases: an existing step directory
and newer checkpoints are moved aside by a save, `set_aside_newer` after a resume,
leftovers of killed saves and prunings removed at the next save, and asynchronous saves
(bitwise equal to a synchronous save of the same step, a snapshot of the call's step
although training goes on, followed by a synchronous save). The rest runs in this process.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardwise import Engine, ParallelConfig, shutdown
from shardwise.checkpoint import (
    MANIFEST,
    CheckpointError,
    PendingCheckpoint,
    list_checkpoints,
    load_checkpoint,
    read_dcp_metadata,
    read_manifest,
    resolve_checkpoint,
    save_checkpoint,
    set_aside_newer,
    verify_checkpoint,
    wait_for_checkpoint,
)
from shardwise.checkpoint.export import export_weights
from shardwise.checkpoint.layout import _sha256
from shardwise.parallelize import INDEX_FILE, SINGLE_FILE, WeightsError, load_weights
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.testing.parity import split_batch

CFG = GPTConfig()
DATA = random_lm_batches(CFG, 8, 8, seed=1)


@pytest.fixture(autouse=True)
def _no_group():
    shutdown()


def _engine(strategy: str | None = None, seed: int = 0) -> Engine:
    torch.manual_seed(seed)
    config = ParallelConfig(strategy=strategy) if strategy else ParallelConfig()
    return Engine(GPT(CFG), lambda p: torch.optim.AdamW(p, lr=1e-3), config)


def _step(engine: Engine, i: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine.train_step(split_batch(DATA[i % len(DATA)], rank, world))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _capture() -> _Lines:
    logger = logging.getLogger("shardwise.checkpoint")
    for old in [h for h in logger.handlers if isinstance(h, _Lines)]:
        logger.removeHandler(old)
    handler = _Lines()
    logger.addHandler(handler)
    return handler


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _local_state(engine: Engine) -> dict[str, torch.Tensor]:
    """This rank's model and optimizer tensors (shards), copied, by name."""
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    out = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        out.update({f"optim.{fqn}.{k}": v for k, v in state.items()})
    return {
        k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in out.items()
    }


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (empty when equal)."""
    assert sorted(a) == sorted(b)
    raw = {k: (a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a}
    return [k for k, (x, y) in raw.items() if not torch.equal(x, y)]


# --- collective cases, one spawned group -------------------------------------------------------


def _directory_rule(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine = _engine("full_shard")
    for i in range(4):  # steps 1..4
        _step(engine, i)
        save_checkpoint(root, engine)
    # A restart resumes from step 2 (say `latest` was not updated after a rename): the next
    # saves reach steps 3 and 4 again, which exist.
    resumed = _engine("full_shard", seed=5)
    load_checkpoint(root / "step_00000002", resumed)
    logs = _capture()
    _step(resumed, 2)
    out["saved"] = str(save_checkpoint(root, resumed, keep_last=3))
    out["after_save"] = _names(root)
    out["superseded"] = sorted(
        str(p.relative_to(root)) for p in (root / "superseded").glob("*/step_*")
    )
    out["save_logs"] = logs.lines[:]
    # set_aside_newer after resuming from step 1 (every rank gets the same list).
    again = _engine("full_shard", seed=6)
    load_checkpoint(root / "step_00000001", again)
    moved = set_aside_newer(root, again.step)
    out["moved"] = [str(p.relative_to(root)) for p in moved]
    out["latest_after_set_aside"] = (root / "latest").read_text().strip()
    out["nothing_newer"] = set_aside_newer(root, again.step)
    # Leftovers of a killed save, a killed old-style pruning and a killed new-style pruning.
    dist.barrier()
    if dist.get_rank() == 0:
        (root / ".tmp-step_00000009" / "state").mkdir(parents=True)
        half = root / "step_00000000"
        shutil.copytree(root / "step_00000001", half)
        (half / MANIFEST).unlink()
        (root / ".deleting-step_00000000" / "rng").mkdir(parents=True)
    dist.barrier()
    logs.lines.clear()
    _step(again, 1)
    save_checkpoint(root, again, keep_last=1)
    out["after_cleanup"] = _names(root)
    out["cleanup_logs"] = logs.lines[:]
    # Rank 0 cannot move (ROOT/superseded is a file): every rank raises, none waits.
    blocked = root.parent / "blocked"
    if dist.get_rank() == 0:
        shutil.copytree(root / "step_00000002", blocked / "step_00000002")
        (blocked / "superseded").write_text("in the way")
    try:
        set_aside_newer(blocked, 1)
        out["blocked"] = "no error"
    except CheckpointError as exc:
        out["blocked"] = str(exc)
    return out


def _async_cases(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": dist.get_rank()}
    engine = _engine("full_shard")
    _step(engine, 0)
    _step(engine, 1)
    at_call = _local_state(engine)
    sync_path = save_checkpoint(root / "sync", engine)
    # The background write waits until training has moved on, so a state that was not
    # copied during the call would be written with later steps' values.
    gate, real = threading.Event(), FileSystemWriter.write_data
    FileSystemWriter.write_data = lambda self, *a, **k: gate.wait(120) and real(self, *a, **k)
    try:
        pending = save_checkpoint(root / "async", engine, async_=True)
        out["pending_type"] = type(pending).__name__
        for i in range(2, 5):  # training goes on (with its own collectives)
            _step(engine, i)
        out["done_while_writing"] = pending.done()
        out["visible_before_result"] = (root / "async" / "step_00000002").exists()
        gate.set()
        async_path = pending.result(timeout_s=120)
    finally:
        FileSystemWriter.write_data = real
    out["done"] = pending.done()
    out["result_again"] = str(pending.result())
    out["paths"] = (str(sync_path), str(async_path))
    files = {
        kind: read_manifest(path)["files"]
        for kind, path in (("sync", sync_path), ("async", async_path))
    }
    out["same_files"] = sorted(files["sync"]) == sorted(files["async"])
    out["differing_data_files"] = [
        name
        for name, meta in files["sync"].items()
        if name != "state/.metadata" and meta["sha256"] != files["async"][name]["sha256"]
    ]
    out["step_in_manifest"] = read_manifest(async_path)["step"]
    loaded = {}
    for kind, path in (("sync", sync_path), ("async", async_path)):
        fresh = _engine("full_shard", seed=9)
        load_checkpoint(path, fresh)
        loaded[kind] = _local_state(fresh)
    out["async_vs_call_time"] = _bitwise(loaded["async"], at_call)
    out["sync_vs_async"] = _bitwise(loaded["sync"], loaded["async"])
    out["changed_since_call"] = len(_bitwise(_local_state(engine), at_call))
    # A save right after an asynchronous one completes it first, then saves. (The second
    # asynchronous save reuses the first one's CPU copy: it must hold step 5, not step 2.)
    at_step5 = _local_state(engine)
    pending = save_checkpoint(root / "async", engine, async_=True)  # step 5
    _step(engine, 5)
    out["sync_after_async"] = str(save_checkpoint(root / "async", engine))  # step 6
    out["async_after_sync"] = pending.done()
    fresh = _engine("full_shard", seed=9)
    load_checkpoint(root / "async" / "step_00000005", fresh)
    out["reused_copy_vs_step5"] = _bitwise(_local_state(fresh), at_step5)
    out["listed"] = [(c.path.name, c.complete) for c in list_checkpoints(root / "async")]
    out["latest"] = resolve_checkpoint(root / "async").name
    out["wait_none"] = wait_for_checkpoint()
    return out


def _nobody_waits_for_pruning(root: Path) -> dict[str, Any]:
    """Rank 0's pruning blocks until rank 1 has returned from the save: if rank 1 waited
    for it (in a collective, as before), the save would stall until the deadline."""
    from shardwise.checkpoint import commit

    engine = _engine("full_shard")
    returned = root / "rank1_returned"
    _step(engine, 0)
    save_checkpoint(root, engine, keep_last=1)
    real = commit._prune

    def prune_after_rank1(path: Path) -> None:
        deadline = time.monotonic() + 20
        while not returned.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["rank1_returned_first"] = returned.exists()
        real(path)

    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        commit._prune = prune_after_rank1
    _step(engine, 1)
    try:
        save_checkpoint(root, engine, keep_last=1)
    finally:
        commit._prune = real
    if dist.get_rank() == 1:
        returned.touch()
    dist.barrier()
    out["left"] = sorted(p.name for p in root.iterdir() if p.name != returned.name)
    return out


def _collective(root: str) -> dict[str, Any]:
    return {
        "rule": _directory_rule(Path(root) / "rule"),
        "async": _async_cases(Path(root) / "async"),
        "pruning": _nobody_waits_for_pruning(Path(root) / "pruning"),
    }


@pytest.fixture(scope="module")
def collective(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("collective")
    return root, run_distributed(_collective, 2, args=(str(root),), timeout_s=240)


def test_existing_step_directory_is_moved_aside_and_the_save_succeeds(collective):
    root, results = collective
    rule = results[0]["rule"]
    assert rule["saved"] == str(root / "rule" / "step_00000003")
    assert rule["after_save"] == [
        "latest", "step_00000001", "step_00000002", "step_00000003", "superseded",
    ]  # fmt: skip
    # The old step 3 and the newer step 4 were moved, not deleted, and each got a line.
    assert [Path(p).name for p in rule["superseded"]] == ["step_00000003", "step_00000004"]
    assert len({Path(p).parent for p in rule["superseded"]}) == 1
    assert len(rule["save_logs"]) == 2
    for line, name in zip(rule["save_logs"], ("step_00000003", "step_00000004"), strict=True):
        assert f"moved {root / 'rule' / name} aside to {root / 'rule' / 'superseded'}" in line
        assert "(superseded by the save at step 3)" in line
    assert results[1]["rule"]["save_logs"] == []  # rank 0 alone touches the directory


def test_set_aside_newer_moves_newer_and_repoints_latest(collective):
    root, results = collective
    rule = results[0]["rule"]
    assert [Path(p).name for p in rule["moved"]] == ["step_00000002", "step_00000003"]
    assert all(p.startswith("superseded/") for p in rule["moved"])
    assert results[1]["rule"]["moved"] == rule["moved"]  # the same list on every rank
    assert rule["latest_after_set_aside"] == "step_00000001"
    assert rule["nothing_newer"] == []
    for p in rule["moved"]:  # intact where they went
        assert verify_checkpoint(root / "rule" / p) == []


def test_leftovers_are_removed_at_the_next_save_with_a_line_each(collective):
    root, results = collective
    rule = results[0]["rule"]
    # keep_last=1 pruned step 1 through a `.deleting-` rename, which left nothing behind.
    assert rule["after_cleanup"] == ["latest", "step_00000002", "superseded"]
    lines = rule["cleanup_logs"]
    r = root / "rule"
    assert any(
        f"removed {r / '.tmp-step_00000009'}, the temporary directory of a save" in x for x in lines
    )
    assert any(
        f"removed {r / 'step_00000000'}, an incomplete checkpoint (no shardwise.json" in x
        for x in lines
    )
    assert any(f"removed {r / '.deleting-step_00000000'}, a checkpoint whose pruning" in x for x in lines)  # fmt: skip
    assert len(lines) == 3, lines


def test_set_aside_newer_failing_on_rank_0_raises_on_every_rank(collective):
    root, results = collective
    what = f"set aside the checkpoints newer than step 1 in {root / 'blocked'}"
    assert results[0]["rule"]["blocked"].startswith(f"could not {what}: [Errno")
    assert results[1]["rule"]["blocked"].startswith(f"rank 0 could not {what}: [Errno")


class _Killed(BaseException):
    pass


def test_a_kill_during_pruning_leaves_a_recognisable_directory(tmp_path, monkeypatch):
    from shardwise.checkpoint import layout

    engine = _engine()
    _step(engine, 0)
    save_checkpoint(tmp_path, engine)
    real = shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # the manifest goes first, then the kill
        (Path(path) / MANIFEST).unlink()
        raise _Killed

    monkeypatch.setattr(layout.shutil, "rmtree", killed_midway)
    _step(engine, 1)
    with pytest.raises(_Killed):
        save_checkpoint(tmp_path, engine, keep_last=1)
    monkeypatch.setattr(layout.shutil, "rmtree", real)
    # Not a `step_*` directory that lost its manifest: a name no listing takes for one.
    assert _names(tmp_path) == [".deleting-step_00000001", "latest", "step_00000002"]
    assert [c.path.name for c in list_checkpoints(tmp_path)] == ["step_00000002"]
    logs = _capture()
    _step(engine, 2)
    save_checkpoint(tmp_path, engine, keep_last=1)
    assert _names(tmp_path) == ["latest", "step_00000003"]
    assert logs.lines == [
        f"shardwise checkpoint: removed {tmp_path / '.deleting-step_00000001'}, a checkpoint "
        "whose pruning did not finish"
    ]


FINALISATION = ("manifest", "move_aside", "rename", "latest", "prune")


@pytest.mark.parametrize("point", FINALISATION)
def test_a_fault_inside_finalisation(tmp_path, monkeypatch, point):
    """A kill at each point of rank 0's finalisation (before that point's action runs)
    leaves `latest` and the resolved checkpoint on the last complete step: the previous
    one up to the `latest` update, the new one after it. The next save then succeeds."""
    from shardwise.checkpoint import commit as ck  # the module whose names _finalize calls

    def fault_at(name, real, applies=lambda *a: True):
        def call(*args, **kwargs):
            if name == point and applies(*args):
                raise _Killed(name)
            return real(*args, **kwargs)

        return call

    engine = _engine()
    _step(engine, 0)
    first = save_checkpoint(tmp_path, engine)
    _step(engine, 1)
    write, rename = ck._write_atomic, ck.os.rename
    with monkeypatch.context() as m:
        m.setattr(ck, "_write_atomic", fault_at("manifest", write, lambda p, _: p.name == MANIFEST))
        m.setattr(
            ck,
            "_write_atomic",
            fault_at("latest", ck._write_atomic, lambda p, _: p.name == "latest"),
        )
        m.setattr(ck, "_move_aside", fault_at("move_aside", ck._move_aside))
        m.setattr(
            ck.os,
            "rename",
            fault_at("rename", rename, lambda src, _: Path(src).name.startswith(ck.TMP_PREFIX)),
        )
        m.setattr(ck, "_prune", fault_at("prune", ck._prune))
        with pytest.raises(_Killed, match=point):
            save_checkpoint(tmp_path, engine, keep_last=1)
    done = "step_00000002" if point == "prune" else first.name
    assert (tmp_path / "latest").read_text().strip() == done
    assert resolve_checkpoint(tmp_path).name == done
    assert verify_checkpoint(tmp_path / done) == []
    # Before the rename the new step is not a checkpoint at all; from the rename on it is
    # complete (a kill before `latest` moves is resolved to the previous step, and a
    # resume from there supersedes it at its next save).
    complete = [c.path.name for c in list_checkpoints(tmp_path) if c.complete]
    renamed = FINALISATION.index(point) > FINALISATION.index("rename")
    assert complete == [first.name, "step_00000002"] if renamed else [first.name], complete
    _step(engine, 2)
    assert save_checkpoint(tmp_path, engine, keep_last=1).name == "step_00000003"
    assert resolve_checkpoint(tmp_path).name == "step_00000003"


def test_no_rank_waits_for_rank_0s_pruning(collective):
    # Before: every rank waited in a collective while rank 0 pruned, removed leftovers and
    # hashed; a large checkpoint on a shared filesystem let NCCL's watchdog abort the job.
    _, results = collective
    assert results[0]["pruning"]["rank1_returned_first"] is True
    for r in results:
        assert r["pruning"]["left"] == ["latest", "step_00000002"]


def test_async_save_is_the_call_time_state_bitwise(collective):
    _, results = collective
    for r in results:
        a = r["async"]
        assert a["pending_type"] == "PendingCheckpoint"
        assert a["visible_before_result"] is False and a["done_while_writing"] is False
        assert a["done"] and a["result_again"] == a["paths"][1]
        assert a["step_in_manifest"] == 2
        assert a["changed_since_call"] > 0  # training did move the live state on...
        assert a["async_vs_call_time"] == []  # ...but the checkpoint holds step 2's bits
        assert a["sync_vs_async"] == []
        assert a["same_files"] and a["differing_data_files"] == []


def test_a_save_after_an_async_save_completes_it_first(collective):
    _, results = collective
    for r in results:
        a = r["async"]
        assert a["async_after_sync"] is True and a["reused_copy_vs_step5"] == []
        assert a["listed"] == [
            ("step_00000002", True), ("step_00000005", True), ("step_00000006", True),
        ]  # fmt: skip
        assert a["latest"] == "step_00000006" and a["sync_after_async"].endswith("step_00000006")
        assert a["wait_none"] is None


# --- a kill during an asynchronous save -----------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    import shardwise.checkpoint as ck
    from shardwise.checkpoint import async_save
    from shardwise import Engine
    from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

    root = sys.argv[1]
    torch.manual_seed(0)
    engine = Engine(GPT(GPTConfig()), lambda p: torch.optim.AdamW(p))
    batches = random_lm_batches(GPTConfig(), 2, 4)
    engine.train_step(batches[0])
    ck.save_checkpoint(root, engine)
    engine.train_step(batches[1])
    real = async_save._hash_share
    def slow(tmp):  # on the background thread: the write is under way at the kill
        print("WRITING", flush=True)
        time.sleep(60)
        return real(tmp)
    async_save._hash_share = slow
    ck.save_checkpoint(root, engine, async_=True)
    time.sleep(60)
    """
)


def test_a_kill_during_an_async_save_leaves_no_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "child.py"), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    listed = {(c.path.name, c.complete) for c in list_checkpoints(root)}
    assert listed == {("step_00000001", True), (".tmp-step_00000002", False)}
    assert resolve_checkpoint(root).name == "step_00000001"
    engine = _engine()
    load_checkpoint(root, engine)
    _step(engine, 1)
    logs = _capture()
    save_checkpoint(root, engine)
    assert [(c.path.name, c.complete) for c in list_checkpoints(root)] == [
        ("step_00000001", True),
        ("step_00000002", True),
    ]
    assert any("removed" in x and ".tmp-step_00000002" in x for x in logs.lines), logs.lines


def test_async_save_without_a_process_group(tmp_path):
    engine = _engine()
    _step(engine, 0)
    at_call = _local_state(engine)
    pending = save_checkpoint(tmp_path, engine, async_=True)
    assert isinstance(pending, PendingCheckpoint)
    _step(engine, 1)
    assert wait_for_checkpoint(timeout_s=60) == tmp_path / "step_00000001"
    assert pending.result() == tmp_path / "step_00000001" and wait_for_checkpoint() is None
    fresh = _engine(seed=3)
    load_checkpoint(tmp_path, fresh)
    assert _bitwise(_local_state(fresh), at_call) == []
    with pytest.raises(TypeError, match=r"save_checkpoint\(async_='yes'\) must be True or False"):
        save_checkpoint(tmp_path, engine, async_="yes")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=r"set_aside_newer\(step=-1\) must be a step number"):
        set_aside_newer(tmp_path, -1)


# --- paths stay inside -----------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> Path:
    engine = _engine()
    _step(engine, 0)
    return save_checkpoint(tmp_path / "ck", engine)


def _rewrite_metadata(checkpoint: Path, name: str) -> str:
    """Point the first stored entry at `name`, the way a tampered checkpoint would, and
    record the new file in the manifest so its hash check passes. Returns the entry's key."""
    metadata = read_dcp_metadata(checkpoint / "state")
    index, info = next(iter(metadata.storage_data.items()))
    info.relative_path = name
    path = checkpoint / "state" / ".metadata"
    with path.open("wb") as f:
        pickle.dump(metadata, f)  # as DCP's FileSystemWriter.finish writes it
    manifest = read_manifest(checkpoint)
    manifest["files"]["state/.metadata"] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return index.fqn


@pytest.mark.parametrize("how", ["absolute", "dotdot", "link"])
def test_metadata_naming_a_file_outside_is_refused(saved, tmp_path, how):
    data = next((saved / "state").glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    shutil.copy(data, outside)  # the very bytes: without the check the load succeeds
    if how == "absolute":
        name = str(outside)
        why = "an absolute path"
    elif how == "dotdot":
        name = "../../../outside.distcp"
        why = "a path with '..'"
    else:
        (saved / "state" / "link.distcp").symlink_to(outside)
        name = "link.distcp"
        why = "a path that resolves outside that directory"
    fqn = _rewrite_metadata(saved, name)
    message = rf"the storage entry for '{fqn}' names '{name}', {why}.*inside {saved / 'state'}"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(saved, _engine(), verify=False)
    with pytest.raises(CheckpointError, match=message):
        export_weights(saved, tmp_path / "export", verify=False)
    assert not any((tmp_path / "export").glob("*")) and not any((tmp_path / "export").glob(".*"))
    if how != "link":  # (a link inside state/ is also an unexpected file for verification)
        with pytest.raises(CheckpointError, match=rf"failed verification.*{why}"):
            load_checkpoint(saved, _engine())


def _edit_manifest(checkpoint: Path, edit: Any) -> None:
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    (checkpoint / MANIFEST).write_text(json.dumps(edit(manifest)))


def _set(path: list[Any], value: Any) -> Any:
    def edit(manifest: Any) -> Any:
        target = manifest
        for key in path[:-1]:
            target = target[key] if not callable(key) else key(target)
        target[path[-1]] = value
        return manifest

    return edit


def _first_file(files: dict[str, Any]) -> dict[str, Any]:
    return next(iter(files.values()))


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda m: [m], r"\(the top level\) is list .*expected an object"),
        (_set(["step"], "12"), r"step is str '12', expected an integer >= 0"),
        (_set(["files"], ["state/.metadata"]), r"files is list .*expected an object of name"),
        (
            _set(["files", "state/.metadata"], "abc"),
            r"files\['state/.metadata'\] is str 'abc', expected an object",
        ),
        (
            _set(["files", _first_file, "size"], "10"),
            r"files\[.*\]\.size is str '10', expected a size in bytes",
        ),
        (
            lambda m: (_first_file(m["files"]).pop("sha256"), m)[1],
            r"files\[.*\]\.sha256 is NoneType None, expected 64 lowercase hex",
        ),
        (
            _set(["files", "../../etc/hostname"], {"size": 1, "sha256": "0" * 64}),
            r"files\['../../etc/hostname'\] is str .*it is a path with '..'",
        ),
        (
            _set(["files", "/etc/hostname"], {"size": 1, "sha256": "0" * 64}),
            r"files\['/etc/hostname'\] .*it is an absolute path",
        ),
        (_set(["optimizer"], ["adamw"]), r"optimizer is list .*expected an object or null"),
        (
            _set(["optimizer", "param_groups"], {"lr": 1}),
            r"optimizer.param_groups is dict .*expected a list of objects",
        ),
        (_set(["runner"], "step 3"), r"runner is str 'step 3', expected an object or null"),
    ],
)
def test_a_malformed_manifest_is_a_checkpoint_error_naming_the_field(saved, edit, said):
    """Before: raw TypeError, KeyError or AttributeError in verify and in resume, and a
    manifest entry naming ../../etc/hostname was opened and hashed."""
    _edit_manifest(saved, edit)
    for read in (read_manifest, verify_checkpoint, lambda p: load_checkpoint(p, _engine())):
        with pytest.raises(CheckpointError, match=rf"{saved / MANIFEST}: field {said}"):
            read(saved)


def test_latest_and_step_directories_cannot_point_outside_their_run(tmp_path):
    """Before: `latest` naming ../../other-run/checkpoints/step_15 was resumed from, and a
    step_* symlink to another run was listed, resumed and pruned as this run's."""
    engine = _engine()
    _step(engine, 0)
    other = save_checkpoint(tmp_path / "other-run" / "checkpoints", engine)
    mine = tmp_path / "run" / "checkpoints"
    save_checkpoint(mine, engine)
    (mine / "latest").write_text("../../other-run/checkpoints/" + other.name + "\n")
    with pytest.raises(
        CheckpointError,
        match=r"latest names '../../other-run/[^']*'; it may only name a step_N directory beside it",
    ):
        resolve_checkpoint(mine)
    (mine / "latest").write_text(other.name + "\n")
    (mine / "step_00000015").symlink_to(other, target_is_directory=True)
    (mine / "latest").write_text("step_00000015\n")
    for look in (resolve_checkpoint, list_checkpoints):
        with pytest.raises(
            CheckpointError,
            match=r"step_00000015 is a symbolic link \(to .*other-run.*\): a checkpoint must be a directory inside",
        ):
            look(mine)
    (mine / "step_00000015").unlink()
    (mine / "latest").write_text(other.name + "\n")
    assert resolve_checkpoint(mine) == mine / other.name  # a plain step name beside it


def _sharded_export(tmp_path: Path) -> Path:
    export_weights(GPT(CFG), tmp_path / "w", max_shard_bytes=20_000)
    return tmp_path / "w" / INDEX_FILE


@pytest.mark.parametrize("how", ["absolute", "dotdot", "link", "missing"])
def test_index_naming_a_file_outside_is_refused(tmp_path, how):
    index_path = _sharded_export(tmp_path)
    index = json.loads(index_path.read_text())
    tensor, first = next(iter(index["weight_map"].items()))
    outside = tmp_path / "outside.safetensors"
    shutil.copy(index_path.parent / first, outside)
    if how == "absolute":
        name, why = str(outside), "an absolute path"
    elif how == "dotdot":
        name, why = "../outside.safetensors", "a path with '..'"
    elif how == "link":
        (index_path.parent / "link.safetensors").symlink_to(outside)
        name, why = "link.safetensors", "a path that resolves outside that directory"
    else:  # a file the index names that is not there: a WeightsError, not FileNotFoundError
        name, why = "gone.safetensors", r"which is not in that directory \(an incomplete"
    index["weight_map"][tensor] = name
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        WeightsError,
        match=rf"weight_map\['{tensor}'\] names '{name}', {why}.*own directory \({tmp_path / 'w'}\)",
    ):
        load_weights(GPT(CFG), tmp_path / "w")


# --- re-export -------------------------------------------------------------------------------------


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    target = _model(99)
    load_weights(target, path)
    return {k: v.detach().clone() for k, v in target.state_dict().items()}


@pytest.mark.parametrize("first_sharded", [True, False])
def test_re_export_replaces_the_previous_export(tmp_path, first_sharded):
    out = tmp_path / "w"
    old, new = _model(1), _model(2)
    export_weights(old, out, max_shard_bytes=20_000 if first_sharded else 2**40)
    assert (out / (INDEX_FILE if first_sharded else SINGLE_FILE)).is_file()
    written = export_weights(new, out, max_shard_bytes=2**40 if first_sharded else 20_000)
    if first_sharded:
        assert written == out / SINGLE_FILE and _names(out) == [SINGLE_FILE]
    else:
        assert written == out / INDEX_FILE and SINGLE_FILE not in _names(out)
        shards = [n for n in _names(out) if n != INDEX_FILE]
        assert len(shards) > 1 and all(n.startswith("model-") for n in shards)
    got, want = _loaded(out), new.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_export_refuses_foreign_files_and_keeps_the_users_config(tmp_path, saved):
    out = tmp_path / "w"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(
        WeightsError, match=r"holds \['notes\.txt'\], which no export writes.*new or empty"
    ):
        export_weights(GPT(CFG), out)
    assert _names(out) == ["notes.txt"]
    (out / "notes.txt").unlink()
    # A config.json written by the user, then exports from a checkpoint (which have none).
    (out / "config.json").write_text("{}")
    (out / ".shardwise-export-12345" / ".previous").mkdir(parents=True)  # a killed export
    export_weights(saved, out, max_shard_bytes=20_000)
    export_weights(saved, out)
    assert _names(out) == ["config.json", SINGLE_FILE]
    assert (out / "config.json").read_text() == "{}"


def test_a_full_disk_during_export_leaves_nothing_and_says_what_is_needed(tmp_path, monkeypatch):
    """Before: a raw SafetensorError, and an empty export/ that load_weights read as 'no
    weights'. A re-export that fails keeps the earlier export whole."""
    import shardwise.checkpoint.export as export_module

    real_save = export_module.save_file
    writes = []

    def disk_fills(tensors, path, metadata=None):
        if writes:  # the second file finds the disk full, after writing part of itself
            Path(path).write_bytes(b"\0" * 100)
            raise OSError(28, "No space left on device")
        writes.append(path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(export_module, "save_file", disk_fills)
    model, out = GPT(CFG), tmp_path / "export"
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with pytest.raises(WeightsError) as caught:
        export_weights(model, out, max_shard_bytes=20_000)
    said = str(caught.value)
    assert f"export_weights could not write to {out}: [Errno 28] No space left on device" in said
    assert f"needs about {needed:,} bytes (" in said and "bytes free there)" in said
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no partial export, no staging
    monkeypatch.setattr(export_module, "save_file", real_save)
    export_weights(model, out, max_shard_bytes=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    writes.clear()
    monkeypatch.setattr(export_module, "save_file", disk_fills)
    with pytest.raises(WeightsError, match="No space left on device"):
        export_weights(GPT(GPTConfig(n_layers=1)), out, max_shard_bytes=20_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    load_weights(GPT(CFG), out)  # still the first export, whole
