"""A peft model's tensor-parallel plan, read in one process: the base model's own plan
through peft's nesting, each adapted layer's entry given to its base layer and LoRA halves,
and what is refused (by message) before any process group exists."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise import ParallelConfig
from shardwise.parallelize.tensor import check_tensor_parallel, per_module

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

P = "base_model.model.model.layers.0"


def _base() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _llama(**lora: object) -> nn.Module:
    return peft.get_peft_model(_base(), peft.LoraConfig(**{"r": 4, **lora}))  # type: ignore[arg-type]


def _plan(model: nn.Module, **fields: object) -> dict:  # type: ignore[type-arg]
    checked = check_tensor_parallel(model, ParallelConfig(tp=2, **fields))  # type: ignore[arg-type]
    assert isinstance(checked.apply, dict)
    return per_module(model, checked.apply)


def test_the_base_models_plan_reaches_through_peft_and_each_half_follows_its_base():
    model = _llama(target_modules=["q_proj", "down_proj"])
    plan = _plan(model)
    q, down = f"{P}.self_attn.q_proj", f"{P}.mlp.down_proj"
    assert isinstance(plan[f"{q}.base_layer"], ColwiseParallel)
    b = plan[f"{q}.lora_B.default"]
    assert isinstance(b, ColwiseParallel) and b.input_layouts == (Replicate(),)
    assert f"{q}.lora_A.default" not in plan  # whole: its input is whole on every rank
    assert isinstance(plan[f"{down}.base_layer"], RowwiseParallel)
    a = plan[f"{down}.lora_A.default"]
    assert isinstance(a, RowwiseParallel)
    assert (a.input_layouts, a.output_layouts) == ((Shard(-1),), (Replicate(),))  # summed
    assert f"{down}.lora_B.default" not in plan
    assert q not in plan and down not in plan  # never the wrappers themselves
    assert isinstance(plan[f"{P}.self_attn.k_proj"], ColwiseParallel)  # not adapted: as is


@pytest.mark.parametrize(
    ("lora", "fields", "match"),
    [
        (
            {"target_modules": ["q_proj"], "use_dora": True},
            {},
            r"self_attn\.q_proj \(Linear\) holds \['lora_magnitude_vector'\], which shardwise cannot split",
        ),
        (
            {"target_modules": ["embed_tokens"]},
            {},
            r"model\.embed_tokens \(Embedding\) holds \['lora_embedding_A', 'lora_embedding_B'\]",
        ),
        (
            {"target_modules": ["down_proj"]},
            {"sequence_parallel": True},
            r"sequence_parallel with adapters: .*mlp\.down_proj is adapted",
        ),
    ],
    ids=["dora", "embedding", "sequence_parallel"],
)
def test_what_cannot_be_split_with_its_base_is_refused_before_any_group(lora, fields, match):
    with pytest.raises(NotImplementedError, match=match):
        _plan(_llama(**lora), **fields)


def test_ia3_is_refused_with_the_reason():
    config = peft.IA3Config(
        target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]
    )
    with pytest.raises(NotImplementedError, match=r"holds \['ia3_l'\].*IA³ scales split features"):
        _plan(peft.get_peft_model(_base(), config))


def test_a_module_trained_as_a_copy_is_split_like_its_original():
    plan = _plan(_llama(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    head = "base_model.model.lm_head"
    original, copy = plan[f"{head}.original_module"], plan[f"{head}.modules_to_save.default"]
    assert isinstance(original, ColwiseParallel) and isinstance(copy, ColwiseParallel)
    assert original.output_layouts == copy.output_layouts == (Replicate(),)  # gathered logits
    assert head not in plan


def test_every_adapter_loaded_on_a_layer_follows_its_base():
    """Issue 48: with a second adapter loaded beside the first (peft's add_adapter), each
    one's halves are split with the base layer, not only the first one's."""
    model = _llama(target_modules=["q_proj", "down_proj"])
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    plan = _plan(model)
    q, down = f"{P}.self_attn.q_proj", f"{P}.mlp.down_proj"
    for name in ("default", "second"):
        assert isinstance(plan[f"{q}.lora_B.{name}"], ColwiseParallel), name
        assert isinstance(plan[f"{down}.lora_A.{name}"], RowwiseParallel), name
