"""An adapted layer's tp split, field by field and refusal by refusal (the five habits of
docs/testing.md): each LoRA half's layouts follow whatever layouts its base layer's style
has, not only torch's defaults, and an adapted layer that is not a Linear, or is planned
with another style than a column or row split, is refused by its reason."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)

from shardwise.parallelize.adapters import adapter_plan, lora_a_style, lora_b_style

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "base",
    [
        ColwiseParallel(),
        ColwiseParallel(output_layouts=Replicate()),  # a gathered output: lm_head's
        ColwiseParallel(use_local_output=False),
    ],
    ids=["default", "gathered output", "DTensor output"],
)
def test_lora_b_gives_its_output_the_layout_of_its_column_split_base(base: ColwiseParallel) -> None:
    b = lora_b_style(base)
    assert isinstance(b, ColwiseParallel)
    assert b.input_layouts == (Replicate(),)  # lora_A's output: whole on every rank
    assert (b.output_layouts, b.use_local_output) == (base.output_layouts, base.use_local_output)


@pytest.mark.parametrize(
    "base",
    [RowwiseParallel(), RowwiseParallel(input_layouts=Replicate())],
    ids=["default", "whole input"],
)
def test_lora_a_takes_its_input_in_the_layout_of_its_row_split_base(base: RowwiseParallel) -> None:
    a = lora_a_style(base)
    assert isinstance(a, RowwiseParallel)
    assert a.input_layouts == base.input_layouts
    assert (a.output_layouts, a.use_local_output) == ((Replicate(),), True)  # summed over tp
    assert RowwiseParallel().input_layouts == (Shard(-1),)  # the default the first case reads


def test_an_adapted_layer_that_is_not_a_linear_is_refused() -> None:
    """GPT-2's projections are transformers' Conv1D, (in, out) weights."""
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=4, vocab_size=32, n_positions=8)
    model = peft.get_peft_model(
        transformers.GPT2LMHeadModel(config),
        peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True),
    )
    name = "base_model.model.transformer.h.0.attn.c_attn"
    with pytest.raises(NotImplementedError, match=rf"{name} adapts a Conv1D; shardwise splits "
                       r"adapters on linear layers only"):  # fmt: skip
        adapter_plan(model, {name: ColwiseParallel()}, sequence_parallel=False)


def test_an_adapted_layer_planned_with_another_style_is_refused() -> None:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    style = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    with pytest.raises(NotImplementedError, match=rf"{name} is planned as PrepareModuleInput; "
                       r"shardwise splits an adapter only with a column or row split"):  # fmt: skip
        adapter_plan(model, {name: style}, sequence_parallel=False)
    plan = adapter_plan(model, {name: ColwiseParallel()}, sequence_parallel=False)
    assert set(plan) == {f"{name}.base_layer", f"{name}.lora_B.default"}
