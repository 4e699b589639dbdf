"""Reading a peft model's structure without importing peft in shardwise: the base model and
its prefix, the method and adapters, the trainable parameters, and each adapted layer's
base layer."""

from __future__ import annotations

import pytest
from torch import nn

from shardwise.plan.adapters import adapted_layers, adapter_model
from shardwise.testing.models import GPT, GPTConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_lora_model_is_read_through_its_nesting():
    base = _llama()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    found = adapter_model(model)
    assert found is not None
    assert found.base is base and found.prefix == "base_model.model."
    assert (found.method, found.adapters) == ("LORA", ("default",))
    assert len(found.trainable) == 2 * 2 * 2  # 2 layers x 2 targets x (lora_A, lora_B)
    assert all(".lora_" in n for n in found.trainable)
    assert found.frozen == sum(p.numel() for p in base.parameters() if not p.requires_grad)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert found.base_name(f"{q}.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert found.base_name("lm_head.weight") is None  # outside the base model
    layers = adapted_layers(model)
    assert set(layers) == {f"base_model.model.model.layers.{i}.{m}" for i in range(2)
                           for m in ("self_attn.q_proj", "mlp.down_proj")}  # fmt: skip
    assert layers[q] is model.get_submodule(f"{q}.base_layer")


def test_another_method_and_named_adapters():
    config = peft.IA3Config(
        target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]
    )
    model = peft.get_peft_model(_llama(), config, adapter_name="mine")
    found = adapter_model(model)
    assert found is not None and (found.method, found.adapters) == ("IA3", ("mine",))


def test_a_plain_model_is_not_an_adapter_model():
    assert adapter_model(GPT(GPTConfig())) is None
    assert adapter_model(_llama()) is None
    assert adapted_layers(GPT(GPTConfig())) == {}
