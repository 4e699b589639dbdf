"""Where a resume continues and what it says changed, entry by entry (the five habits of
docs/testing.md): the sampler's skip over two epochs, an older checkpoint's position at a
changed batch size, a skip that is exactly a rank's epoch, a DataLoader over a stream,
every field and hyperparameter a resume compares (and values that only look different),
and each trace of an earlier run."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from shardwise.config.training import RunnerConfig
from shardwise.train.data import ResumableSampler, make_loader, map_position
from shardwise.train.resume import config_changes, earlier_run, runner_changes


def test_the_sampler_skips_once_then_gives_whole_epochs() -> None:
    """The skip is where a resumed epoch starts; the epochs after it start from their first
    sample (two epochs: a skip that stayed would cut every later one)."""
    data = list(range(10))
    sampler = ResumableSampler(data, num_replicas=2, rank=1, shuffle=False)
    whole = list(sampler)
    assert whole == [1, 3, 5, 7, 9] and len(sampler) == 5
    sampler.skip = 3
    assert len(sampler) == 2
    assert list(sampler) == whole[3:]
    assert (len(sampler), list(sampler), list(sampler)) == (5, whole, whole)


def test_an_older_checkpoint_without_its_sample_count_resumes_at_a_new_batch_size() -> None:
    """Saved by 2 ranks of 4 rows, 5 batches into epoch 2, before checkpoints recorded the
    samples: 5 x 4 x 2 = 40 samples were trained, whatever this run's batch size."""
    position = {"epoch": 2, "batches_done": 5, "total_batches": 10, "world_size": 2,
                "batch_size": 4}  # fmt: skip
    loader = DataLoader(list(range(80)), batch_size=2)  # rows per batch halved
    assert map_position(position, 2, loader, 2, "latest") == (2, 40 // 2)
    assert map_position(position, 2, None, 4, "latest") == (2, 40 // 4)


@pytest.mark.parametrize(("samples", "expected"), [(40, (3, 0)), (41, (2, 40))])
def test_a_skip_of_a_whole_epoch_starts_the_next(samples: int, expected: tuple[int, int]) -> None:
    """Saved by 2 ranks, 5 of 10 batches: 40 samples into epoch 2. Resumed by one rank over
    data of 40 samples, a skip of 40 is the whole epoch (the next one starts at its first
    sample); over 41 it leaves one."""
    position = {"epoch": 2, "batches_done": 5, "total_batches": 10, "world_size": 2,
                "batch_size": 4, "samples_done": 40}  # fmt: skip
    data = list(range(samples))
    sampler = ResumableSampler(data, num_replicas=1, rank=0, shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    assert map_position(position, 2, loader, 1, "latest") == expected


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


@pytest.mark.parametrize("data", [_Stream(), DataLoader(_Stream(), batch_size=2)],
                         ids=["a stream", "a DataLoader over one"])  # fmt: skip
def test_a_stream_is_taken_bare_or_inside_a_dataloader(data: object) -> None:
    from shardwise.train.stream import StreamLoader

    loader = make_loader(data, "train_data", True, RunnerConfig(), rank=0, world=2)
    assert isinstance(loader, StreamLoader) and loader.batch_size == (
        2 if isinstance(data, DataLoader) else RunnerConfig().batch_size
    )


_SAVED = {"max_steps": 10, "max_epochs": 2, "batch_size": 4, "seed": 0}


@pytest.mark.parametrize(("field", "now"), [("max_steps", 20), ("max_epochs", 3),
                                            ("batch_size", 8), ("seed", 1)])  # fmt: skip
def test_every_runner_field_a_resume_compares_is_named_alone(field: str, now: int) -> None:
    config = RunnerConfig(**{**_SAVED, field: now})  # type: ignore[arg-type]
    assert runner_changes({"config": _SAVED}, config) == [
        f"runner.{field}: checkpoint {_SAVED[field]!r}, now {now!r} (now's is used)"
    ]
    assert runner_changes({"config": _SAVED}, RunnerConfig(**_SAVED)) == []  # type: ignore[arg-type]


_GROUP = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "momentum": 0.9}


@pytest.mark.parametrize(("key", "now"), [("lr", 2e-3), ("weight_decay", 0.1),
                                          ("betas", (0.8, 0.999)), ("eps", 1e-6),
                                          ("momentum", 0.5)])  # fmt: skip
def test_every_hyperparameter_a_resume_compares_is_named_alone(key: str, now: object) -> None:
    manifest = {"optimizer": {"param_groups": [dict(_GROUP)]}}
    said = config_changes(manifest, None, [{**_GROUP, key: now}])
    assert said == [
        f"optimizer.{key}: checkpoint {_GROUP[key]!r}, now {now!r} (the checkpoint's is used)"
    ]
    two = config_changes({"optimizer": {"param_groups": [dict(_GROUP)] * 2}}, None,
                         [dict(_GROUP), {**_GROUP, key: now}])  # fmt: skip
    assert [s.partition(":")[0] for s in two] == [f"optimizer param_groups[1].{key}"]


def test_values_that_only_look_different_are_not_named() -> None:
    """A checkpoint's JSON gives betas as a list, an int where a float was set, and a float
    computed another way: none of them is a change."""
    saved = {**_GROUP, "betas": [0.9, 0.999], "weight_decay": 0, "lr": 0.1 + 0.2}
    now = {**_GROUP, "weight_decay": 0.0, "lr": 0.3}
    assert config_changes({"optimizer": {"param_groups": [saved]}}, None, [now]) == []


def test_the_learning_rate_a_scheduler_moved_is_compared_by_its_start() -> None:
    saved = {**_GROUP, "lr": 1e-5, "initial_lr": 1e-3}  # a scheduler moved lr
    assert config_changes({"optimizer": {"param_groups": [saved]}}, None, [dict(_GROUP)]) == []
    said = config_changes({"optimizer": {"param_groups": [saved]}}, None, [{**_GROUP, "lr": 2e-3}])
    assert said == ["optimizer.lr: checkpoint 0.001, now 0.002 (the checkpoint's is used)"]


@pytest.mark.parametrize("trace", ["metrics", "tensorboard", "checkpoint"])
def test_each_trace_of_an_earlier_run_is_named(tmp_path, trace: str) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    config = RunnerConfig(run_dir=str(run))
    assert earlier_run(config) == ""
    if trace == "metrics":
        (run).mkdir()
        (run / "metrics.csv").write_text("step,loss\n")
        want = f"metrics in {run / 'metrics.csv'}"
    elif trace == "tensorboard":
        (run / "tensorboard" / "train").mkdir(parents=True)
        (run / "tensorboard" / "notes.txt").write_text("")
        assert earlier_run(config) == ""  # a directory without events is no run
        (run / "tensorboard" / "train" / "events.out.tfevents.1.host").write_text("")
        want = f"TensorBoard events in {run / 'tensorboard'}"
    else:
        from shardwise.checkpoint import save_checkpoint

        save_checkpoint(run / "checkpoints", torch.nn.Linear(1, 1), step=3)
        want = f"1 checkpoint(s) in {run / 'checkpoints'}, the newest step_00000003"
    said = earlier_run(config)
    assert said.startswith(f"Runner.fit(): RunnerConfig.run_dir={str(run)!r} already holds a "
                           f"run ({want}) and RunnerConfig.resume=None")  # fmt: skip


def test_a_hyperparameter_the_new_optimizer_lacks_is_not_compared() -> None:
    """A fresh group without the key (SGD has no betas or eps) compares nothing for it."""
    manifest = {"optimizer": {"param_groups": [dict(_GROUP)]}}
    assert config_changes(manifest, None, [{"lr": 1e-3, "momentum": 0.9}]) == []
