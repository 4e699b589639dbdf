"""Runner at world size 1: loops, CSV rows, validation, plot, seeds and bad input."""

from __future__ import annotations

import csv

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from shardwise import Engine, Runner, RunnerConfig, TrainConfig
from shardwise.cli import main as cli_main
from shardwise.models import GPT, GPTConfig, random_lm_batches

CFG = GPTConfig()


def lm_dataset(n: int = 32, seed: int = 1) -> TensorDataset:
    x, y = random_lm_batches(CFG, 1, n, seed=seed)[0]
    return TensorDataset(x, y)


def make_runner(tmp_path, train=None, **cfg):
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), lambda p: torch.optim.AdamW(p, lr=3e-3), train=train)
    config = RunnerConfig(run_dir=str(tmp_path / "run"), progress=False, **cfg)
    return Runner(engine, lm_dataset(), lm_dataset(8, seed=2), lm_dataset(8, seed=3), config)


def rows(tmp_path):
    with (tmp_path / "run" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_one_csv_row_per_logged_step_and_val_every(tmp_path):
    summary = make_runner(
        tmp_path, batch_size=4, max_steps=6, max_epochs=None, log_every=2, val_every=3
    ).fit()
    assert summary["steps"] == 6
    train = [r for r in rows(tmp_path) if r["split"] == "train"]
    val = [r for r in rows(tmp_path) if r["split"] == "val"]
    assert [int(r["step"]) for r in train] == [2, 4, 6]
    assert [int(r["step"]) for r in val] == [3, 6]
    for r in train:
        assert (
            float(r["loss"]) > 0
            and float(r["grad_norm"]) > 0
            and float(r["lr"]) == pytest.approx(3e-3)
        )
        assert (
            float(r["tokens_per_s"]) > 0
            and float(r["samples_per_s"]) > 0
            and float(r["peak_mem_mb"]) > 0
        )
    assert summary["val"]["loss"] == pytest.approx(float(val[-1]["loss"]))


def test_epochs_with_accumulation_step_partial_windows(tmp_path):
    # 32 samples / batch 8 = 4 batches per epoch; k=3 gives windows of 3 and 1 per epoch.
    summary = make_runner(
        tmp_path, train=TrainConfig(accumulate_steps=3), batch_size=8, max_epochs=2
    ).fit()
    assert summary["steps"] == 4 and summary["epochs"] == 2
    assert [int(r["step"]) for r in rows(tmp_path) if r["split"] == "train"] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in rows(tmp_path) if r["split"] == "val"] == [
        2,
        4,
    ]  # each epoch end


def test_loss_falls_and_test_runs(tmp_path):
    runner = make_runner(tmp_path, batch_size=8, max_epochs=10)
    runner.fit()
    train = [float(r["loss"]) for r in rows(tmp_path) if r["split"] == "train"]
    assert train[-1] < train[0] - 0.3
    assert "loss" in runner.test()
    assert rows(tmp_path)[-1]["split"] == "test"


def test_same_seed_same_losses_other_seed_differs(tmp_path):
    def losses(seed, sub):
        make_runner(tmp_path / sub, batch_size=4, max_steps=4, max_epochs=None, seed=seed).fit()
        return [r["loss"] for r in rows(tmp_path / sub) if r["split"] == "train"]

    assert losses(5, "a") == losses(5, "b")
    assert losses(5, "a") != losses(6, "c")


def test_plot_command_writes_png(tmp_path):
    make_runner(tmp_path, batch_size=4, max_steps=4, max_epochs=None, val_every=2).fit()
    assert cli_main(["plot", str(tmp_path / "run")]) == 0
    png = (tmp_path / "run" / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_plot_of_missing_run(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path / "nope")]) == 2
    assert "metrics.csv does not exist: RUN_DIR must be a run directory" in capsys.readouterr().err


def test_empty_dataloader(tmp_path):
    engine = Engine(GPT(CFG), lambda p: torch.optim.AdamW(p))
    with pytest.raises(
        ValueError,
        match=r"Runner: train_data yields no batches: 3 sample\(s\) over 1 rank\(s\) with batch_size=4 and drop_last=True gives 0 batches per rank",
    ):
        Runner(
            engine,
            lm_dataset(3),
            config=RunnerConfig(batch_size=4, drop_last=True, run_dir=str(tmp_path)),
        )
    with pytest.raises(ValueError, match=r"val_data yields no batches: 0 sample"):
        Runner(
            engine,
            lm_dataset(3),
            DataLoader(TensorDataset(torch.zeros(0, 2))),
            config=RunnerConfig(run_dir=str(tmp_path)),
        )


def test_iterable_dataset_refused(tmp_path):
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(2)

    engine = Engine(GPT(CFG), lambda p: torch.optim.AdamW(p))
    with pytest.raises(
        TypeError, match=r"is an IterableDataset, which shardwise cannot split across ranks"
    ):
        Runner(engine, Stream(), config=RunnerConfig(run_dir=str(tmp_path)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_epochs": None, "max_steps": None}, r"max_epochs and max_steps are both None"),
        ({"batch_size": 0}, r"RunnerConfig\.batch_size=0 must be a positive int"),
        ({"val_every": 0}, r"RunnerConfig\.val_every=0 must be a positive int or None"),
        ({"log_every": -1}, r"RunnerConfig\.log_every=-1 must be a positive int"),
    ],
)
def test_runner_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunnerConfig(**kwargs)


def test_tensorboard_required_but_missing(tmp_path):
    pytest.importorskip("matplotlib")
    try:
        import tensorboard  # noqa: F401

        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    with pytest.raises(
        ImportError, match=r"RunnerConfig\.tensorboard=True but TensorBoard is not installed"
    ):
        make_runner(tmp_path, tensorboard=True)
