"""ShardwiseFabricStrategy's checks, in one process and without launching: what it accepts,
what it refuses and the words it refuses with. Training under Fabric is proven against
Fabric's own DDP in tests/integrations/test_fabric.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise import ParallelConfig

pytest.importorskip("lightning")
from shardwise.integrations.fabric import (
    ShardwiseFabricStrategy,
    rebind_optimizers,
    split_state,
)


def test_takes_parallel_config_or_its_words_and_tensor_parallel():
    assert ShardwiseFabricStrategy(strategy="ddp_fully_sharded").config.strategy == "full_shard"
    assert ShardwiseFabricStrategy(config=ParallelConfig(tp=2)).config.tp == 2
    with pytest.raises(TypeError, match="not both"):
        ShardwiseFabricStrategy(ParallelConfig(), strategy="ddp")
    with pytest.raises(TypeError, match=r"expects a shardwise.ParallelConfig, got dict"):
        ShardwiseFabricStrategy(config={"strategy": "ddp"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flatten_parameters"):
        ShardwiseFabricStrategy(flatten_parameters=True)


def test_sampler_arguments_under_tp_need_the_model_first():
    strategy = ShardwiseFabricStrategy(tp=2)
    with pytest.raises(RuntimeError, match=r"setup_dataloaders was called before fabric.setup"):
        _ = strategy.distributed_sampler_kwargs


def test_state_is_split_into_model_optimizer_scheduler_and_json():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    parts = split_state({"m": model, "o": opt, "s": sched, "iter": 3, "hp": {"lr": [1, 2]}})
    assert (parts.model, parts.optimizer, parts.scheduler) == (model, opt, sched)
    assert parts.extra == {"iter": 3, "hp": {"lr": [1, 2]}}
    # A Stateful that is neither is stored as its state_dict.
    assert split_state({"m": model, "x": _Counter()}).extra == {"x": {"n": 7}}


class _Counter:
    def state_dict(self):
        return {"n": 7}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)}, ValueError, r"more than one model \('b'"),
        ({"step": 1}, ValueError, r"fabric.save: state holds no model"),
        (
            {"m": nn.Linear(1, 1), "step": torch.tensor(3)},
            TypeError,
            r"state\['step'\] is Tensor tensor\(3\), which does not come back from JSON",
        ),
        ({"m": nn.Linear(1, 1), "shape": (1, 2)}, TypeError, r"state\['shape'\] is tuple"),
        ({"m": nn.Linear(1, 1), "ids": {1: "a"}}, TypeError, r"string-keyed dicts"),
    ],
)
def test_a_state_a_checkpoint_cannot_hold_is_refused_by_key(state, error, match):
    with pytest.raises(error, match=match):
        split_state(state)


def test_two_optimizers_are_refused():
    model = nn.Linear(2, 2)
    a, b = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    with pytest.raises(ValueError, match=r"more than one optimizer \('b' is the second\)"):
        split_state({"m": model, "a": a, "b": b})


def test_a_joint_setup_points_the_optimizer_at_the_new_parameters_by_name():
    before, after = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [before.weight]}, {"params": [before.bias]}], lr=0.1)
    names = {id(p): n for n, p in before.named_parameters()}
    rebind_optimizers([opt], names, after)
    assert opt.param_groups[0]["params"][0] is after.weight
    assert opt.param_groups[1]["params"][0] is after.bias


def test_a_joint_setup_refuses_an_optimizer_that_has_stepped():
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"optimizer 0 \(Adam\) has already stepped"):
        rebind_optimizers([opt], {}, model)


def test_clipping_by_another_norm_and_saving_with_a_filter_are_refused():
    strategy = ShardwiseFabricStrategy()
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"norm_type=inf\): ShardwiseFabricStrategy clips by"):
        strategy.clip_gradients_norm(model, opt, 1.0, norm_type=float("inf"))
    with pytest.raises(NotImplementedError, match=r"fabric.save\(\.\.\., filter=\.\.\.\) is not"):
        strategy.save_checkpoint("x", {"m": model}, filter={"m": lambda k, v: True})


def test_clipping_one_process_equals_torch_and_refuses_a_non_finite_norm():
    torch.manual_seed(0)
    ours, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    for m in (ours, ref):
        m(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    strategy = ShardwiseFabricStrategy()
    norm = strategy.clip_gradients_norm(ours, torch.optim.SGD(ours.parameters(), lr=1), 0.1)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert torch.allclose(norm, expected)
    assert all(
        torch.allclose(a.grad, b.grad)
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True)
    )
    strategy.clip_gradients_value(ours, torch.optim.SGD(ours.parameters(), lr=1), 0.001)
    assert max(float(p.grad.abs().max()) for p in ours.parameters()) == pytest.approx(0.001)
    ours.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"total norm of the gradients is nan"):
        strategy.clip_gradients_norm(ours, torch.optim.SGD(ours.parameters(), lr=1), 0.1)


@pytest.mark.parametrize("owner", ["ShardwiseStrategy", "ShardwiseFabricStrategy"])
def test_fp16_compute_is_refused_by_both_lightning_strategies(owner: str) -> None:
    # Lightning scales the loss only under precision='16-mixed', which it refuses with
    # this kind of strategy: fp16 compute would train with no loss scale.
    import shardwise.integrations.fabric as fabric
    import shardwise.integrations.lightning as lightning

    cls = getattr(lightning if owner == "ShardwiseStrategy" else fabric, owner)
    host = "Lightning's Trainer" if owner == "ShardwiseStrategy" else "Lightning Fabric"
    with pytest.raises(
        ValueError,
        match=rf"{owner}\(mixed_precision='fp16'\) computes in float16, whose gradients need "
        rf"a loss scale, and {host} scales the loss only under precision='16-mixed'",
    ):
        cls(strategy="full_shard", mixed_precision="fp16")
    assert cls(strategy="full_shard", mixed_precision="bf16").config.mixed_precision == "bf16"
