"""The Engine and the Runner with adapter models, in one process: the adapter section
applied before wrapping, frozen parameters kept out of the optimizer and out of clipping,
and the Runner's adapters-only checkpoints (saved by default, resumed exactly)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import shardwise
from shardwise import Engine, ParallelConfig, Runner, RunnerConfig, TrainConfig
from shardwise.checkpoint import read_manifest
from shardwise.config.adapters import AdapterConfig
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches
from shardwise.train import read_metrics

peft = pytest.importorskip("peft")

LORA = AdapterConfig(r=4, alpha=8, target_modules=["qkv", "proj", "fc"])


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return random_lm_batches(GPTConfig(), 1, 4, seed=1)[0]


# --- the adapter section, applied by the Engine --------------------------------------------


def test_the_engine_applies_the_section_and_optimizes_the_adapters_only():
    engine = Engine(gpt(), lambda p: torch.optim.AdamW(p, lr=1e-2), adapter=LORA)
    model = shardwise.unwrap(engine.model)
    assert isinstance(model, peft.PeftModel)
    held = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert held == [p for p in model.parameters() if p.requires_grad] and len(held) == 16
    logs = engine.train_step(batch())
    assert logs["grad_norm"] > 0 and engine.step == 1


def test_an_adapter_section_for_a_wrapped_model_is_refused():
    wrapped = shardwise.wrap(gpt(), ParallelConfig())
    with pytest.raises(ValueError, match=r"already wrapped, and peft must add its adapter layers"):
        Engine(wrapped, lambda p: torch.optim.SGD(p, lr=0.1), adapter=LORA)


# --- frozen parameters in an optimizer object ------------------------------------------------


def frozen_and_trainable(model: torch.nn.Module) -> tuple[list, list]:
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return frozen, [p for p in model.parameters() if p.requires_grad]


def test_an_optimizer_holding_the_frozen_base_steps_and_clips_the_adapters_only():
    """AdamW(model.parameters()), the usual idiom (and mmengine's default constructor), puts
    the frozen base in the optimizer. A gradient left on a frozen parameter (a backward
    before freezing) must neither move it nor count in the clipping norm."""
    model = peft.get_peft_model(gpt(), LORA.peft_config())
    frozen, trainable = frozen_and_trainable(model)
    for p in frozen:
        p.grad = torch.ones_like(p)  # stale, and large: the norm would be about 170
    base = [p.detach().clone() for p in frozen]
    optimizer = torch.optim.AdamW(
        [{"params": frozen, "lr": 0.1}, {"params": trainable}], lr=0.1, weight_decay=0.1
    )
    engine = Engine(model, optimizer, train=TrainConfig(max_grad_norm=0.01))
    assert [len(g["params"]) for g in optimizer.param_groups] == [0, len(trainable)]

    reference = peft.get_peft_model(gpt(), LORA.peft_config())  # the same, without the stale
    ref_trainable = frozen_and_trainable(reference)[1]
    reference(*batch()).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref_trainable, 0.01)
    logs = engine.train_step(batch())
    assert logs["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert float(norm) > 0.01  # clipping acted
    assert all(torch.equal(p, b) for p, b in zip(frozen, base, strict=True))


def test_a_parameter_frozen_after_the_engine_was_built_is_not_stepped_or_clipped():
    model = gpt()
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train=TrainConfig(max_grad_norm=0.5)
    )
    head = model.ln_f.weight
    head.requires_grad_(False)
    head.grad = torch.full_like(head, 100.0)  # would dominate the norm, and move it by 10
    before = head.detach().clone()
    logs = engine.train_step(batch())
    assert logs["grad_norm"] < 10
    assert torch.equal(head, before) and head.grad is None


# --- the Runner's checkpoints of an adapter model ------------------------------------------


def runner(tmp_path, name: str, model: torch.nn.Module, adapter=None, **cfg) -> Runner:
    engine = Engine(model, lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), adapter=adapter)
    data = TensorDataset(*random_lm_batches(GPTConfig(), 1, 16, seed=1)[0])
    config = RunnerConfig(run_dir=str(tmp_path / name), batch_size=4, max_epochs=None,
                          progress=False, seed=3, **cfg)  # fmt: skip
    return Runner(engine, data, config=config)


def test_adapters_only_is_the_default_for_an_adapter_model_and_resumes_exactly(tmp_path):
    whole = runner(tmp_path, "whole", gpt(), LORA, max_steps=4, save_every=2)
    assert whole.adapters_only
    whole.fit()
    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    assert read_manifest(step2)["contents"] == "adapters"
    torch.manual_seed(7)  # other adapters: the resume must bring the saved ones back
    resumed = runner(tmp_path, "resumed", gpt(), LORA, max_steps=4, resume=str(step2))
    resumed.fit()
    rows = [
        (r["step"], r["loss"]) for r in read_metrics(tmp_path / "whole") if r["split"] == "train"
    ]
    again = [
        (r["step"], r["loss"]) for r in read_metrics(tmp_path / "resumed") if r["split"] == "train"
    ]
    assert len(rows) == 4 and again == rows[2:]


def test_save_adapters_only_settings(tmp_path):
    assert not runner(tmp_path, "a", gpt(), max_steps=1).adapters_only  # no adapters
    assert not runner(
        tmp_path, "b", gpt(), LORA, max_steps=1, save_adapters_only=False
    ).adapters_only
    assert runner(tmp_path, "c", gpt(), LORA, max_steps=1, save_adapters_only=True).adapters_only
    with pytest.raises(ValueError, match=r"save_adapters_only=True, but the model has no adapters"):
        runner(tmp_path, "d", gpt(), max_steps=1, save_adapters_only=True)
    everything = peft.get_peft_model(gpt(), LORA.peft_config())
    for p in everything.parameters():
        p.requires_grad_(True)  # nothing frozen: a "base" would be the whole model
    assert not runner(tmp_path, "e", everything, max_steps=1).adapters_only
    with pytest.raises(ValueError, match=r"has no frozen base \(all of it trains\)"):
        runner(tmp_path, "f", everything, max_steps=1, save_adapters_only=True)
