"""Runner at world size 1: loops, CSV rows, validation, plot, seeds and bad input."""

from __future__ import annotations

import csv
import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardwise import Engine, Runner, RunnerConfig, TrainConfig
from shardwise.cli import main as cli_main
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.train import PREEMPTED_EXIT_CODE, Preempted
from shardwise.train.resume import Interrupted

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

    first = losses(5, "a")
    assert first == losses(5, "b")
    assert first != losses(6, "c")


def test_plot_command_writes_png(tmp_path):
    make_runner(tmp_path, batch_size=4, max_steps=4, max_epochs=None, val_every=2).fit()
    assert cli_main(["plot", str(tmp_path / "run")]) == 0
    png = (tmp_path / "run" / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_rows_record_the_data_parallel_ranks_and_the_plot_marks_a_change(tmp_path):
    from shardwise.train.plot import world_changes

    make_runner(tmp_path, batch_size=4, max_steps=2, max_epochs=None).fit()
    train = [r for r in rows(tmp_path) if r["split"] == "train"]
    assert train and all(int(r["dp_world"]) == 1 for r in train)
    resumed = [
        {"split": "train", "step": 1, "dp_world": 4},
        {"split": "val", "step": 1},
        {"split": "train", "step": 2, "dp_world": 4},
        {"split": "train", "step": 3, "dp_world": 2},  # a node lost, resumed on 2 ranks
        {"split": "train", "step": 4, "dp_world": 2},
        {"split": "train", "step": 5},  # an older run's row: no record, no change
        {"split": "train", "step": 6, "dp_world": 4},
    ]
    assert world_changes(resumed) == [(3, 4, 2), (6, 2, 4)]


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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_epochs": None, "max_steps": None}, r"max_epochs and max_steps are both None"),
        ({"batch_size": 0}, r"RunnerConfig\.batch_size=0 must be a positive int"),
        ({"val_every": 0}, r"RunnerConfig\.val_every=0 must be a positive int or None"),
        ({"log_every": -1}, r"RunnerConfig\.log_every=-1 must be a positive int"),
        ({"stream_parts": 0}, r"RunnerConfig\.stream_parts=0 must be a positive int"),
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


# --- a run directory belongs to one run ---------------------------------------------------


def test_fresh_run_over_an_earlier_one_refuses_and_deletes_nothing(tmp_path):
    make_runner(tmp_path, batch_size=4, max_steps=2, max_epochs=None, save_at_end=True).fit()
    csv_before = (tmp_path / "run" / "metrics.csv").read_bytes()
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    again = make_runner(tmp_path, batch_size=4, max_steps=2, max_epochs=None, save_at_end=True)
    with pytest.raises(
        ValueError,
        match=r"RunnerConfig\.run_dir='.*run' already holds a run \(1 checkpoint\(s\) in .*, "
        r"the newest step_00000002; metrics in .*metrics\.csv\) and RunnerConfig\.resume=None "
        r"starts a fresh one.*Set resume='latest' to continue that run, or choose a new "
        r"run_dir to start over",
    ):
        again.fit()
    assert again.engine.step == 0  # refused before training
    assert (tmp_path / "run" / "metrics.csv").read_bytes() == csv_before
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ckpts
    # Metrics alone (a run that never saved) are refused too; resume='latest' continues.
    (tmp_path / "only" / "run").mkdir(parents=True)
    (tmp_path / "only" / "run" / "metrics.csv").write_text("step,split,loss\n1,train,4.0\n")
    with pytest.raises(ValueError, match=r"already holds a run \(metrics in "):
        make_runner(tmp_path / "only", max_steps=1, max_epochs=None).fit()
    resumed = make_runner(
        tmp_path, batch_size=4, max_steps=3, max_epochs=None, resume="latest"
    ).fit()
    assert resumed["steps"] == 3


def test_resume_from_an_older_checkpoint_sets_the_newer_aside_and_continues(tmp_path):
    make_runner(tmp_path, batch_size=4, max_steps=6, max_epochs=None, save_every=2).fit()
    ckpts = tmp_path / "run" / "checkpoints"
    older = str(ckpts / "step_00000002")
    summary = make_runner(
        tmp_path, batch_size=4, max_steps=6, max_epochs=None, save_every=2, resume=older
    ).fit()
    assert summary["steps"] == 6
    aside = sorted(
        p.name
        for p in (ckpts / "superseded").rglob("step_*")
        if p.parent.parent.name == "superseded"
    )
    assert aside == ["step_00000004", "step_00000006"]  # moved, not deleted
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert [int(r["step"]) for r in rows(tmp_path) if r["split"] == "train"] == list(range(1, 7))


def test_validate_and_test_append_to_an_earlier_run_without_deleting(tmp_path):
    make_runner(tmp_path, batch_size=4, max_steps=2, max_epochs=None).fit()
    before = rows(tmp_path)
    runner = make_runner(tmp_path, batch_size=4)
    runner.test()  # evaluating a finished run in a new process: its rows stay
    assert rows(tmp_path)[: len(before)] == before and rows(tmp_path)[-1]["split"] == "test"


def test_unwritable_checkpoint_dir_is_found_before_the_first_step(tmp_path):
    (tmp_path / "a_file").write_text("")
    runner = make_runner(
        tmp_path, max_steps=5, max_epochs=None, save_every=5,
        checkpoint_dir=str(tmp_path / "a_file" / "ckpt"),
    )  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"cannot write where this run writes: RunnerConfig\.checkpoint_dir='.*a_file/ckpt' "
        r"is not writable \(.*\)\. Choose directories this process can create and write",
    ):
        runner.fit()
    assert runner.engine.step == 0
    runner = make_runner(tmp_path, max_steps=1, max_epochs=None)
    runner.config.run_dir = str(tmp_path / "a_file" / "run")
    with pytest.raises(ValueError, match=r"RunnerConfig\.run_dir='.*a_file/run' is not writable"):
        runner.fit()


# --- preemption at world size 1 (tests/distributed/test_preemption.py: 2 processes) -------


class SignalAt(TensorDataset):
    """Sends this process SIGTERM (or `sig`) when the `at`-th sample is read (as a
    scheduler would)."""

    def __init__(self, at: int | None, *tensors, sig: int = signal.SIGTERM):
        super().__init__(*tensors)
        self.at, self.reads, self.sig = at, 0, sig

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.at:
            os.kill(os.getpid(), self.sig)
        return super().__getitem__(i)


def preemptible(tmp_path, at, *, resume=None, k=1, sig=signal.SIGTERM):
    torch.manual_seed(0)
    engine = Engine(
        GPT(CFG), lambda p: torch.optim.AdamW(p, lr=3e-3), train=TrainConfig(accumulate_steps=k)
    )
    config = RunnerConfig(
        run_dir=str(tmp_path), progress=False, batch_size=2, max_steps=6, max_epochs=None,
        resume=resume,
    )  # fmt: skip
    return Runner(engine, SignalAt(at, *lm_dataset(24).tensors, sig=sig), config=config)


def params(runner):
    return {n: p.detach().clone() for n, p in runner.engine.model.state_dict().items()}


def test_sigterm_finishes_the_window_saves_and_exits_75_then_resumes_exactly(tmp_path):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
    try:
        full = preemptible(tmp_path / "full", None, k=2)
        full.fit()
        # Sample 7 is read in micro-batch 4 (batch 2): the window of micro-batches 3-4 ends
        # there, so the Runner stops after step 2; at sample 5 (micro-batch 3) it still
        # finishes micro-batch 4 first.
        for at in (7, 5):
            cut = preemptible(tmp_path / f"cut{at}", at, k=2)
            with pytest.raises(Preempted) as stopped:
                cut.fit()
            assert stopped.value.code == PREEMPTED_EXIT_CODE == 75 and stopped.value.step == 2
            assert (tmp_path / f"cut{at}" / "checkpoints" / "step_00000002").is_dir()
            assert cut.engine.micro_step == 0
        assert calls == []  # fit's own handler took them
        resumed = preemptible(tmp_path / "cut7", None, resume="latest", k=2)
        assert resumed.fit()["steps"] == 6
        got, want = params(resumed), params(full)
        assert all(torch.equal(got[n], want[n]) for n in want)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler in place again is the previous one
        assert len(calls) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_slurms_sigusr1_saves_and_exits_75_like_sigterm(tmp_path):
    # SLURM's warning signal (--signal=USR1@60, scancel --signal=USR1): its default action
    # would end the process unsaved.
    calls = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: calls.append(a))
    try:
        cut = preemptible(tmp_path / "cut", 7, k=2, sig=signal.SIGUSR1)
        with pytest.raises(Preempted) as stopped:
            cut.fit()
        assert stopped.value.code == 75 and stopped.value.step == 2
        assert str(stopped.value).startswith("SIGUSR1: stopped after optimizer step 2 and saved")
        assert calls == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the previous handler is back
        assert len(calls) == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)


class SignalsAt(TensorDataset):
    """Sends this process `sig` when each of the `at` samples is read (Ctrl-C, pressed
    once or twice)."""

    def __init__(self, at: tuple[int, ...], *tensors, sig: int = signal.SIGINT):
        super().__init__(*tensors)
        self.at, self.reads, self.sig = at, 0, sig

    def __getitem__(self, i):
        self.reads += 1
        if self.reads in self.at:
            os.kill(os.getpid(), self.sig)
        return super().__getitem__(i)


def interruptible(tmp_path, at, *, save_every=None):
    torch.manual_seed(0)
    engine = Engine(
        GPT(CFG), lambda p: torch.optim.AdamW(p, lr=3e-3), train=TrainConfig(accumulate_steps=2)
    )
    config = RunnerConfig(
        run_dir=str(tmp_path), progress=False, batch_size=2, max_steps=6, max_epochs=None,
        save_every=save_every,
    )  # fmt: skip
    return Runner(engine, SignalsAt(at, *lm_dataset(24).tensors), config=config)


def test_a_first_ctrl_c_finishes_the_step_and_saves_like_sigterm(tmp_path, capsys):
    """Before: KeyboardInterrupt wherever the step was, nothing saved."""
    try:
        cut = interruptible(tmp_path, (7,))  # micro-batch 4 of window 2 (see above)
        with pytest.raises(Preempted) as stopped:
            try:
                cut.fit()
            except KeyboardInterrupt:
                pytest.fail("the Ctrl-C reached the caller as KeyboardInterrupt")
        saved = tmp_path / "checkpoints" / "step_00000002"
        line = (
            f"SIGINT: stopped after optimizer step 2 and saved {saved}; exiting with code 75. "
            "Start the job again with RunnerConfig.resume='latest' to continue from it."
        )
        assert (stopped.value.code, str(stopped.value)) == (75, line) and saved.is_dir()
        assert capsys.readouterr().err == f"shardwise: {line}\n"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.mark.parametrize("save_every", [1, None])
def test_a_second_ctrl_c_stops_at_once_naming_the_last_good_checkpoint(
    tmp_path, capsys, save_every
):
    """Samples 9 and 10 are micro-batch 5, the first of step 3's window: the second Ctrl-C
    comes before that step could end, and stops it there, unsaved."""
    try:
        cut = interruptible(tmp_path, (9, 10), save_every=save_every)
        with pytest.raises(Interrupted) as stopped:
            cut.fit()
        last = tmp_path / "checkpoints" / "step_00000002"
        where = (
            f"the last good checkpoint is {last} (resume='latest' continues from it)"
            if save_every
            else "there is no complete checkpoint to continue from"
        )
        line = f"SIGINT again: stopped at once after optimizer step 2, without saving; {where}."
        assert (stopped.value.code, str(stopped.value)) == (130, line)
        assert capsys.readouterr().err == f"shardwise: {line}\n"
        assert not (tmp_path / "checkpoints" / "step_00000003").exists()
        # A third SIGINT (or the launcher's copy of the second) cannot cut the exit short.
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_stop_on_sigterm_false_leaves_the_handler_alone(tmp_path):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
    try:
        runner = preemptible(tmp_path, 3)
        runner.config.stop_on_sigterm = False
        assert runner.fit()["steps"] == 6 and len(calls) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _init_worker(worker_id: int) -> None:  # a user's worker_init_fn
    pass


def test_a_users_dataloader_keeps_its_settings():
    # Before: rebuilt without pin_memory, persistent_workers, prefetch_factor or
    # worker_init_fn, so batches copied to the GPU from pageable memory.
    from shardwise.train.data import make_loader

    data = TensorDataset(torch.arange(16.0))
    given = DataLoader(
        data,
        batch_size=2,
        num_workers=2,
        pin_memory=True,
        persistent_workers=True,
        prefetch_factor=3,
        worker_init_fn=_init_worker,
    )
    got = make_loader(given, "train_data", True, RunnerConfig(), rank=0, world=2)
    assert got is not None and got is not given
    assert (got.pin_memory, got.persistent_workers, got.prefetch_factor) == (True, True, 3)
    assert got.worker_init_fn is _init_worker and got.num_workers == 2
    assert got.sampler.num_replicas == 2  # only the sampler is ours
    plain = make_loader(data, "train_data", True, RunnerConfig(), 0, 1, pin_memory=True)
    assert plain is not None and plain.pin_memory  # a CUDA job's own batches are pinned


def test_a_resume_says_where_from_and_names_what_changed(tmp_path, capsys):
    # Before: nothing said the run resumed, and a new optimizer.lr was silently ignored
    # (the checkpoint's optimizer state wins).
    make_runner(tmp_path, batch_size=4, max_steps=3, max_epochs=None, save_at_end=True).fit()
    capsys.readouterr()
    torch.manual_seed(0)
    engine = Engine(
        GPT(CFG),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        train=TrainConfig(max_grad_norm=2.0),
    )
    config = RunnerConfig(
        run_dir=str(tmp_path / "run"), progress=False, batch_size=4, max_steps=5,
        max_epochs=None, resume="latest",
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"resuming with a config that differs") as caught:
        Runner(engine, lm_dataset(), config=config).fit()
    said = str(caught[0].message)
    assert "optimizer.lr: checkpoint 0.003, now 0.01 (the checkpoint's is used)" in said
    assert "train.max_grad_norm: checkpoint None, now 2.0 (now's is used)" in said
    assert "runner.max_steps: checkpoint 3, now 5 (now's is used)" in said
    err = capsys.readouterr().err
    assert f"resumed from step 3 of {tmp_path / 'run' / 'checkpoints' / 'step_00000003'}" in err
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3)


def test_an_unchanged_resume_warns_nothing_even_with_a_scheduler():
    from shardwise.train.resume import config_changes

    saved = {
        "optimizer": {"param_groups": [{"lr": 1.25e-4, "initial_lr": 1e-3, "betas": [0.9, 0.99]}]}
    }
    fresh = [{"lr": 1e-3, "initial_lr": 1e-3, "betas": (0.9, 0.99)}]
    assert config_changes(saved, TrainConfig(), fresh) == []  # the schedule moved lr, not you
    fresh[0]["initial_lr"] = 2e-3
    assert config_changes(saved, TrainConfig(), fresh) == [
        "optimizer.lr: checkpoint 0.001, now 0.002 (the checkpoint's is used)"
    ]


def test_resuming_before_a_checkpoint_keeps_the_earlier_metrics(tmp_path):
    # Before: resume='latest' with no checkpoint yet cut metrics.csv to step 0, losing an
    # earlier run's rows.
    from shardwise.train.metrics import MetricsLogger, read_metrics

    first = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    first.start()
    for step in (1, 2, 3):
        first.log({"step": step, "split": "train", "loss": 1.0 / step})
    first.close()
    again = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    again.start(keep_until_step=0)
    again.log({"step": 1, "split": "train", "loss": 0.5})
    again.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    kept = (tmp_path / "metrics.1.csv").read_text().splitlines()
    assert len(kept) == 4 and kept[0].startswith("step")  # header + the 3 earlier rows


def test_a_resumed_run_keeps_the_earlier_export(tmp_path, capsys):
    # Before: the resumed run's export at its end replaced the earlier run's export.
    make_runner(tmp_path, batch_size=4, max_steps=2, max_epochs=None, save_at_end=True).fit()
    export = tmp_path / "run" / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"the first run's weights")
    config = RunnerConfig(
        run_dir=str(tmp_path / "run"), progress=False, batch_size=4, max_steps=3,
        max_epochs=None, resume="latest",
    )  # fmt: skip
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), lambda p: torch.optim.AdamW(p, lr=3e-3))
    with pytest.warns(UserWarning, match=r"runner.max_steps: checkpoint 2, now 3"):
        Runner(engine, lm_dataset(), config=config).fit()
    kept = tmp_path / "run" / "export.1" / "model.safetensors"
    assert kept.read_bytes() == b"the first run's weights" and not export.exists()
    assert f"the earlier run's {export} was kept as {kept.parent}" in capsys.readouterr().err


def test_max_steps_below_the_checkpoints_step_is_refused(tmp_path, capsys):
    # Before: the run resumed, trained nothing and reported "done".
    make_runner(tmp_path, batch_size=4, max_steps=3, max_epochs=None, save_at_end=True).fit()
    capsys.readouterr()

    def again(max_steps: int) -> Runner:
        config = RunnerConfig(
            run_dir=str(tmp_path / "run"), progress=False, batch_size=4, max_steps=max_steps,
            max_epochs=None, resume="latest",
        )  # fmt: skip
        engine = Engine(GPT(CFG), lambda p: torch.optim.AdamW(p, lr=3e-3))
        return Runner(engine, lm_dataset(), config=config)

    with pytest.raises(
        ValueError,
        match=r"max_steps=2 is below step 3 of the checkpoint .*step_00000003.*Set max_steps above 3",
    ):
        again(2).fit()
    assert again(3).fit()["steps"] == 3
    assert "the run is already complete at step 3 (max_steps=3)" in capsys.readouterr().err


@pytest.mark.parametrize(("val_batches", "sizes"), [(2, [3, 3]), (None, [3, 3, 2])])
def test_validation_reads_val_batches_batches_and_weights_each_by_its_samples(
    tmp_path, val_batches, sizes
):
    runner = make_runner(
        tmp_path, batch_size=3, max_steps=1, max_epochs=None, val_batches=val_batches
    )
    losses: list[tuple[int, float]] = []
    real_step = runner.engine.val_step

    def val_step(batch):
        out = real_step(batch)
        losses.append((len(batch[0]), float(out["loss"] if isinstance(out, dict) else out)))
        return out

    runner.engine.val_step = val_step
    result = runner.validate()
    assert [n for n, _ in losses] == sizes  # 8 samples in batches of 3: 3, 3, 2
    want = sum(n * loss for n, loss in losses) / sum(n for n, _ in losses)
    assert result["loss"] == pytest.approx(want, rel=1e-6)


def test_a_checkpoint_interval_in_minutes(tmp_path, monkeypatch):
    import shardwise.train.runner as runner_module

    clock = [1000.0]  # the Runner's monotonic clock, advanced 40 s before every update
    real = runner_module._timer_due

    def due(config, since):
        clock[0] += 40.0
        return real(config, since)

    monkeypatch.setattr(runner_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(runner_module, "_timer_due", due)
    make_runner(tmp_path, batch_size=4, max_steps=6, max_epochs=None, save_every_minutes=1.5).fit()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == ["step_00000003", "step_00000006"]  # 120 s >= 90 s, then again
    with pytest.raises(ValueError, match=r"save_every_minutes=0 must be a positive number"):
        RunnerConfig(save_every_minutes=0)


@pytest.mark.parametrize(
    ("tp", "pp", "cp", "expected"),
    [(1, 1, 1, (3, 4)), (2, 1, 1, (1, 2)), (1, 2, 1, (1, 2)), (2, 2, 1, (1, 2)), (1, 1, 2, (1, 2))],
)
def test_the_ranks_of_a_tp_group_or_a_pipeline_read_the_same_rows(
    monkeypatch, tp, pp, cp, expected
):
    """Issue 48: the Runner splits the data over the data-parallel ranks: under tp the
    ranks of one tp group, under cp those of one cp group (each attends to its part of the
    same rows; they read different rows before), and under pp the stages of one pipeline,
    read the same rows."""
    from types import SimpleNamespace

    import shardwise.train.runner as runner_module

    info = SimpleNamespace(mesh_spec=SimpleNamespace(tp=tp, pp=pp, cp=cp), dp_rank=1, dp_size=2)
    monkeypatch.setattr(runner_module, "wrap_info", lambda model: info)
    engine = SimpleNamespace(model=None)
    assert runner_module._data_parallel(engine, 3, 4) == expected  # type: ignore[arg-type]


def test_the_last_step_of_epochs_with_partial_windows_is_always_logged(tmp_path):
    """4 batches an epoch at accumulation 3: windows of 3 and 1, 2 steps an epoch, 4 in
    all. Counted short (a floor: 1 an epoch), the run's last step was taken for an earlier
    one, so its row was lost and another logged (third audit)."""
    from shardwise.train.runner import _total_steps

    summary = make_runner(
        tmp_path, train=TrainConfig(accumulate_steps=3), batch_size=8, max_epochs=2, log_every=3
    ).fit()
    assert summary["steps"] == 4
    assert [int(r["step"]) for r in rows(tmp_path) if r["split"] == "train"] == [3, 4]
    assert _total_steps(RunnerConfig(max_epochs=2, max_steps=None), 4, 3) == 4
    assert _total_steps(RunnerConfig(max_epochs=3, max_steps=5), 7, 2) == 5  # 4 an epoch
    assert _total_steps(RunnerConfig(max_epochs=1, max_steps=None), 7, 2) == 4


# --- what ended training ---------------------------------------------------------------


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.lin(x), y)


@pytest.mark.parametrize(
    ("max_steps", "max_epochs", "steps", "ended_by", "line"),
    [
        (6, None, 6, "max_steps=6", "finished after optimizer step 6: max_steps=6 reached"),
        # 16 samples in batches of 2, 2 per step: an epoch is 4 steps, and the default
        # max_epochs=1 ends the run before max_steps=6 (what 2 ranks did to the README's).
        (6, 1, 4, "max_epochs=1",
         "finished after optimizer step 4: max_epochs=1 reached, before max_steps=6 (an epoch "
         "is 4 optimizer step(s) at 1 data-parallel rank(s); max_epochs=None trains until "
         "max_steps)"),
        (None, 2, 8, "max_epochs=2",
         "finished after optimizer step 8: max_epochs=2 reached (an epoch is 4 optimizer "
         "step(s) at 1 data-parallel rank(s); max_epochs=None trains until max_steps)"),
        (8, 2, 8, "max_steps=8", "finished after optimizer step 8: max_steps=8 reached"),
    ],
    ids=["max_steps", "max_epochs_first", "max_epochs_alone", "both_at_once"],
)  # fmt: skip
def test_the_last_line_names_the_limit_that_ended_training(
    tmp_path, capsys, max_steps, max_epochs, steps, ended_by, line
):
    torch.manual_seed(0)
    engine = Engine(
        Regression(), lambda p: torch.optim.SGD(p, lr=0.1), train=TrainConfig(accumulate_steps=2)
    )
    config = RunnerConfig(
        run_dir=str(tmp_path), progress=False, batch_size=2, max_steps=max_steps,
        max_epochs=max_epochs,
    )  # fmt: skip
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    summary = Runner(engine, data, config=config).fit()
    assert (summary["steps"], summary["ended_by"]) == (steps, ended_by)
    assert capsys.readouterr().err == f"shardwise: {line}\n"
