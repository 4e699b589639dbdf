"""A plain training loop on what `shardwise.wrap` returned: checkpoints without an Engine
(saved at world 2, loaded at world 1 and resumed exactly), a cross-rank mean, rank-0
printing and the stall guard around a step."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.testing.parity import split_batch

CFG = GPTConfig()
DATA = random_lm_batches(CFG, 5, 8, seed=3)
RTOL = 1e-5


def _loop_objects(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return opt, sched


def _step(model, opt, sched, batch) -> torch.Tensor:
    with shardwise.guard("train step"):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return loss.detach()


def world2(root: str) -> dict:
    torch.manual_seed(0)
    model = shardwise.wrap(GPT(CFG), shardwise.ParallelConfig(strategy="full_shard"))
    opt, sched = _loop_objects(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"losses": [], "lrs": []}
    printed = io.StringIO()
    for i, batch in enumerate(DATA):
        if i == 3:
            path = shardwise.save_checkpoint(root, model, opt, step=3, scheduler=sched)
            out["saved"] = path.name
        out["lrs"].append(opt.param_groups[0]["lr"])
        loss = _step(model, opt, sched, split_batch(batch, rank, world))
        out["losses"].append(shardwise.mean_across_ranks(loss))
        with contextlib.redirect_stdout(printed):
            shardwise.print0(f"step {i + 1} loss {out['losses'][-1]:.4f}")
    out["printed"] = printed.getvalue()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    return root, run_distributed(world2, 2, args=(str(root),), timeout_s=180)


def test_a_plain_loop_saves_at_world_2_and_resumes_at_world_1(saved):
    root, (r0, r1) = saved
    assert r0["saved"] == r1["saved"] == "step_00000003"
    assert r0["losses"] == r1["losses"]  # the cross-rank mean is the same everywhere
    shardwise.shutdown()
    torch.manual_seed(1234)  # another init: the load must win
    model = shardwise.wrap(GPT(CFG))
    opt, sched = _loop_objects(model)
    manifest = shardwise.load_checkpoint(root, model, opt, scheduler=sched)
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    for i, batch in enumerate(DATA[3:], start=3):
        assert opt.param_groups[0]["lr"] == r0["lrs"][i]  # the schedule came back
        loss = float(_step(model, opt, sched, batch))
        assert abs(loss - r0["losses"][i]) <= RTOL * abs(loss), (i, loss, r0["losses"][i])


def test_rank_0_prints_once(saved):
    _, (r0, r1) = saved
    assert r0["printed"].splitlines()[0].startswith("step 1 loss ") and r1["printed"] == ""
    assert len(r0["printed"].splitlines()) == len(DATA)


def test_the_plain_loop_words_are_checked(tmp_path):
    model = shardwise.wrap(GPT(CFG))
    opt, _ = _loop_objects(model)
    with pytest.raises(TypeError, match=r"needs step, the optimizer steps done so far"):
        shardwise.save_checkpoint(tmp_path, model, opt)
    with pytest.raises(
        ValueError, match=r"save_checkpoint\(step=-1\) must be the optimizer steps done"
    ):
        shardwise.save_checkpoint(tmp_path, model, opt, step=-1)
    engine = shardwise.Engine(GPT(CFG), lambda p: torch.optim.AdamW(p))
    with pytest.raises(TypeError, match=r"an Engine carries its own optimizer, step"):
        shardwise.save_checkpoint(tmp_path, engine, step=3)
    # A model saved without its optimizer loads without one, and refuses to fill one.
    shardwise.save_checkpoint(tmp_path / "weights_only", model, step=0)
    assert shardwise.load_checkpoint(tmp_path / "weights_only", model)["optimizer"] is None
    with pytest.raises(shardwise.CheckpointError, match=r"holds no optimizer state"):
        shardwise.load_checkpoint(tmp_path / "weights_only", model, opt)
