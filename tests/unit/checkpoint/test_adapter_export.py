"""Exports of an adapter model in one process: peft's own format (the keys peft writes, the
files `PeftModel.from_pretrained` opens) and merged weights (equal to peft's
`merge_and_unload`, opened by `from_pretrained`), from a live model, from a checkpoint and
from the command line; and what cannot be exported or merged is refused before `out` is
touched. The same under full_shard at world 2: tests/distributed/test_adapter_checkpoints.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shardwise.checkpoint import export_weights, save_checkpoint
from shardwise.checkpoint.adapters import adapter_record, peft_key
from shardwise.cli.main import main
from shardwise.testing.models import GPT, GPTConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

DECODER = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=32, max_position_embeddings=16,
)  # fmt: skip
TARGETS = ["q_proj", "v_proj", "down_proj"]
IDS = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(5))


def base(family: str = "llama") -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=32,
                                         n_positions=16)  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if family == "qwen2":  # attention biases, tied embeddings
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**DECODER, tie_word_embeddings=True)
        )
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))
    return llama.to(torch.bfloat16) if family == "llama_bf16" else llama


def adapted(config: object, family: str = "llama", name: str = "default") -> nn.Module:
    # llama_bf16_adapters: peft leaves the adapters in the base's bf16 (they are fp32 else)
    own_dtype = family == "llama_bf16_adapters"
    family = "llama_bf16" if own_dtype else family
    model = peft.get_peft_model(
        base(family), config, adapter_name=name, autocast_adapter_dtype=not own_dtype
    )
    torch.manual_seed(1)
    with torch.no_grad():  # "trained": every trainable tensor away from its initial value
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def lora(**overrides: object) -> object:
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **overrides})


KEY_CASES = {
    "lora, modules_to_save": ("llama", lora(modules_to_save=["lm_head"]), "default"),
    "lora, a named adapter": ("llama", lora(), "mine"),
    "lora, bias='all'": ("qwen2", lora(bias="all"), "default"),
    "dora": ("llama", lora(use_dora=True), "default"),
    "ia3": ("llama", peft.IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj"]),
            "default"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(KEY_CASES))
def test_adapter_keys_are_the_ones_peft_writes(case):
    family, config, name = KEY_CASES[case]
    model = peft.get_peft_model(base(family), config, adapter_name=name)
    record = adapter_record(model)
    assert record is not None
    mine = sorted(peft_key(n, name) for n in record["trainable"])
    assert mine == sorted(peft.get_peft_model_state_dict(model, adapter_name=name))


def logits(model: nn.Module) -> torch.Tensor:
    model.eval()  # GPT-2's dropout
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_the_adapter_export_is_peft_own_and_opens_in_peft(tmp_path):
    model = adapted(lora(modules_to_save=["lm_head"]))
    written = export_weights(model, tmp_path / "out")  # kind="auto": an adapter model's own
    assert written == tmp_path / "out" / "adapter_model.safetensors"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]  # fmt: skip
    model.save_pretrained(tmp_path / "peft")
    ours, theirs = load_file(written), load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    for c in (config, peft_config):
        c["target_modules"] = sorted(c["target_modules"])  # a set: peft writes it unordered
    assert config == peft_config
    opened = peft.PeftModel.from_pretrained(base(), tmp_path / "out")
    assert torch.equal(logits(opened), logits(model))


MERGE_CASES = {
    "lora, modules_to_save": ("llama", lora(modules_to_save=["lm_head"])),
    "rslora, alpha_pattern": ("llama", lora(use_rslora=True, alpha_pattern={"down_proj": 16})),
    "fan_in_fan_out (Conv1D)": ("gpt2", lora(target_modules=["attn.c_proj"], fan_in_fan_out=True)),
    # Conv1D stores (in, out): a square layer cannot tell the orientation, c_attn (16 -> 48)
    # and c_fc (16 -> 64) can
    "fan_in_fan_out, not square": (
        "gpt2", lora(target_modules=["attn.c_attn", "mlp.c_fc"], fan_in_fan_out=True)
    ),
    "tied embeddings, biases": ("qwen2", lora()),
    # A bf16 base with fp32 adapters: the fp32 delta is added to the weight, one rounding;
    # with bf16 adapters peft holds the delta in bf16 first, two roundings: the same bits.
    "bf16": ("llama_bf16", lora()),
    "bf16 adapters": ("llama_bf16_adapters", lora()),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_the_merged_export_equals_peft_merge_and_opens_in_transformers(tmp_path, case):
    family, config = MERGE_CASES[case]
    model = adapted(config, family)
    written = export_weights(model, tmp_path / "merged", kind="merged")
    assert written is not None and written.name == "model.safetensors"
    ours = load_file(written)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(merged)
    assert all(torch.equal(ours[k], merged[k]) for k in merged)  # the same arithmetic
    opened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(opened).__name__ == type(model.get_base_model()).__name__
    want = logits(model).float()
    rel = float((logits(opened).float() - want).norm() / want.norm())
    # measured: at most 1.8e-7 in fp32 (x(W + sBA) rounds unlike xW + s(xA)B); bf16: the
    # same, at bf16's rounding
    assert rel <= (2 * 2**-8 if family.startswith("llama_bf16") else 1e-5), rel


def files(directory: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for p in sorted(directory.iterdir()):
        if p.suffix == ".safetensors":
            out.update({f"{p.name}:{k}": v for k, v in load_file(p).items()})
        else:
            out[p.name] = json.loads(p.read_text())
    return out


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items()
    )


def test_exports_from_checkpoints_and_the_command_line_equal_the_live_ones(tmp_path):
    model = adapted(lora(modules_to_save=["lm_head"]))
    export_weights(model, tmp_path / "live-adapter")
    export_weights(model, tmp_path / "live-merged", kind="merged")
    full = save_checkpoint(tmp_path / "full", model, step=1)
    only = save_checkpoint(tmp_path / "adapters", model, step=1, adapters_only=True)
    export_weights(full, tmp_path / "full-adapter")
    export_weights(only, tmp_path / "only-adapter", kind="adapter")
    export_weights(full, tmp_path / "full-merged", kind="merged")
    for flag in ("--adapter", "--merged"):
        argv = ["checkpoint", "export", str(full), "--out", str(tmp_path / f"cli{flag}"), flag]
        assert main(argv) == 0
    live = files(tmp_path / "live-adapter")
    for d in ("full-adapter", "only-adapter", "cli--adapter"):
        assert same(files(tmp_path / d), live), d
    merged = files(tmp_path / "live-merged")
    for name in ("config.json", "generation_config.json"):  # a checkpoint holds no model object
        merged.pop(name)
    assert same(files(tmp_path / "full-merged"), merged)
    assert same(files(tmp_path / "cli--merged"), merged)
    # An adapter export replaces a merged one whole: no adapter_config.json left behind, which
    # would make from_pretrained load an adapter on top of merged weights; and back.
    export_weights(model, tmp_path / "live-merged", kind="adapter")
    assert not (tmp_path / "live-merged" / "model.safetensors").exists()
    export_weights(model, tmp_path / "live-adapter", kind="merged")
    assert not (tmp_path / "live-adapter" / "adapter_config.json").exists()


REFUSED = {
    "ia3": (
        lambda: adapted(peft.IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj"])),
        "merged", NotImplementedError, r"merging is implemented for LoRA; this model's method is IA3",
    ),
    "dora": (lambda: adapted(lora(use_dora=True)), "merged", NotImplementedError,
             r"the LoRA config has use_dora=True"),
    "embedding lora": (lambda: adapted(lora(target_modules=["embed_tokens", "q_proj"])), "merged",
                       NotImplementedError, r"embed_tokens is not a LoRA of a Linear layer"),
    "no adapters, kind='adapter'": (lambda: GPT(GPTConfig()), "adapter", ValueError,
                                    r"kind='adapter'\): the model has no adapters"),
    "an unknown kind": (lambda: adapted(lora()), "peft", ValueError,
                        r"kind='peft'\) is not one of \['auto', 'full', 'adapter', 'merged'\]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_exported_is_refused_before_out_is_touched(tmp_path, case):
    build, kind, error, message = REFUSED[case]
    with pytest.raises(error, match=message):
        export_weights(build(), tmp_path / "out", kind=kind)
    assert not list(tmp_path.iterdir())


def test_a_merge_needs_the_base_which_an_adapters_only_checkpoint_lacks(tmp_path):
    model = adapted(lora())
    path = save_checkpoint(tmp_path / "ck", model, step=1, adapters_only=True)
    with pytest.raises(ValueError, match=r"holds adapters only, no base weights to merge"):
        export_weights(path, tmp_path / "out", kind="merged")
    assert not (tmp_path / "out").exists()
    argv = ["checkpoint", "export", str(path), "--out", str(tmp_path / "out"), "--merged"]
    assert main(argv) == 2
