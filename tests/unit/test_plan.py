"""Wrap plan with the policy forms of the core issue: classes, class names, callables."""

import json

import pytest
import torch
from torch import nn

from shardwise import ParallelConfig, plan_wrap
from shardwise.models import GPT, MLP, Attention, Block, GPTConfig

CFG = GPTConfig(n_layers=3)


def test_block_policy_units_in_post_order_root_last():
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={Block}))
    assert [u.fqn for u in plan] == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert [u.module_class for u in plan] == ["Block"] * 3 + ["GPT"]
    assert [u.reshard_after_forward for u in plan] == [True, True, True, False]


def test_params_counted_once_including_tied_embedding():
    model = GPT(CFG)
    plan = plan_wrap(model, ParallelConfig(auto_wrap_policy={Block}))
    assert plan.total_params == model.num_params()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert plan.units[0].num_params == block
    # The root owns everything outside blocks: the tied embedding/head counted once.
    d, v, t = CFG.d_model, CFG.vocab_size, CFG.seq_len
    assert plan.units[-1].num_params == v * d + t * d + 2 * d
    assert plan.units[-1].bytes_by_dtype == {"float32": 4 * (v * d + t * d + 2 * d)}


def test_nested_classes_children_before_parents():
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={Block, Attention, MLP}))
    fqns = [u.fqn for u in plan]
    assert fqns.index("blocks.0.attn") < fqns.index("blocks.0")
    assert fqns.index("blocks.0.mlp") < fqns.index("blocks.0")
    assert plan.units[fqns.index("blocks.0")].num_params == 4 * CFG.d_model  # two LayerNorms


def test_no_policy_is_root_only():
    plan = plan_wrap(GPT(CFG), ParallelConfig())
    assert [u.fqn for u in plan] == [""]


def test_class_names_resolve_against_model():
    by_name = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={"Block"}))
    by_class = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={Block}))
    assert by_name == by_class


def test_unknown_class_name_lists_closest_and_present():
    with pytest.raises(
        ValueError,
        match=r"names class 'Blok', which is not in the model\. Did you mean 'Block'\? Parameter-holding classes present: \['Attention', 'Block'",
    ):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={"Blok"}))


def test_policy_matching_nothing_lists_classes():
    with pytest.raises(
        ValueError,
        match=r"auto_wrap_policy=\['Conv2d'\] matches no submodule of GPT\. Parameter-holding classes present",
    ):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={nn.Conv2d}))


def test_non_module_in_policy():
    with pytest.raises(TypeError, match=r"contains 3, which is not an nn.Module subclass"):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=[3]))


def test_empty_policy():
    with pytest.raises(ValueError, match=r"auto_wrap_policy is an empty collection"):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=set()))


def test_fqn_callable_policy():
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=lambda fqn, m: fqn == "blocks.1"))
    assert [u.fqn for u in plan] == ["blocks.1", ""]


def test_fsdp1_style_callable_is_honoured():
    seen = []

    def fsdp1_policy(module, recurse, nonwrapped_numel):
        seen.append(recurse)
        return isinstance(module, MLP) and nonwrapped_numel > 0

    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=fsdp1_policy))
    assert [u.fqn for u in plan] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp", ""]
    assert set(seen) == {False}


def test_plan_prints_and_serialises():
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={Block}, mixed_precision="bf16"))
    text = str(plan)
    assert "4 unit(s)" in text and "<root>" in text and "blocks.2" in text
    data = json.loads(plan.to_json())
    assert data["total_params"] == plan.total_params
    assert [u["fqn"] for u in data["units"]] == ["blocks.0", "blocks.1", "blocks.2", ""]


def test_plan_on_meta_equals_materialised_plan():
    cfg = ParallelConfig(auto_wrap_policy={Block})
    with torch.device("meta"):
        meta_model = GPT(CFG)
    assert plan_wrap(meta_model, cfg) == plan_wrap(GPT(CFG), cfg)


def test_frozen_params_counted():
    model = GPT(CFG)
    model.blocks[0].requires_grad_(False)
    unit = plan_wrap(model, ParallelConfig(auto_wrap_policy={Block})).units[0]
    assert unit.frozen_params == unit.num_params and unit.trainable_params == 0
