"""The mmengine step contract, side by side with mmengine itself (one process).

Each case runs the same model through mmengine's own path (BaseModel.parse_losses,
OptimWrapper.update_params) and through shardwise's Engine, and asks for the same loss,
logs and parameters: non-scalar loss entries, a model's own parse_losses, tuple outputs,
OptimWrapper accumulation and clipping, and the optimizer built before wrapping.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise import Engine, ParallelConfig, TrainConfig, parse_losses

mmengine = pytest.importorskip("mmengine")
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim import AmpOptimWrapper, OptimWrapper  # noqa: E402


class MMToy(BaseModel):
    """Per-sample and list-of-tensor loss entries, as mmdet/mmpose heads return them."""

    def __init__(self, outputs: str = "dict") -> None:
        super().__init__()
        self.outputs = outputs
        self.backbone = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, inputs, labels=None, mode="tensor"):
        logits = self.head(torch.relu(self.backbone(inputs)))
        if mode != "loss":
            return logits
        losses = {
            "loss_cls": F.cross_entropy(logits, labels, reduction="none"),  # per sample
            "loss_aux": [logits.pow(2).mean(1) * 0.1, logits.abs() * 0.1],  # non-scalars
            "acc": (logits.argmax(-1) == labels).float(),
        }
        if self.outputs == "pose":  # mmpose / mmseg
            return losses, logits.detach()
        if self.outputs == "pretrain":  # mmpretrain
            return losses, logits.detach(), labels > 0
        return losses


class Reweighting(MMToy):
    """A BaseModel subclass whose parse_losses reweights, as some OpenMMLab models do."""

    def parse_losses(self, losses):
        loss, log_vars = super().parse_losses(losses)
        loss = 0.25 * loss + 2.0 * log_vars["loss_aux"]
        log_vars["loss"] = loss
        return loss, log_vars


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "inputs": torch.randn(6, 4, generator=g),
        "labels": torch.randint(0, 3, (6,), generator=g),
    }


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def mmengine_step(model: BaseModel, data: dict, wrapper) -> dict:
    """The seed's train_step: preprocess, forward(mode='loss'), split tuples,
    module.parse_losses, optim_wrapper.update_params."""
    with wrapper.optim_context(model):
        out = model(**model.data_preprocessor(data, True), mode="loss")
    losses = out[0] if isinstance(out, tuple) else out
    loss, log_vars = model.parse_losses(losses)
    wrapper.update_params(loss)
    return {k: float(v.detach()) for k, v in log_vars.items()}


def assert_same_params(a: nn.Module, b: nn.Module, rtol: float = 0.0) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=0.0, msg=name)


@pytest.mark.parametrize("cls", [MMToy, Reweighting])
def test_losses_and_update_equal_mmengine(cls):
    torch.manual_seed(0)
    ours = cls()
    theirs = copy.deepcopy(ours)
    expected = mmengine_step(theirs, batch(), OptimWrapper(sgd(theirs.parameters())))
    logs = Engine(ours, sgd).train_step(batch())
    # Measured before the fix: per-sample entries dropped from the total (8.2e-5 vs 1.466),
    # and a model's own parse_losses ignored (parameters 11% off after one step).
    assert {k: logs[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    assert_same_params(ours, theirs)


def test_parse_losses_follows_mmengine_for_every_entry_kind():
    t = torch.tensor([1.0, 3.0])
    losses = {"loss_a": t, "loss_b": [t, t * 2], "acc": torch.tensor([0.0, 1.0])}
    total, logs = parse_losses(losses)
    ref_total, ref_logs = BaseModel.parse_losses(None, losses)
    assert float(total) == float(ref_total) == 2.0 + 6.0
    assert {k: float(v) for k, v in logs.items()} == {k: float(v) for k, v in ref_logs.items()}


@pytest.mark.parametrize("outputs", ["pose", "pretrain"])
def test_tuple_outputs_pass_predictions_through(outputs):
    torch.manual_seed(0)
    ours = MMToy(outputs)
    theirs = copy.deepcopy(ours)
    expected = mmengine_step(theirs, batch(), OptimWrapper(sgd(theirs.parameters())))
    logs = Engine(ours, sgd).train_step(batch())
    assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert_same_params(ours, theirs)
    assert logs["vis_preds"].shape == (6, 3) and not logs["vis_preds"].requires_grad
    if outputs == "pretrain":
        assert torch.equal(logs["vis_masks"], batch()["labels"] > 0)
    else:
        assert "vis_masks" not in logs


def test_non_tensor_loss_entry_is_refused_as_mmengine_does():
    class Bad(nn.Module):  # a plain model: shardwise's parse_losses, not BaseModel's
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, inputs, labels):
            return {"loss": self.lin(inputs).mean(), "name": "x"}

    with pytest.raises(TypeError, match=r"is not\s+a tensor or list of tensors"):
        BaseModel.parse_losses(None, {"name": "x"})
    with pytest.raises(
        TypeError,
        match=r"loss dict has 'name' = str \('x'\), which is not a tensor or a list of tensors \(mmengine's parse_losses refuses it too\)\. Return predictions beside the losses instead: forward\(mode='loss'\) -> \(losses, preds\)",
    ):
        Engine(Bad(), sgd).train_step(batch())


def test_loss_dict_without_a_loss_key():
    with pytest.raises(
        ValueError, match=r"no key contains 'loss', so there is nothing to backpropagate"
    ):
        parse_losses({"acc": torch.ones(2)})


def test_own_parse_losses_must_return_a_pair():
    class Odd(MMToy):
        def parse_losses(self, losses):
            return losses["loss_cls"].mean()

    with pytest.raises(
        TypeError,
        match=r"Odd\.parse_losses returned a tensor of shape \(\); expected \(loss tensor, dict",
    ):
        Engine(Odd(), sgd).train_step(batch())


# --- OptimWrapper ----------------------------------------------------------------------------


def test_optim_wrapper_accumulation_and_clipping_equal_mmengine():
    torch.manual_seed(0)
    ours = MMToy()
    theirs = copy.deepcopy(ours)
    clip = {"max_norm": 0.05}  # well below the gradient norm: clipping acts every step
    their_wrapper = OptimWrapper(
        sgd(theirs.parameters()), accumulative_counts=2, clip_grad=dict(clip)
    )
    engine = Engine(
        ours, OptimWrapper(sgd(ours.parameters()), accumulative_counts=2, clip_grad=dict(clip))
    )
    assert engine.train_config.accumulate_steps == 2 and engine.train_config.max_grad_norm == 0.05
    their_wrapper.initialize_count_status(theirs, 0, 4)
    for i in range(4):
        mmengine_step(theirs, batch(i), their_wrapper)
        logs = engine.train_step(batch(i))
    assert engine.step == 2 and "grad_norm" in logs
    assert_same_params(ours, theirs, rtol=1e-6)


@pytest.mark.parametrize(
    ("clip", "match"),
    [
        (
            {"type": "value", "clip_value": 1.0},
            r"clip_grad=\{'clip_value': 1\.0\}\) with clip_grad_value_ is not supported",
        ),
        (
            {"max_norm": 1.0, "norm_type": 1},
            r"with clip_grad_norm_ is not supported: shardwise clips by the global L2 norm",
        ),
    ],
)
def test_optim_wrapper_clipping_other_than_l2_is_refused(clip, match):
    model = MMToy()
    with pytest.raises(ValueError, match=match):
        Engine(model, OptimWrapper(sgd(model.parameters()), clip_grad=clip))


def test_optim_wrapper_settings_conflicting_with_train_config():
    model = MMToy()
    wrapper = OptimWrapper(sgd(model.parameters()), accumulative_counts=2)
    with pytest.raises(
        ValueError,
        match=r"OptimWrapper asks for accumulate_steps=2 but TrainConfig\.accumulate_steps=4\. Set it in one place",
    ):
        Engine(model, wrapper, train=TrainConfig(accumulate_steps=4))


def amp_wrapper(optimizer):
    """AmpOptimWrapper refuses to be built on CPU; its attributes are what the Engine reads."""
    wrapper = AmpOptimWrapper.__new__(AmpOptimWrapper)
    OptimWrapper.__init__(wrapper, optimizer)
    wrapper.loss_scaler, wrapper.cast_dtype = None, torch.bfloat16
    return wrapper


def test_amp_optim_wrapper_dtype_must_match_the_config():
    model = MMToy()
    wrapper = amp_wrapper(sgd(model.parameters()))
    with pytest.raises(
        ValueError,
        match=r"AmpOptimWrapper computes in torch\.bfloat16 but ParallelConfig\.mixed_precision='fp32' computes in torch\.float32\. .* set ParallelConfig\.mixed_precision='bf16'",
    ):
        Engine(model, wrapper)
    model = MMToy()
    wrapper = amp_wrapper(sgd(model.parameters()))
    engine = Engine(model, wrapper, ParallelConfig(mixed_precision="bf16"))
    assert engine.optimizer is wrapper.optimizer
    assert engine.train_step(batch())["loss"] > 0


def real_amp_wrapper(optimizer, monkeypatch, **kwargs):
    """mmengine's own AmpOptimWrapper construction (its CUDA check patched for this CPU
    test): its GradScaler is the plain torch one."""
    import mmengine.optim.optimizer.amp_optimizer_wrapper as amp

    monkeypatch.setattr(amp, "is_cuda_available", lambda: True)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        return amp.AmpOptimWrapper(optimizer=optimizer, **kwargs)


def test_the_amp_wrappers_scaler_becomes_a_sharded_one_with_its_settings(monkeypatch):
    # Before: a plain GradScaler under FSDP2 saw inf only in its own shards: ranks skipped
    # different steps and their loss scales drifted apart, silently.
    from torch.amp import GradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from shardwise.train.optim import sharded_scaler_like

    plain = GradScaler(
        "cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7
    )
    sharded = sharded_scaler_like(plain)
    assert type(sharded) is ShardedGradScaler
    assert sharded.state_dict() == plain.state_dict() != {}
    assert sharded.get_scale() == 1024.0 and sharded.get_growth_interval() == 7
    assert sharded_scaler_like(sharded) is sharded

    wrapper = real_amp_wrapper(
        sgd(MMToy().parameters()), monkeypatch, loss_scale={"init_scale": 512.0}
    )
    assert type(wrapper.loss_scaler) is not ShardedGradScaler  # mmengine's own choice
    assert type(sharded_scaler_like(wrapper.loss_scaler)) is ShardedGradScaler


def test_the_engine_takes_the_amp_wrappers_scaler_and_refuses_a_static_scale(monkeypatch):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from shardwise.train.optim import from_optim_wrapper

    optimizer = sgd(MMToy().parameters())
    wrapper = real_amp_wrapper(optimizer, monkeypatch, dtype="float16")
    wrapper.loss_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # enabled on CPU
    config = ParallelConfig(mixed_precision="fp16")
    got, _, scaler = from_optim_wrapper(wrapper, TrainConfig(), config, "cpu")
    assert got is optimizer
    assert type(scaler) is ShardedGradScaler and scaler.get_scale() == 256.0
    static = real_amp_wrapper(
        sgd(MMToy().parameters()), monkeypatch, dtype="float16", loss_scale=512.0
    )
    with pytest.raises(
        ValueError,
        match=r"AmpOptimWrapper\(loss_scale=512\.0\) is a static loss scale, which the Engine does not keep",
    ):
        from_optim_wrapper(static, TrainConfig(), config, "cpu")


# --- an optimizer built before wrap -----------------------------------------------------------


def test_optimizer_built_before_wrap_is_refused_at_its_first_step():
    import shardwise

    shardwise.init_distributed()  # a one-rank group, so full_shard really shards
    model = MMToy()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = shardwise.wrap(model, ParallelConfig(strategy="full_shard", force_wrap=True))
    wrapped(**batch(), mode="loss")["loss_cls"].mean().backward()
    # Before: the step ran, and the parameters never changed.
    with pytest.raises(
        RuntimeError,
        match=r"AdamW\.step\(\): 4 of 4 parameter\(s\) in this optimizer were replaced when shardwise\.wrap sharded the model .* Build it after wrapping",
    ):
        early.step()
    late = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    late.step()  # the right order steps as usual


def test_optimizer_checked_before_a_later_wrap_is_checked_again():
    import shardwise

    shardwise.init_distributed()
    model = MMToy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**batch(), mode="loss")["loss_cls"].mean().backward()
    opt.step()  # fine: nothing is wrapped yet
    shardwise.wrap(model, ParallelConfig(strategy="full_shard", force_wrap=True))
    with pytest.raises(RuntimeError, match=r"were replaced when shardwise\.wrap sharded the model"):
        opt.step()


def test_own_parse_losses_total_and_logs_must_be_scalars():
    class NonScalarTotal(MMToy):
        def parse_losses(self, losses):
            return losses["loss_cls"], {}

    class NonScalarLog(MMToy):
        def parse_losses(self, losses):
            loss, _ = super().parse_losses(losses)
            return loss, {"per_sample": losses["loss_cls"]}

    with pytest.raises(
        ValueError,
        match=r"NonScalarTotal\.parse_losses returned a total of a tensor of shape \(6,\); it must be a scalar tensor",
    ):
        Engine(NonScalarTotal(), sgd).train_step(batch())
    with pytest.raises(
        ValueError,
        match=r"NonScalarLog\.parse_losses logged 'per_sample' with shape \(6,\); logged values must be scalars",
    ):
        Engine(NonScalarLog(), sgd).train_step(batch())


def test_optim_wrapper_without_a_torch_optimizer():
    class Fake:
        optimizer = "sgd"

        def update_params(self, loss):
            pass

        def optim_context(self, model):
            pass

    with pytest.raises(TypeError, match=r"Engine: Fake\.optimizer is str, not a torch optimizer"):
        Engine(MMToy(), Fake())


def test_mmengine_refuses_tensor_parallel_saying_why():
    # Its samplers split data over every rank; a tp group must read the same rows.
    pytest.importorskip("mmengine")
    from shardwise.integrations.mmengine import ShardwiseDataParallel

    with pytest.raises(
        NotImplementedError,
        match=r"tp=2 inside mmengine's Runner is not built: the ranks of a tensor-parallel "
        r"group must read the same rows, and the host's samplers \(DefaultSampler",
    ):
        ShardwiseDataParallel(torch.nn.Linear(4, 4), tp=2)


def test_sharded_wrapper_keeps_sync_off_through_an_accumulating_backward_and_clips_globally():
    """ShardwiseDataParallel under FSDP2 (world 1, force_wrap): mmengine runs backward after
    the no_sync context has closed, so the flag must stay off until the step ends; and the
    wrapper's clip is replaced by the global-norm one (torch's fails on mixed meshes and
    scales by a non-finite norm). Read from FSDP2's own flag at each backward."""
    import torch.distributed as dist

    from shardwise.integrations.mmengine import ShardwiseDataParallel, _global_norm_clip

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = ShardwiseDataParallel(MMToy(), strategy="full_shard", force_wrap=True)
        assert model.sharded
        wrapper = OptimWrapper(
            sgd(model.parameters()), accumulative_counts=2, clip_grad={"max_norm": 0.05}
        )
        wrapper.initialize_count_status(model, 0, 4)
        group = model.module._get_fsdp_state()._fsdp_param_group
        synced: list[bool] = []
        backward = wrapper.backward

        def watched(loss, **kwargs):
            synced.append(group.reduce_grads)  # what FSDP2 reads during this backward
            return backward(loss, **kwargs)

        wrapper.backward = watched
        for i in range(4):
            model.train_step(batch(i), wrapper)
        assert synced == [False, True, False, True]
        assert group.reduce_grads  # on again after the step
        assert wrapper.clip_func is _global_norm_clip
    finally:
        dist.destroy_process_group()


def test_fp16_compute_with_no_loss_scaler_is_refused_and_an_amp_wrapper_taken(monkeypatch):
    # Before: the model computed in float16 with no loss scale, and small gradients rounded
    # to zero with no error.
    from shardwise.integrations.mmengine import ShardwiseDataParallel, adopt_optim_wrapper

    model = ShardwiseDataParallel(MMToy(), strategy="ddp", mixed_precision="fp16")
    with pytest.raises(
        ValueError,
        match=r"ShardwiseDataParallel\(mixed_precision='fp16'\) computes in float16, whose "
        r"gradients need a loss scale, and OptimWrapper scales nothing: .* "
        r"optim_wrapper=dict\(type='AmpOptimWrapper', \.\.\.\)",
    ):
        adopt_optim_wrapper(model, OptimWrapper(sgd(model.parameters())))
    amp = real_amp_wrapper(sgd(model.parameters()), monkeypatch, dtype="float16")
    adopt_optim_wrapper(model, amp)  # scaled: taken
    bf16 = ShardwiseDataParallel(MMToy(), strategy="ddp", mixed_precision="bf16")
    adopt_optim_wrapper(bf16, OptimWrapper(sgd(bf16.parameters())))  # no scale needed
