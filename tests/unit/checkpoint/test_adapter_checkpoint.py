"""Adapters-only checkpoints in one process: what they hold, that they load exactly into a
fresh peft model and leave its base as it is, and every refusal (a model without adapters,
nothing frozen, the wrong model on load, a manifest that does not say what it holds).
The same at worlds 2 and 4: tests/distributed/test_adapter_checkpoints.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from shardwise.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_dcp_metadata,
    read_manifest,
    save_checkpoint,
)
from shardwise.testing.models import GPT, GPTConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def llama(**overrides: int) -> nn.Module:
    config = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)  # the base: the same in every model built here
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides}))


def lora(adapter_seed: int = 1, base: nn.Module | None = None, **config: object) -> nn.Module:
    base = llama() if base is None else base
    torch.manual_seed(adapter_seed)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False}
    name = str(config.pop("adapter_name", "default"))
    return peft.get_peft_model(base, peft.LoraConfig(**{**settings, **config}), adapter_name=name)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> float:
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def trained(steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = lora()
    optimizer = adamw(model)
    for i in range(steps):
        step(model, optimizer, i)
    return model, optimizer


def split(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable, frozen) parameters, cloned."""
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in named.items() if n in grads}, {
        n: t for n, t in named.items() if n not in grads
    }


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state_dict()["state"].values() for t in state.values()]


def test_an_adapters_only_checkpoint_holds_the_trainable_tensors_and_their_state(tmp_path):
    model, optimizer = trained()
    path = save_checkpoint(tmp_path, model, optimizer, step=2, adapters_only=True)
    manifest = read_manifest(path)
    assert manifest["contents"] == "adapters"
    record = manifest["adapters"]
    trainable, frozen = split(model)
    assert (record["method"], record["names"], record["prefix"]) == (
        "LORA", ["default"], "base_model.model."
    )  # fmt: skip
    assert record["configs"]["default"]["r"] == 4
    assert record["trainable"] == list(trainable)
    assert record["trainable_elements"] == sum(t.numel() for t in trainable.values())
    layers = {n.removesuffix(".lora_A.default.weight") for n in trainable if ".lora_A." in n}
    assert record["lora_scaling"] == {layer: {"default": 2.0} for layer in layers}  # alpha / r
    base = record["base"]
    assert (base["class"], base["parameters"]) == ("LlamaForCausalLM", len(frozen))
    assert base["elements"] == sum(t.numel() for t in frozen.values())
    keys = set(read_dcp_metadata(path / "state").state_dict_metadata)
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == set(trainable)
    optim = [k.removeprefix("optim.") for k in keys if k.startswith("optim.")]
    assert len(optim) == 3 * len(trainable)  # step, exp_avg, exp_avg_sq of each, nothing else
    assert {k.rpartition(".")[0] for k in optim} == set(trainable)


def test_a_tied_frozen_head_stays_out_of_an_adapters_only_checkpoint(tmp_path):
    # torch's ignore_frozen_params drops a frozen parameter under its first name only: the
    # tied lm_head.weight (the embedding matrix again) stayed in the state dict.
    config = transformers.Qwen2Config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = lora(base=transformers.Qwen2ForCausalLM(config))
    path = save_checkpoint(tmp_path, model, adamw(model), step=0, adapters_only=True)
    keys = read_dcp_metadata(path / "state").state_dict_metadata
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == trainable
    torch.manual_seed(0)
    fresh = lora(adapter_seed=7, base=transformers.Qwen2ForCausalLM(config))
    load_checkpoint(path, fresh, adamw(fresh))
    assert all(torch.equal(split(fresh)[0][n], t) for n, t in split(model)[0].items())


def test_it_loads_every_adapter_element_and_leaves_the_base_as_it_is(tmp_path):
    model, optimizer = trained()
    path = save_checkpoint(tmp_path, model, optimizer, step=2, adapters_only=True)
    fresh = lora(adapter_seed=7)  # other adapters: the load must win
    fresh_optimizer = adamw(fresh)
    before, base_before = split(fresh)
    assert not all(torch.equal(before[n], t) for n, t in split(model)[0].items())
    manifest = load_checkpoint(path, fresh, fresh_optimizer)
    assert manifest["step"] == 2
    (want, _), (got, base_after) = split(model), split(fresh)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(torch.equal(base_after[n], base_before[n]) for n in base_before)
    saved, loaded = optimizer_tensors(optimizer), optimizer_tensors(fresh_optimizer)
    assert len(saved) == len(loaded) == 3 * len(want)
    assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))
    # The next step is the uninterrupted run's, to the bit (one process, the same arithmetic).
    assert step(fresh, fresh_optimizer, 2) == step(model, optimizer, 2)
    assert all(torch.equal(split(fresh)[0][n], t) for n, t in split(model)[0].items())


def test_an_asynchronous_adapters_only_save_holds_the_same(tmp_path):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "full", model, optimizer, step=2, async_=True).result()
    pending = save_checkpoint(
        tmp_path / "async", model, optimizer, step=2, adapters_only=True, async_=True
    )  # after a full one: the reused CPU copy is made afresh for the smaller state
    path = pending.result()
    assert read_manifest(path)["contents"] == "adapters"
    keys = set(read_dcp_metadata(path / "state").state_dict_metadata)
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == set(
        split(model)[0]
    )
    fresh = lora(adapter_seed=7)
    fresh_optimizer = adamw(fresh)
    load_checkpoint(path, fresh, fresh_optimizer)
    assert all(torch.equal(split(fresh)[0][n], t) for n, t in split(model)[0].items())
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            optimizer_tensors(optimizer), optimizer_tensors(fresh_optimizer), strict=True
        )
    )


def test_a_full_checkpoint_of_a_peft_model_still_holds_and_loads_everything(tmp_path):
    model, optimizer = trained()
    path = save_checkpoint(tmp_path, model, optimizer, step=2)
    manifest = read_manifest(path)
    assert manifest["contents"] == "full" and manifest["adapters"]["method"] == "LORA"
    base = llama()
    with torch.no_grad():
        for p in base.parameters():
            p.add_(1.0)  # another base: a full checkpoint replaces it too
    fresh = lora(adapter_seed=7, base=base)
    load_checkpoint(path, fresh, adamw(fresh))
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )


def test_adapters_only_is_refused_without_adapters_or_without_a_frozen_base(tmp_path):
    gpt = GPT(GPTConfig())
    with pytest.raises(ValueError, match=r"adapters_only=True\) got a GPT, which has no adapters"):
        save_checkpoint(tmp_path, gpt, step=0, adapters_only=True)
    model = lora()
    for p in model.parameters():
        p.requires_grad_(True)
    with pytest.raises(ValueError, match="none is frozen"):
        save_checkpoint(tmp_path, model, step=0, adapters_only=True)
    with pytest.raises(TypeError, match=r"adapters_only='yes'\) must be True or False"):
        save_checkpoint(tmp_path, lora(), step=0, adapters_only="yes")  # type: ignore[call-overload]
    assert not list(tmp_path.iterdir())  # refused before anything was written


WRONG_MODELS = {
    "no adapters": (lambda: llama(), r"has no adapters"),
    "another method": (
        lambda: peft.get_peft_model(
            llama(), peft.IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj"])
        ),
        r"field adapters.method is 'LORA', but the model's is 'IA3'",
    ),
    "another adapter name": (lambda: lora(adapter_name="mine"), r"field adapters.names"),
    "another base": (
        lambda: lora(base=llama(intermediate_size=48)),
        r"adapters trained on a different base: manifest field adapters.base is a "
        r"LlamaForCausalLM with 21 frozen parameters \(5712 elements",
    ),
    "another alpha": (lambda: lora(lora_alpha=16), r"field adapters.lora_scaling\["),
    "other layers": (lambda: lora(target_modules=["q_proj"]), r"adapters.lora_scaling\["),
}


@pytest.mark.parametrize("case", list(WRONG_MODELS))
def test_loading_into_another_model_is_refused_naming_the_field(tmp_path, case):
    model, optimizer = trained()
    path = save_checkpoint(tmp_path, model, optimizer, step=2, adapters_only=True)
    build, message = WRONG_MODELS[case]
    wrong = build()
    before = {n: p.detach().clone() for n, p in wrong.named_parameters()}
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, wrong, adamw(wrong) if case != "no adapters" else None)
    assert all(torch.equal(p, before[n]) for n, p in wrong.named_parameters())  # untouched


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("contents", "weights", r"field contents is str 'weights', expected 'full' or 'adapters'"),
        ("adapters", ["LORA"], r"field adapters is list \['LORA'\], expected an object or null"),
        ("adapters", None, r"field contents is 'adapters' but field adapters is NoneType"),
    ],
)
def test_a_manifest_that_does_not_say_what_it_holds_is_refused(tmp_path, field, value, message):
    model, optimizer = trained(steps=1)
    path = save_checkpoint(tmp_path, model, optimizer, step=1, adapters_only=True)
    manifest = json.loads((path / "shardwise.json").read_text())
    manifest[field] = value
    (path / "shardwise.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, lora(), None)
