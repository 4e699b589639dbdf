"""Engine at world size 1: contracts, loss parsing and every bad-input message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardwise import Engine, ParallelConfig, TrainConfig, parse_losses
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

CFG = GPTConfig()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


class Returns(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.value = value

    def forward(self, x):
        self.lin(x)
        return self.value


def test_parse_losses_tensor_dict_and_object():
    t = torch.tensor(2.0)
    assert parse_losses(t)[0] is not None and float(parse_losses(t)[1]["loss"]) == 2.0
    total, logs = parse_losses(
        {"loss_a": t, "loss_b": [t, t * 2], "acc": torch.tensor(0.5), "vis": torch.ones(3)}
    )
    assert float(total) == 2.0 + 6.0
    assert {k: float(v) for k, v in logs.items()} == {
        "loss_a": 2.0,
        "loss_b": 6.0,
        "acc": 0.5,
        "vis": 1.0,  # every tensor entry is logged as its mean, as mmengine does
        "loss": 8.0,
    }
    assert float(parse_losses(SimpleNamespace(loss=t, logits=torch.ones(2)))[0]) == 2.0


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            (torch.ones(()),) * 4,
            r"the model returned a tuple of 4 item\(s\) \(Tensor, Tensor, Tensor, Tensor\); expected a scalar loss tensor",
        ),
        ("done", r"the model returned str \('done'\)"),
    ],
)
def test_model_returning_no_loss_says_what_it_returned(value, match):
    engine = Engine(Returns(value), adamw)
    with pytest.raises(TypeError, match=match):
        engine.train_step(torch.ones(1, 2))
    with pytest.raises(
        ValueError,
        match=r"the model returned a dict with keys \['logits'\]: no key contains 'loss'",
    ):
        Engine(Returns({"logits": torch.ones(2)}), adamw).train_step(torch.ones(1, 2))


def test_non_scalar_tensor_loss():
    engine = Engine(Returns(torch.ones(3, requires_grad=True)), adamw)
    with pytest.raises(
        ValueError, match=r"returned a tensor of shape \(3,\); a loss must be a scalar"
    ):
        engine.train_step(torch.ones(1, 2))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_accumulate_steps_below_one(bad):
    with pytest.raises(
        ValueError, match=rf"TrainConfig\.accumulate_steps={bad!r} must be an int >= 1"
    ):
        TrainConfig(accumulate_steps=bad)


def test_other_train_config_errors():
    with pytest.raises(ValueError, match=r"max_grad_norm=0 must be > 0, or None"):
        TrainConfig(max_grad_norm=0)
    with pytest.raises(ValueError, match=r"init_scale=0 must be > 0"):
        TrainConfig(init_scale=0)


def test_unknown_mode():
    engine = Engine(GPT(CFG), adamw)
    with pytest.raises(
        ValueError,
        match=r"Engine\.forward\(mode='train'\) is not a known mode\. Use one of \['loss', 'predict', 'tensor'\]",
    ):
        engine.forward(random_lm_batches(CFG, 1, 2)[0], mode="train")


def test_optimizer_factory_gets_trainable_params_only():
    model = GPT(CFG)
    model.tok_emb.requires_grad_(False)
    engine = Engine(model, adamw)
    held = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert id(model.tok_emb.weight) not in held and id(model.ln_f.weight) in held


def test_optimizer_missing_trainable_params_warns():
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.blocks.parameters())
    with pytest.warns(UserWarning, match=r"trainable parameter\(s\) are not in the optimizer"):
        Engine(model, opt)


def test_bad_optimizer_and_scheduler():
    with pytest.raises(
        TypeError,
        match=r"Engine\(optimizer=\.\.\.\) got int; expected a torch\.optim\.Optimizer, a factory such as lambda params: AdamW\(params, lr=3e-4\), or mmengine's OptimWrapper",
    ):
        Engine(GPT(CFG), 3)
    other = torch.optim.SGD(GPT(CFG).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, 1)
    with pytest.raises(ValueError, match=r"the scheduler was built for a different optimizer"):
        Engine(GPT(CFG), adamw, scheduler=sched)


def test_scheduler_factory_steps_per_update():
    engine = Engine(
        GPT(CFG),
        adamw,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
        train=TrainConfig(accumulate_steps=2),
    )
    batch = random_lm_batches(CFG, 1, 2)[0]
    micro = engine.train_step(batch)
    assert "lr" not in micro and engine.step == 0
    logs = engine.train_step(batch)
    assert logs["lr"] == pytest.approx(
        1e-3
    )  # lr used for this update; the scheduler then halves it
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4) and engine.step == 1


def test_anomalous_params_are_listed():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(2, 1)
            self.unused = nn.Linear(2, 1)

        def forward(self, x):
            return self.used(x).mean()

    engine = Engine(Unused(), adamw, train=TrainConfig(detect_anomalous_params=True))
    with pytest.warns(
        UserWarning,
        match=r"2 trainable parameter\(s\) received no gradient this step: \['unused\.weight', 'unused\.bias'\]",
    ):
        logs = engine.train_step(torch.ones(1, 2))
    assert logs["anomalous_params"] == 2.0


def test_world_one_accumulation_equals_big_batch():
    x, y = random_lm_batches(CFG, 1, 8)[0]
    torch.manual_seed(0)
    ref = Engine(GPT(CFG), adamw)
    big = ref.train_step((x, y))
    torch.manual_seed(0)
    acc = Engine(GPT(CFG), adamw, train=TrainConfig(accumulate_steps=4))
    for i in range(4):
        logs = acc.train_step((x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]))
    assert logs["loss"] == pytest.approx(big["loss"], rel=1e-6)
    assert logs["grad_norm"] == pytest.approx(big["grad_norm"], rel=1e-5)
    # The project's parity measure: ||a - b|| / ||a|| per tensor (Adam turns rounding noise
    # in near-zero gradient entries into visible single-entry differences).
    for (n, a), b in zip(ref.model.named_parameters(), acc.model.parameters(), strict=True):
        assert float((a - b).detach().norm() / a.detach().norm()) <= 1e-5, n


def test_engine_accepts_a_model_already_wrapped():
    import shardwise

    model = shardwise.wrap(GPT(CFG), ParallelConfig(strategy="ddp"))
    engine = Engine(model, adamw)
    assert engine.model is model and engine.config.strategy == "ddp"
    assert Engine(model, adamw, ParallelConfig(strategy="ddp")).config.strategy == "ddp"
    with pytest.raises(
        ValueError,
        match=r"another ParallelConfig: strategy='full_shard' \(wrapped with 'ddp'\)\. A wrapped",
    ):
        Engine(model, adamw, ParallelConfig(strategy="full_shard"))


def test_checkpoint_weights_and_memory_argument_errors(tmp_path):
    from shardwise.checkpoint import save_checkpoint
    from shardwise.checkpoint.export import export_weights
    from shardwise.memory import estimate_memory

    engine = Engine(GPT(CFG), adamw)
    with pytest.raises(
        ValueError, match=r"save_checkpoint\(keep_last=0\) must be a positive int or None"
    ):
        save_checkpoint(tmp_path, engine, keep_last=0)
    with pytest.raises(ValueError, match=r"export_weights\(max_shard_bytes=0\) must be positive"):
        export_weights(engine.model, tmp_path / "w", max_shard_bytes=0)
    plan = engine.model._shardwise_wrap_info.plan
    with pytest.raises(
        ValueError,
        match=r"estimate_memory\(optimizer='lion'\): use one of \['adam', 'adamw', 'muon', 'none', 'sgd'\]",
    ):
        estimate_memory(plan, 2, optimizer="lion")


def test_clip_grad_norm_over_mixed_meshes_is_one_processs():
    # Under tensor parallelism a model's gradients sit on different meshes (norms on the
    # data-parallel mesh, linears on the 2-D one); torch's clip_grad_norm_ stacks them and
    # fails. Here: a 1-D and a 2-D mesh of one rank, and a plain tensor.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardwise

    shardwise.init_distributed()
    flat = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    grads = [torch.randn(4, 3), torch.randn(5), torch.randn(2, 2)]
    params = [
        nn.Parameter(distribute_tensor(torch.zeros(4, 3), grid, [Shard(0), Shard(1)])),
        nn.Parameter(distribute_tensor(torch.zeros(5), flat, [Shard(0)])),
        nn.Parameter(torch.zeros(2, 2)),
    ]
    params[0].grad = distribute_tensor(grads[0].clone(), grid, [Shard(0), Shard(1)])
    params[1].grad = distribute_tensor(grads[1].clone(), flat, [Replicate()])
    params[2].grad = grads[2].clone()
    with pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor|same mesh"):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    with pytest.raises(Exception, match="same mesh"):
        torch.nn.utils.clip_grad_norm_(params[:2], 1.0)
    want = torch.cat([g.flatten() for g in grads]).norm()
    norm = shardwise.clip_grad_norm_(iter(params), max_norm=0.5)
    torch.testing.assert_close(norm, want)
    scale = 0.5 / (want + 1e-6)
    for p, g in zip(params, grads, strict=True):
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, g * scale)


def test_the_update_reduction_waits_once_and_flags_only_its_losses():
    from shardwise.testing import count_host_syncs
    from shardwise.train.reduce import reduce_window

    nan = float("nan")
    cpu = torch.device("cpu")

    def reduce(**values: float):  # type: ignore[no-untyped-def]
        window = [{k: torch.tensor(v) for k, v in values.items()} for _ in range(2)]
        with count_host_syncs() as syncs:
            out = reduce_window(window, torch.tensor(3.0), cpu, True, False)
        assert dict(syncs) == {"tolist": 1}  # the update's one wait, an index by a list none
        return out

    assert reduce(aux=nan, loss=1.0, z_loss=2.0).nonfinite_ranks == 0  # aux is not a loss
    assert reduce(aux=1.0, loss=1.0, z_loss=nan).nonfinite_ranks == 1  # a later loss key
    assert reduce(aux=1.0, loss=-float("inf")).nonfinite_ranks == 1
    assert reduce(aux=nan).nonfinite_ranks == 0  # no loss at all: nothing to flag
    got = reduce(aux=4.0, loss=1.0)
    assert (got.means, got.norm, got.stop, got.save) == (
        {"aux": 4.0, "loss": 1.0},
        3.0,
        False,
        False,
    )
