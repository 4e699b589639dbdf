"""What a pipeline stage exchanges outside the schedule goes through the stage's own
device (issue 47, items 1 and 4), spied in one process: a stand-in state whose device is
`meta` stands for a GPU, so a tensor left on the CPU shows.

- The gradient norm of a stage that trains nothing (LoRA on some layers only) is a CPU
  zero; all-reduced from the CPU on a cpu:gloo,cuda:nccl group it would go to gloo on that
  rank and to NCCL on the others (a hang), and a NCCL-only group refuses it.
- The loss a non-last stage receives is allocated on the stage's device, not on
  `torch.cuda.current_device()`, which under Lightning's `devices=[1, 3]` is another GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import torch
from torch import nn

from shardwise.parallelize import pipeline
from shardwise.train.engine import total_grad_norm


def _stage(device: str, *, is_last: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        device=torch.device(device), group=None, tied=[], is_first=True, is_last=is_last,
        last_rank=1,
    )  # fmt: skip


def test_the_norm_of_a_stage_that_trains_nothing_is_reduced_on_the_stages_device():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    state = _stage("meta")
    params = list(frozen.parameters())
    for p in params:
        setattr(p, pipeline._STAGE_ATTR, state)
    seen: list[torch.device] = []
    with mock.patch.object(pipeline.dist, "all_reduce", lambda t, group: seen.append(t.device)):
        squared = pipeline.stage_grad_norm_squared(params, total_grad_norm)
    assert squared is not None and seen == [torch.device("meta")]


def test_every_stage_receives_the_loss_on_its_device():
    seen: list[torch.device] = []

    def broadcast(t: torch.Tensor, src: int, group: object) -> None:
        seen.append(t.device)

    with mock.patch.object(pipeline.dist, "broadcast", broadcast):
        pipeline._loss_on_every_rank(_stage("meta"), [], 1.0)  # type: ignore[arg-type]
        last = _stage("meta", is_last=True)
        pipeline._loss_on_every_rank(last, [torch.tensor(2.0)], 0.5)  # type: ignore[arg-type]
    assert seen == [torch.device("meta")] * 2
