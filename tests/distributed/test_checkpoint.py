"""Checkpoints: the reshard matrix, exact resume through the Runner, faults and bad input.

Reshard matrix: a GPT is trained 3 AdamW steps under config A (strategy, world), saved, and
loaded under config B, which trains 3 more steps. Every strategy matches single-process
training, so "continues identically" means: B's losses and final parameters equal the
single-process reference trajectory over steps 3-5. All 100 pairs run in CI: about 50 s on the 2-core machine, so no subset is needed.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise import Engine, ParallelConfig
from shardwise.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    read_dcp_metadata,
    read_manifest,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.testing.parity import full_parameters, split_batch

CFG = GPTConfig()
DATA = random_lm_batches(CFG, 6, 8, seed=1)
RTOL = 1e-5
# (strategy, world); world 1 is the unwrapped single-process model.
CONFIGS = [
    ("unwrapped", 1),
    ("ddp", 2), ("no_shard", 2), ("shard_grad_op", 2), ("full_shard", 2),
    ("ddp", 4), ("no_shard", 4), ("shard_grad_op", 4), ("full_shard", 4), ("hybrid_shard", 4),
]  # fmt: skip
ALL_PAIRS = [(i, j) for i in range(len(CONFIGS)) for j in range(len(CONFIGS))]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def engine_for(strategy: str, seed: int = 0) -> Engine:
    torch.manual_seed(seed)
    config = ParallelConfig() if strategy == "unwrapped" else ParallelConfig(strategy=strategy)
    return Engine(GPT(CFG), adamw, config)


def train(engine: Engine, batches) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return [engine.train_step(split_batch(b, rank, world))["loss"] for b in batches]


def ckpt_dir(root: str, index: int) -> str:
    strategy, world = CONFIGS[index]
    return f"{root}/{strategy}_w{world}"


def save_phase(root: str, indices: list[int]) -> dict:
    out = {}
    for i in indices:
        engine = engine_for(CONFIGS[i][0])
        out[i] = train(engine, DATA[:3])
        save_checkpoint(ckpt_dir(root, i), engine)
    return out


def load_phase(root: str, pairs: list[tuple[int, int]], load_optimizer: bool = True) -> dict:
    out = {}
    for src, dst in pairs:
        engine = engine_for(CONFIGS[dst][0], seed=1234)  # different init: the load must win
        manifest = load_checkpoint(ckpt_dir(root, src), engine, load_optimizer=load_optimizer)
        losses = train(engine, DATA[3:])
        out[(src, dst)] = {
            "losses": losses,
            "params": full_parameters(engine.model),
            "step": engine.step,
            "rng": manifest["rng_restored"],
        }
    return out


@functools.cache
def reference() -> dict:
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), adamw)
    losses = [engine.train_step(b)["loss"] for b in DATA]
    return {"losses": losses, "params": full_parameters(engine.model)}


def run_matrix(root: Path, pairs: list[tuple[int, int]], load_optimizer: bool = True) -> dict:
    for world in (1, 2, 4):
        saves = sorted({s for s, _ in pairs if CONFIGS[s][1] == world})
        if saves:
            run_distributed(save_phase, world, args=(str(root), saves), timeout_s=240)
    results = {}
    for world in (1, 2, 4):
        mine = [(s, d) for s, d in pairs if CONFIGS[d][1] == world]
        if mine:
            for rank_result in run_distributed(
                load_phase, world, args=(str(root), mine, load_optimizer), timeout_s=240
            ):
                results.update(rank_result)  # every rank returns the same full values
    return results


def assert_continues(results: dict, pairs) -> None:
    ref = reference()
    for src, dst in pairs:
        got = results[(src, dst)]
        label = f"{CONFIGS[src]} -> {CONFIGS[dst]}"
        assert got["step"] == 6, label
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"][3:], strict=True)):
            assert abs(a - b) <= RTOL * abs(b), f"{label}: loss at step {step + 3}: {a} vs {b}"
        for name, want in ref["params"].items():
            rel = float((got["params"][name] - want).norm() / want.norm())
            assert rel <= RTOL, f"{label}: {name} rel {rel:.2e}"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return run_matrix(tmp_path_factory.mktemp("matrix"), ALL_PAIRS)


@pytest.mark.reshard  # `make test-reshard` (and .ci/run): every layout pair, minutes
def test_reshard_matrix_all_pairs(matrix):
    assert len(ALL_PAIRS) == 100
    assert_continues(matrix, ALL_PAIRS)
    # RNG states come back exactly when the world size is the same.
    assert all(r["rng"] == (CONFIGS[s][1] == CONFIGS[d][1]) for (s, d), r in matrix.items())


@pytest.mark.reshard
def test_reshard_check_can_fail_without_optimizer_state(tmp_path):
    pairs = [(4, 9)]  # full_shard w2 -> hybrid_shard w4, model only
    results = run_matrix(tmp_path, pairs, load_optimizer=False)
    with pytest.raises(AssertionError, match="loss at step"):
        assert_continues(results, pairs)


# --- contents, listing, pruning --------------------------------------------------------------


def _message(fn) -> str:
    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def _unreadable(path: Path) -> str:
    raise OSError("read error")


def save_twice_keep_one(root: str) -> dict:
    import shardwise.checkpoint as ck
    from shardwise.checkpoint import layout

    engine = engine_for("full_shard")
    for batch in DATA[:3]:
        train(engine, [batch])
        save_checkpoint(root, engine, keep_last=2, extra={"note": "hello"})
    out: dict = {"rank": dist.get_rank()}
    # Rank 1 fails to hash its share of the files: the save fails on every rank.
    original = layout._sha256
    if dist.get_rank() == 1:
        layout._sha256 = _unreadable
    train(engine, [DATA[3]])
    out["hash_failure"] = _message(lambda: save_checkpoint(root, engine, keep_last=2))
    layout._sha256 = original
    # A file in rank 1's share of the verification is corrupted: every rank refuses.
    latest = ck.resolve_checkpoint(root)
    victim = latest / sorted(ck.read_manifest(latest)["files"])[1]
    clean = victim.read_bytes()
    dist.barrier()
    if dist.get_rank() == 0:
        victim.write_bytes(clean[:-1] + bytes([clean[-1] ^ 0xFF]))
    dist.barrier()
    out["verify_failure"] = _message(lambda: load_checkpoint(root, engine_for("full_shard")))
    dist.barrier()
    if dist.get_rank() == 0:
        victim.write_bytes(clean)
    out["victim"] = str(victim.relative_to(latest))
    return out


def test_manifest_latest_and_keep_last(tmp_path):
    results = run_distributed(save_twice_keep_one, 2, args=(str(tmp_path),), timeout_s=120)
    assert results[0]["hash_failure"].startswith("could not write checkpoint step_00000004 under")
    assert "hashing the written files failed: rank 1: read error" in results[0]["hash_failure"]
    assert results[1]["hash_failure"].startswith("finalising the checkpoint failed on 1 other")
    victim = results[0]["victim"]
    for r in results:  # found by rank 1, reported identically by both
        assert r["verify_failure"] == results[0]["verify_failure"]
        assert f"(1 problem(s)): {victim}: content differs" in r["verify_failure"]
    complete = [c.path.name for c in list_checkpoints(tmp_path) if c.complete]
    assert complete == ["step_00000002", "step_00000003"]
    assert resolve_checkpoint(tmp_path).name == "step_00000003"
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    m = read_manifest(tmp_path)
    assert (m["step"], m["world_size"], m["strategy"], m["extra"]) == (
        3,
        2,
        "full_shard",
        {"note": "hello"},
    )
    assert m["versions"]["torch"] == torch.__version__ and m["optimizer"]["class"] == "AdamW"
    assert sorted(Path(f).parts[0] for f in m["files"]) == sorted(
        ["rng", "rng"] + ["state"] * (len(m["files"]) - 2)
    )
    assert verify_checkpoint(tmp_path) == []


# --- faults: SIGKILL mid-save, full disk, unwritable ------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys, time, signal, resource
    import torch
    import shardwise
    import shardwise.checkpoint as ck
    from shardwise.checkpoint import commit
    from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

    root, mode = sys.argv[1], sys.argv[2]
    shardwise.init_distributed()
    torch.manual_seed(0)
    engine = shardwise.Engine(GPT(GPTConfig()), lambda p: torch.optim.AdamW(p))
    batches = random_lm_batches(GPTConfig(), 2, 4)
    engine.train_step(batches[0])
    ck.save_checkpoint(root, engine)
    engine.train_step(batches[1])
    if mode == "kill":
        real = commit._finalize
        def slow_finalize(*args, **kwargs):
            print("SAVING", flush=True)
            time.sleep(60)
            real(*args, **kwargs)
        commit._finalize = slow_finalize
    elif mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        ck.save_checkpoint(root, engine)
        print("SAVED", flush=True)
    except ck.CheckpointError as exc:
        print("ERROR", exc, flush=True)
    """
)


def _child(tmp_path: Path, root: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.Popen(
        [sys.executable, str(script), str(root), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _assert_first_checkpoint_intact(root: Path) -> None:
    assert resolve_checkpoint(root).name == "step_00000001"
    assert verify_checkpoint(root) == []
    engine = Engine(GPT(CFG), adamw)
    assert load_checkpoint(root, engine)["step"] == 1 and engine.step == 1


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    proc = _child(tmp_path, root, "kill")
    try:
        line = proc.stdout.readline()
        assert line.strip() == "SAVING", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    listed = {(c.path.name, c.complete) for c in list_checkpoints(root)}
    assert listed == {("step_00000001", True), (".tmp-step_00000002", False)}
    _assert_first_checkpoint_intact(root)


def test_full_disk_gives_clear_error_and_loses_nothing(tmp_path):
    # RLIMIT_FSIZE makes the OS refuse the write (EFBIG), as a full disk refuses with ENOSPC.
    root = tmp_path / "ckpts"
    proc = _child(tmp_path, root, "fsize")
    out, err = proc.communicate(timeout=120)
    assert "ERROR could not write checkpoint step_00000002 under" in out, out + err
    assert (
        "The partial files were removed; earlier checkpoints are intact (latest: step_00000001)"
        in out
    )
    assert [c.path.name for c in list_checkpoints(root)] == ["step_00000001"]
    _assert_first_checkpoint_intact(root)


def test_real_full_disk_on_tmpfs(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the RLIMIT_FSIZE test covers the path")
    try:
        proc = _child(tmp_path, mount, "plain")
        out, err = proc.communicate(timeout=120)
        assert "could not write checkpoint step_00000002" in out, out + err
        assert "earlier checkpoints are intact (latest: step_00000001)" in out
        assert "Free space on that filesystem:" in out
        _assert_first_checkpoint_intact(mount)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    engine = Engine(GPT(CFG), adamw)
    engine.train_step(DATA[0])
    with pytest.raises(
        CheckpointError,
        match=r"cannot create the checkpoint directory .*a_file/.tmp-step_00000001: .*(Not a directory|File exists).*\. Nothing was written",
    ):
        save_checkpoint(blocker, engine)


# --- bad input --------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    engine = Engine(GPT(CFG), adamw)
    engine.train_step(DATA[0])
    return save_checkpoint(tmp_path / "ck", engine)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint path .*nowhere does not exist"):
        load_checkpoint(tmp_path / "nowhere", Engine(GPT(CFG), adamw))


def test_checkpoint_from_a_different_model(saved):
    other = Engine(GPT(GPTConfig(d_model=48, n_layers=3)), adamw)
    with pytest.raises(
        CheckpointError,
        match=r"was saved from a different model\. Missing from the checkpoint: \['blocks\.2\.attn\.proj\.bias'.*Unexpected in the checkpoint: \[\]\. Shape mismatches: \['blocks\.0\.attn\.proj\.bias: checkpoint \(32,\) vs model \(48,\)'",
    ):
        load_checkpoint(saved, other)


def test_other_optimizer_class(saved):
    engine = Engine(GPT(CFG), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(
        CheckpointError, match=r"holds AdamW state but the engine uses SGD.*load_optimizer=False"
    ):
        load_checkpoint(saved, engine)
    assert load_checkpoint(saved, engine, load_optimizer=False)["step"] == 1


def test_corrupted_file_is_detected(saved):
    shard = next((saved / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert any("content differs from the recorded SHA-256" in p for p in verify_checkpoint(saved))
    with pytest.raises(
        CheckpointError,
        match=r"failed verification \(1 problem\(s\)\): state/__0_0\.distcp: content differs",
    ):
        load_checkpoint(saved, Engine(GPT(CFG), adamw))


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/shardwise_pwned",))


def test_malicious_pickle_is_refused(saved):
    import pickle

    marker = Path("/tmp/shardwise_pwned")
    marker.unlink(missing_ok=True)
    (saved / "state" / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(
        CheckpointError,
        match=r"\.metadata is not a valid checkpoint metadata file and was not loaded \(refused to load global posix\.system",
    ):
        read_dcp_metadata(saved / "state")
    with pytest.raises(CheckpointError, match=r"refused to load global posix\.system"):
        load_checkpoint(saved, Engine(GPT(CFG), adamw), verify=False)
    with pytest.raises(CheckpointError, match=r"failed verification"):
        load_checkpoint(saved, Engine(GPT(CFG), adamw))
    assert not marker.exists()


def test_dropped_in_pickle_is_flagged(saved):
    import pickle

    (saved / "evil.pt").write_bytes(pickle.dumps(_Exploit()))
    assert "evil.pt: not part of the checkpoint (unexpected file)" in verify_checkpoint(saved)
    with pytest.raises(CheckpointError, match=r"evil\.pt: not part of the checkpoint"):
        load_checkpoint(saved, Engine(GPT(CFG), adamw))


def test_save_mid_accumulation_refused(tmp_path):
    from shardwise import TrainConfig

    engine = Engine(GPT(CFG), adamw, train=TrainConfig(accumulate_steps=2))
    engine.train_step(DATA[0])
    with pytest.raises(
        CheckpointError, match=r"the engine is 1 micro-batch\(es\) into an accumulation window"
    ):
        save_checkpoint(tmp_path, engine)


def test_same_step_twice_moves_the_first_aside(saved):
    # Once refused ("already exists"), which under torchrun --max-restarts was a crash loop.
    engine = Engine(GPT(CFG), adamw, ParallelConfig())
    engine.train_step(DATA[1])
    assert save_checkpoint(saved.parent, engine) == saved
    (aside,) = (saved.parent / "superseded").glob("*/step_00000001")
    assert verify_checkpoint(aside) == [] and verify_checkpoint(saved) == []
    old, new = read_manifest(aside)["files"], read_manifest(saved)["files"]
    assert old["state/__0_0.distcp"] != new["state/__0_0.distcp"]  # two different states


def teardown_module():
    shutil.rmtree("/tmp/shardwise_pwned", ignore_errors=True)


def _scheduled_run(root: Path | None, steps: range, *, seed: int = 0) -> dict:
    """AdamW with a StepLR that halves the lr each update, and a weight decay the user
    changes after the second update: the saved param_groups hold neither initial value."""
    torch.manual_seed(seed)
    engine = Engine(
        GPT(CFG),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )
    if root is not None and steps.start > 0:
        load_checkpoint(root, engine)
    out: dict = {"lr": [], "wd": [], "losses": []}
    for i in steps:
        if i == 2:
            engine.optimizer.param_groups[0]["weight_decay"] = 0.5
        group = engine.optimizer.param_groups[0]
        out["lr"].append(group["lr"])
        out["wd"].append(group["weight_decay"])
        out["losses"].append(engine.train_step(DATA[i])["loss"])
    if root is not None and steps.start == 0:
        save_checkpoint(root, engine)
    out["params"] = full_parameters(engine.model)
    return out


def test_resume_restores_the_learning_rate_schedule(tmp_path):
    # DCP fills the optimizer's state tensors in place; lr and weight decay live only in
    # param_groups, so a resume that drops them trains on silently with the initial values.
    whole = _scheduled_run(None, range(5))
    _scheduled_run(tmp_path, range(3))
    resumed = _scheduled_run(tmp_path, range(3, 5), seed=1234)  # another init: the load wins
    assert whole["lr"] == [1e-2, 5e-3, 2.5e-3, 1.25e-3, 6.25e-4]
    assert resumed["lr"] == whole["lr"][3:]
    assert resumed["wd"] == whole["wd"][3:] == [0.5, 0.5]
    for a, b in zip(resumed["losses"], whole["losses"][3:], strict=True):
        assert abs(a - b) <= RTOL * abs(b), (resumed["losses"], whole["losses"])
    for name, want in whole["params"].items():
        rel = float((resumed["params"][name] - want).norm() / want.norm())
        assert rel <= RTOL, f"{name} rel {rel:.2e}"
