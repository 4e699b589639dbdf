"""What the run file's optimizer and scheduler sections build (issue 34's planted bugs).

Every field written reaches the torch object it configures (read back from its param_groups),
and the schedule's learning rate at each step is the documented one: linear warm-up from
peak/warmup at the first step to the peak, then cosine or linear decay to min_lr_ratio.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.config import OptimizerConfig, SchedulerConfig


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    ("name", "cls"), [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)]
)
def test_adams_fields_reach_the_optimizer(name, cls):
    opt = OptimizerConfig(name=name, lr=2e-3, weight_decay=0.05, betas=(0.8, 0.99)).build(_params())
    assert type(opt) is cls
    (group,) = opt.param_groups
    assert (group["lr"], group["weight_decay"], tuple(group["betas"])) == (2e-3, 0.05, (0.8, 0.99))


def test_sgds_fields_reach_the_optimizer():
    opt = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01).build(_params())
    (group,) = opt.param_groups
    assert type(opt) is torch.optim.SGD
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 0.01)


def _lrs(config: SchedulerConfig, total: int, peak: float = 1.0) -> list[float]:
    opt = torch.optim.SGD(_params(), lr=peak)
    scheduler = config.build(opt, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("name", ["constant", "cosine", "linear"])
def test_warm_up_starts_at_one_warmup_th_of_the_peak_and_reaches_it(name):
    lrs = _lrs(SchedulerConfig(name=name, warmup_steps=4, min_lr_ratio=0.1), total=12, peak=2.0)
    # The first update already moves (a zero lr would waste it): 1/4, 2/4, 3/4, 4/4.
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert lrs[4] == pytest.approx(2.0)


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_decay_ends_at_min_lr_ratio_of_the_peak(name):
    total, warmup, floor = 12, 2, 0.1
    lrs = _lrs(SchedulerConfig(name=name, warmup_steps=warmup, min_lr_ratio=floor), total)
    for step in range(warmup, total):
        progress = (step - warmup) / (total - warmup)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if name == "cosine" else 1 - progress
        assert lrs[step] == pytest.approx(floor + (1 - floor) * decay), step
    assert min(lrs[warmup:]) >= floor
