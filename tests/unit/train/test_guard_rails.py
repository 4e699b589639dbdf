"""Numeric guard rails in one process: settings that train into NaN or backwards are
refused at load time, and a non-finite loss or gradient norm stops or skips the update.
(The same across ranks, with one rank going NaN: tests/distributed/test_engine.py.)"""

from __future__ import annotations

import pytest
import torch

from shardwise import Engine, TrainConfig
from shardwise.config.run_file import Config, ConfigError, load_config
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.train import NonFiniteError

CFG = GPTConfig()


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("optimizer.lr=inf", r"optimizer\.lr=inf must be a finite number > 0"),
        ("optimizer.lr=.nan", r"optimizer\.lr=nan must be a finite number > 0"),
        ("optimizer.lr=-1e-3", r"optimizer\.lr=-0\.001 must be a finite number > 0"),
        ("optimizer.weight_decay=-0.1", r"optimizer\.weight_decay=-0\.1 must be a finite number >= 0"),
        ("optimizer.betas=[1.0, 0.9]", r"optimizer\.betas\[0\]=1\.0 must be in \[0, 1\)"),
        ("optimizer.betas=[0.9, -0.5]", r"optimizer\.betas\[1\]=-0\.5 must be in \[0, 1\)"),
        ("scheduler.min_lr_ratio=-0.1", r"scheduler\.min_lr_ratio=-0\.1 must be in \[0, 1\]"),
        ("scheduler.warmup_steps=-5", r"scheduler\.warmup_steps=-5 must be an int >= 0"),
        ("train.on_nonfinite=ignore", r"train\.on_nonfinite='ignore' is not allowed\. .*\['stop', 'skip'\]"),
    ],
)  # fmt: skip
def test_settings_that_train_into_nan_are_refused_at_load(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override], cls=Config)


def test_a_schedule_never_goes_negative_at_the_edges():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = load_config(None, ["scheduler.name=cosine", "scheduler.min_lr_ratio=0.0"], cls=Config)
    sched = cfg.scheduler.build(opt, total_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert min(lrs) >= 0.0


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        (
            lambda p: torch.optim.AdamW(p, lr=float("inf")),
            r"AdamW param_groups\[0\]\['lr'\]=inf must be a finite number >= 0",
        ),
        (
            lambda p: torch.optim.SGD(p, lr=float("nan")),
            r"SGD param_groups\[0\]\['lr'\]=nan must be a finite number >= 0",
        ),
    ],
)
def test_engine_refuses_a_torch_optimizer_with_a_non_finite_lr(optimizer, match):
    with pytest.raises(ValueError, match=match):
        Engine(GPT(CFG), optimizer)


class GoesNaN(GPT):
    """Its loss is NaN on the `at`-th forward (1-based)."""

    at = 0
    calls = 0

    def forward(self, idx, targets=None):
        self.calls += 1
        loss = super().forward(idx, targets)
        return loss * float("nan") if self.calls == self.at else loss


def _engine(at, on_nonfinite):
    torch.manual_seed(0)
    model = GoesNaN(CFG)
    model.at = at
    return Engine(
        model,
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        train=TrainConfig(on_nonfinite=on_nonfinite),
    )


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_nan_loss_stops_by_default_naming_the_step_and_the_loss():
    engine = _engine(at=2, on_nonfinite="stop")
    batches = random_lm_batches(CFG, 3, 4, seed=1)
    engine.train_step(batches[0])
    before = _params(engine)
    with pytest.raises(
        NonFiniteError,
        match=r"non-finite loss or gradient norm at optimizer step 2 on 1 rank\(s\) \(rank 0: "
        r"grad_norm, loss\)\. Training stopped on every rank \(TrainConfig\.on_nonfinite='stop'\)",
    ):
        engine.train_step(batches[1])
    after = _params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the NaN never landed


def test_nan_loss_with_skip_leaves_parameters_and_continues():
    engine = _engine(at=2, on_nonfinite="skip")
    batches = random_lm_batches(CFG, 3, 4, seed=1)
    engine.train_step(batches[0])
    before = _params(engine)
    state_steps = [float(s["step"]) for s in engine.optimizer.state.values()]
    with pytest.warns(UserWarning, match=r"at optimizer step 2 .*update was skipped"):
        logs = engine.train_step(batches[1])
    assert logs["skipped"] == 1.0 and engine.skipped_steps == 1 and engine.step == 1
    after = _params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert [float(s["step"]) for s in engine.optimizer.state.values()] == state_steps
    logs = engine.train_step(batches[2])  # training goes on
    assert logs["skipped"] == 0.0 and engine.step == 2
    assert all(torch.isfinite(p).all() for p in _params(engine).values())
