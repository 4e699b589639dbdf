"""A resume at another number of data-parallel ranks keeps the global batch through the
accumulation, or refuses in one line (the training equality is in
tests/distributed/test_runner_dist.py)."""

from __future__ import annotations

import pytest
import torch

from shardwise import Engine, TrainConfig
from shardwise.train.resume import keep_global_batch


def _engine(accumulate: int = 1) -> Engine:
    return Engine(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1),
                  train=TrainConfig(accumulate_steps=accumulate))  # fmt: skip


def _position(world: int, batch: int = 2, steps: int = 1, configured: int | None = None) -> dict:
    out = {"world_size": world, "batch_size": batch, "accumulate_steps": steps}
    return out if configured is None else {**out, "accumulate_configured": configured}


@pytest.mark.parametrize(
    ("position", "world", "accumulate", "expected"),
    [
        (_position(4), 2, 1, 2),  # half the ranks: twice the micro-batches per step
        (_position(2, steps=2, configured=1), 4, 1, 1),  # back to 4 after a shrink
        (_position(4), 4, 1, 1),  # the same world: untouched
        (_position(4, batch=3), 2, 1, 1),  # a batch_size the user changed: theirs
        (_position(4, steps=2), 2, 1, 1),  # an accumulation the user changed: theirs
        ({"world_size": 4, "batch_size": 2}, 2, 1, 1),  # an older checkpoint: untouched
        # A second world change (issue 48): the checkpoint of an already adjusted run keeps
        # the accumulation the script configured, which the adjusted one is not.
        (_position(4, steps=2, configured=4), 8, 4, 1),  # 2 -> 4 -> 8 ranks, 16 samples
        (_position(4, steps=1, configured=2), 1, 2, 4),  # 2 -> 4 -> 1 rank, 8 samples
    ],
)
def test_the_accumulation_keeps_the_global_batch(position, world, accumulate, expected):
    engine = _engine(accumulate)
    keep_global_batch(position, engine, 2, world, "latest")
    assert engine.train_config.accumulate_steps == expected


def test_a_global_batch_no_whole_accumulation_makes_up_is_refused_in_one_line():
    with pytest.raises(ValueError) as caught:
        keep_global_batch(_position(3), _engine(), 2, 2, "latest")  # 6 samples over 2 x 2
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith(
        "RunnerConfig.resume='latest': the checkpoint's global batch is 6 samples (3 "
        "data-parallel rank(s) x 2 x 1 accumulated), and 2 rank(s) x batch_size 2 cannot make "
        "it up with whole accumulation steps. Run at a data-parallel world in [1, 3]"
    )
    with pytest.raises(ValueError, match=r"global batch is 4 samples"):
        keep_global_batch(_position(2), _engine(), 2, 4, "latest")  # 4 over 4 x 2: below 1


def test_the_accumulation_changes_only_between_steps():
    from shardwise.train.engine import set_accumulation

    engine = _engine()
    set_accumulation(engine, 3)
    assert engine.train_config.accumulate_steps == 3
    engine.micro_step = 1  # one micro-batch into a window
    with pytest.raises(RuntimeError, match=r"1 micro-batch\(es\) into an accumulation window"):
        set_accumulation(engine, 2)


def test_metrics_rows_keep_the_data_parallel_ranks_an_integer_through_a_rewrite():
    from shardwise.train.metrics import _int_step

    assert [type(_int_step(k, 4.0)) for k in ("dp_world", "step", "loss")] == [int, int, float]


# --- the loop position: where in which epoch a resume continues ----------------------------


def _saved(batches_done: int) -> dict:
    """Saved by 2 ranks of 4 rows a batch, in epoch 2 of 10 batches per rank."""
    return {"epoch": 2, "batches_done": batches_done, "total_batches": 10, "world_size": 2,
            "batch_size": 4, "samples_done": batches_done * 4 * 2}  # fmt: skip


@pytest.mark.parametrize(
    ("batches_done", "world", "expected"),
    [
        (10, 2, (3, 0)),  # the end of epoch 2: the next epoch, from its start
        (10, 4, (3, 0)),
        (10, 3, (3, 0)),  # 80 samples do not split over 3, but none are left to split
        (5, 2, (2, 20)),  # mid-epoch: each rank skips its 20 samples
        (5, 4, (2, 10)),  # 40 samples over 4 ranks
    ],
)
def test_a_resume_continues_after_the_samples_its_epoch_consumed(batches_done, world, expected):
    """Fourth audit: a checkpoint saved at the end of an epoch resumes at the start of the
    next, at the saving world size as at another, never inside the finished one (which
    would skip all its samples, or refuse a world they do not split over)."""
    from torch.utils.data import DataLoader

    from shardwise.train.data import map_position

    loader = DataLoader(list(range(80)), batch_size=4) if world == 2 else None
    assert map_position(_saved(batches_done), 2, loader, world, "latest") == expected


def test_a_resume_mid_epoch_at_a_world_its_samples_do_not_split_over_is_refused():
    from shardwise.train.data import map_position

    with pytest.raises(ValueError) as caught:
        map_position(_saved(5), 2, None, 3, "latest")
    assert str(caught.value) == (
        "RunnerConfig.resume='latest': the checkpoint was saved by 2 rank(s) 40 samples into "
        "epoch 2 (5 batch(es) of 4 per rank). 40 does not split evenly over this world size 3, "
        "so the ranks cannot continue exactly where it stopped (an uneven split would train a "
        "sample twice, skip one, or give ranks unequal batch counts). Resume at a world size "
        "dividing 40 (e.g. [1, 2, 4, 5, 8, 10, 20, 40]), or from a checkpoint saved at the end "
        "of an epoch."
    )
