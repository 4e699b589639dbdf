"""Runner with 2 processes: rank 0 prints and writes, other ranks stay silent; seeds repeat."""

from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from shardwise import Engine, ParallelConfig, Runner, RunnerConfig, TrainConfig
from shardwise.models import GPT, GPTConfig, random_lm_batches
from shardwise.testing import run_distributed

CFG = GPTConfig()


def dataset(n, seed):
    return TensorDataset(*random_lm_batches(CFG, 1, n, seed=seed)[0])


def fit(run_dir: str, seed: int, progress: bool = True) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        torch.manual_seed(0)
        engine = Engine(
            GPT(CFG),
            lambda p: torch.optim.AdamW(p, lr=3e-3),
            ParallelConfig(),
            train=TrainConfig(accumulate_steps=2),
        )
        config = RunnerConfig(
            run_dir=run_dir,
            batch_size=2,
            max_steps=6,
            max_epochs=None,
            log_every=2,
            val_every=3,
            seed=seed,
            progress=progress,
        )
        summary = Runner(engine, dataset(40, 1), dataset(8, 2), config=config).fit()
    return {"stdout": out.getvalue(), "stderr": err.getvalue(), "summary": summary}


def cases(tmp: str) -> dict:
    rank = dist.get_rank()
    first = fit(f"{tmp}/a", seed=3)
    again = fit(f"{tmp}/b", seed=3, progress=False)
    other = fit(f"{tmp}/c", seed=4, progress=False)
    return {"rank": rank, "first": first, "again": again, "other": other}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return tmp, run_distributed(cases, 2, args=(str(tmp),), timeout_s=240)


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_only_rank_zero_prints(results):
    _, (r0, r1) = results
    assert r1["first"]["stdout"] == "" and r1["first"]["stderr"] == ""
    shown = r0["first"]["stdout"] + r0["first"]["stderr"]
    assert "train" in shown and "6/6" in shown and "loss" in shown and "tok/s" in shown


def test_one_csv_row_per_logged_step(results):
    tmp, _ = results
    rows = _rows(tmp / "a" / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["split"] == "train"] == [2, 4, 6]
    assert [int(r["step"]) for r in rows if r["split"] == "val"] == [3, 6]
    assert sorted(p.name for p in (tmp / "a").iterdir() if p.is_file()) == ["metrics.csv"]


def test_same_seed_same_losses_on_two_ranks(results):
    tmp, (r0, r1) = results
    a = [r["loss"] for r in _rows(tmp / "a" / "metrics.csv")]
    b = [r["loss"] for r in _rows(tmp / "b" / "metrics.csv")]
    c = [r["loss"] for r in _rows(tmp / "c" / "metrics.csv")]
    assert a == b and a != c
    assert r0["first"]["summary"]["train"]["loss"] == r1["first"]["summary"]["train"]["loss"]


# --- exact resume -------------------------------------------------------------------------

DROPOUT_CFG = GPTConfig(dropout=0.1)  # dropout draws from the RNG: resume must restore it


def resume_run(run_dir: str, max_steps: int, resume: str | None, init_seed: int = 0) -> list[dict]:
    torch.manual_seed(init_seed)
    engine = Engine(
        GPT(DROPOUT_CFG),
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        ParallelConfig(),
        train=TrainConfig(accumulate_steps=2),
    )
    config = RunnerConfig(
        run_dir=run_dir, batch_size=2, max_steps=max_steps, max_epochs=None, seed=7,
        save_every=3, save_at_end=True, resume=resume, progress=False,
    )  # fmt: skip
    Runner(engine, dataset(40, 1), config=config).fit()  # 10 batches/rank/epoch = 5 steps
    return []


def resume_cases(tmp: str) -> dict:
    resume_run(f"{tmp}/full", 8, None)  # uninterrupted: checkpoints at 3, 6 and 8
    resume_run(f"{tmp}/from3", 8, f"{tmp}/full/checkpoints/step_00000003", init_seed=99)
    resume_run(f"{tmp}/same", 3, "latest")  # 'latest' with nothing saved: a fresh start
    resume_run(f"{tmp}/same", 8, "latest", init_seed=99)  # preempted at 3, rerun as is
    return {}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    run_distributed(resume_cases, 2, args=(str(tmp),), timeout_s=240)
    return tmp


def _train_rows(path: Path) -> list[tuple[str, str, str, str]]:
    return [
        (r["step"], r["epoch"], r["loss"], r["grad_norm"])
        for r in _rows(path)
        if r["split"] == "train"
    ]


def test_resumed_run_equals_uninterrupted_exactly(resumed):
    full = _train_rows(resumed / "full" / "metrics.csv")
    assert [int(r[0]) for r in full] == list(range(1, 9))
    assert {r[1] for r in full} == {"0", "1"}  # crosses an epoch boundary after the resume point
    assert _train_rows(resumed / "from3" / "metrics.csv") == full[3:]  # bit-for-bit, as strings


def test_resume_latest_in_the_same_run_dir(resumed):
    assert _train_rows(resumed / "same" / "metrics.csv") == _train_rows(
        resumed / "full" / "metrics.csv"
    )
    names = sorted(p.name for p in (resumed / "same" / "checkpoints").iterdir())
    assert names == ["latest", "step_00000003", "step_00000006", "step_00000008"]
