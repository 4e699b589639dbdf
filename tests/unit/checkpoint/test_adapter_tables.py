"""An adapter model's checkpoint record, export and merge, case by case (the five habits of
docs/testing.md): every prompt-learning method and several active adapters refused by an
export, each LoRA flag a merge does not implement, adapter_config.json with a task type as
peft writes it, a merge with a second adapter loaded beside the active one, and a load that
left a trainable tensor unfilled."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shardwise.checkpoint import export_weights
from shardwise.checkpoint.adapters import export_adapter, loaded_all_adapters, merge_plan
from shardwise.checkpoint.trust import CheckpointError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _record(method: str = "LORA", names: tuple[str, ...] = ("default",), **config: object) -> dict:  # type: ignore[type-arg]
    return {
        "method": method, "names": list(names), "prefix": "base_model.model.",
        "configs": {n: dict(config) for n in names}, "trainable": [], "lora_scaling": {},
        "base": {"class": "LlamaForCausalLM", "module": "transformers", "name_or_path": None},
    }  # fmt: skip


@pytest.mark.parametrize(
    "method", ["PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "CPT"]
)
def test_every_prompt_learning_method_is_refused_by_an_export(method: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"exporting a {method} model \(prompt "
                       r"learning\) is not supported"):  # fmt: skip
        export_adapter(_record(method), "export")


@pytest.mark.parametrize("names", [(), ("default", "second")], ids=["none", "two"])
def test_an_export_writes_one_active_adapter(names: tuple[str, ...]) -> None:
    with pytest.raises(NotImplementedError, match=rf"the model has {len(names)} active adapters"):
        export_adapter(_record(names=names), "export")
    assert export_adapter(_record(names=("mine",)), "export") == "mine"


@pytest.mark.parametrize("flag", ["use_dora", "lora_bias"])
def test_each_lora_flag_a_merge_does_not_implement_is_refused(flag: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"the LoRA config has {flag}=True"):
        merge_plan(_record(**{flag: True}), {})
    assert merge_plan(_record(**{flag: False}), {}) == []


DECODER = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=32, max_position_embeddings=16,
)  # fmt: skip


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))


def _trained(model: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():  # every adapter away from its initial value (lora_B starts at 0)
        for n, p in model.named_parameters():
            if ".lora_" in n or ".modules_to_save." in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_adapter_config_with_a_task_type_is_the_one_peft_writes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a task type peft records no auto_mapping (the task names the model class);
    only without one does it name the base's class and library."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(_llama(), config)
    export_weights(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "peft")
    ours, theirs = (json.loads((tmp_path / d / "adapter_config.json").read_text())
                    for d in ("ours", "peft"))  # fmt: skip
    assert theirs["task_type"] == "CAUSAL_LM" and not theirs.get("auto_mapping")
    assert ours == theirs


def test_a_merge_with_a_second_adapter_loaded_merges_the_active_one_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """peft's add_adapter loads a second adapter, with its own copy of lm_head, beside the
    active one: the merged weights are the active adapter's, as peft's merge_and_unload
    gives them, with no tensor of the other left over."""
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    model = peft.get_peft_model(_llama(), peft.LoraConfig(**config))  # type: ignore[arg-type]
    model.add_adapter("second", peft.LoraConfig(**config))  # type: ignore[arg-type]
    _trained(model)
    written = export_weights(model, tmp_path / "merged", kind="merged")
    assert written is not None
    ours = load_file(written)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(merged)
    assert all(torch.equal(ours[k], merged[k]) for k in merged)


def test_a_load_that_left_a_trainable_tensor_unfilled_is_refused() -> None:
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    loaded_all_adapters(model, frozen, "ck")  # the base is missing by design
    with pytest.raises(CheckpointError, match=rf"checkpoint ck: 1 trainable tensor\(s\) of the "
                       rf"model were not in it: \['{trainable[0]}'\]"):  # fmt: skip
        loaded_all_adapters(model, [*frozen, trainable[0]], "ck")
