"""The run file's `adapter` section: read strictly, and applied with peft before wrapping."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import yaml

from shardwise.config.adapters import AdapterConfig, apply_adapter
from shardwise.config.run_file import (
    Config,
    ConfigError,
    dump_config,
    from_dict,
    load_config,
    reference_markdown,
)
from shardwise.parallelize import init_empty
from shardwise.testing.models import GPT, GPTConfig

peft = pytest.importorskip("peft")

SECTION = "adapter: {r: 4, alpha: 8, dropout: 0.1, target_modules: [qkv, fc]}\n"


def loaded(tmp_path, text: str, overrides: tuple[str, ...] = ()) -> Config:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path, overrides)


# --- reading -----------------------------------------------------------------------------


def test_the_section_is_read_into_an_adapter_config(tmp_path):
    cfg = loaded(tmp_path, "runner: {max_steps: 3}\n" + SECTION)
    assert cfg.adapter == AdapterConfig(r=4, alpha=8.0, dropout=0.1, target_modules=["qkv", "fc"])
    assert cfg.runner.max_steps == 3


def test_without_the_section_or_with_null_the_whole_model_trains(tmp_path):
    assert loaded(tmp_path, "runner: {max_steps: 3}\n").adapter is None
    assert loaded(tmp_path, "adapter: null\n").adapter is None
    assert loaded(tmp_path, SECTION, ("adapter=",)).adapter is None  # removed by an override


def test_an_override_adds_the_section_with_its_defaults(tmp_path):
    cfg = loaded(tmp_path, "runner: {max_steps: 3}\n", ("adapter.r=16", "adapter.use_dora=true"))
    assert cfg.adapter == AdapterConfig(r=16, use_dora=True)
    cfg = loaded(tmp_path, SECTION, ("adapter.r=2",))  # a key over the file keeps the others
    assert cfg.adapter is not None and (cfg.adapter.r, cfg.adapter.alpha) == (2, 8.0)


def test_the_section_survives_dump_and_load():
    config = Config(adapter=AdapterConfig(r=4, target_modules="all-linear", modules_to_save=["x"]))
    assert from_dict(Config, yaml.safe_load(dump_config(config))) == config
    assert from_dict(Config, yaml.safe_load(dump_config(Config()))) == Config()


@pytest.mark.parametrize(
    ("key", "hint"),
    [("alhpa", "alpha"), ("lora_alpha", "alpha"), ("rank", "r"), ("lora_dropout", "dropout")],
)
def test_an_unknown_key_names_the_closest_one(tmp_path, key, hint):
    with pytest.raises(ConfigError, match=rf"unknown key 'adapter.{key}'. Did you mean '{hint}'\?"):
        loaded(tmp_path, f"adapter: {{{key}: 4}}\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("adapter: lora", r"adapter: expected a section \(a mapping of keys, or null"),
        ("adapter: {r: 0}", r"AdapterConfig.r=0 must be an int >= 1"),
        ("adapter: {r: 2.5}", r"adapter.r: expected int"),
        ("adapter: {alpha: -1}", r"AdapterConfig.alpha=-1.0 must be a finite number > 0"),
        ("adapter: {dropout: 1.0}", r"AdapterConfig.dropout=1.0 must be in \[0, 1\)"),
        ("adapter: {method: ia3}", r"adapter.method='ia3' is not allowed. .*\['lora'\]"),
        ("adapter: {target_modules: []}", r"target_modules=\[\] must be a non-empty list"),
        ("adapter: {target_modules: 5}", r"adapter.target_modules: expected list\[str\]"),
    ],
)
def test_bad_values_are_refused_at_load(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        loaded(tmp_path, text + "\n")


def test_the_reference_lists_the_section():
    ref = reference_markdown()
    assert "### `adapter` (AdapterConfig, absent by default" in ref
    for field in dataclasses.fields(AdapterConfig):
        assert f"`adapter.{field.name}`" in ref
    assert "Rank of each adapter (peft's r)." in ref


# --- applying ------------------------------------------------------------------------------


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig())


def test_apply_adds_lora_and_freezes_the_base():
    model = apply_adapter(gpt(), AdapterConfig(r=4, alpha=8, target_modules=["qkv", "fc"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 8 and all(".lora_" in n for n in trainable)  # 2 layers x 2 blocks
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 8, ["fc", "qkv"])
    layer = model.base_model.model.blocks[0].attn.qkv
    assert layer.scaling["default"] == 2.0  # alpha / r
    assert torch.equal(layer.lora_B["default"].weight, torch.zeros(96, 4))  # starts as no change


def test_no_section_returns_the_model_itself():
    model = gpt()
    assert apply_adapter(model, None) is model


def test_a_mistyped_target_is_refused_with_the_closest_layer():
    # peft itself adapts the names that match and silently drops the rest
    with pytest.raises(
        ValueError, match=r"target_modules: 'qvk' matches no module .* Did you mean 'qkv'\?"
    ):
        apply_adapter(gpt(), AdapterConfig(target_modules=["qvk", "fc"]))
    with pytest.raises(ValueError, match=r"modules_to_save: 'haed' matches no module"):
        apply_adapter(gpt(), AdapterConfig(target_modules=["qkv"], modules_to_save=["haed"]))


@pytest.mark.parametrize(
    ("alpha", "given", "scaling"),
    [(2.5, 2.5, 0.625), (0.5, 0.5, 0.125), (16.0, 16, 4.0), (3.0, 3, 0.75)],
)
def test_alpha_reaches_peft_as_given_fractions_and_all(alpha, given, scaling):
    """Fourth audit: a fractional alpha is the adapter's scale (alpha / r); a whole one is
    passed as an int (as peft's own configs hold it), never a fraction cut to one."""
    config = AdapterConfig(r=4, alpha=alpha, target_modules=["qkv"])
    passed = config.peft_config().lora_alpha  # type: ignore[attr-defined]
    assert (passed, type(passed)) == (given, type(given))
    model = apply_adapter(gpt(), config)
    assert model.base_model.model.blocks[0].attn.qkv.scaling == {"default": scaling}


_LAYERS = "Its adaptable layers are named ['tok_emb', 'pos_emb', 'qkv', 'proj', 'fc', 'head']."


@pytest.mark.parametrize(
    ("key", "name", "near"),
    [("target_modules", "kv", "qkv"), ("target_modules", "c", "fc"),
     ("modules_to_save", "ead", "head")],
)  # fmt: skip
def test_a_name_that_is_only_the_tail_of_a_layers_name_is_refused(key, name, near):
    """Fourth audit: peft adapts a path equal to the name or ending in '.' + name; 'kv' is
    the end of 'qkv' but no layer of its own, so peft would silently leave it out."""
    fields = {"target_modules": [name, "proj"]} if key == "target_modules" else {
        "target_modules": ["qkv"], "modules_to_save": [name]}  # fmt: skip
    with pytest.raises(ValueError) as caught:
        apply_adapter(gpt(), AdapterConfig(**fields))  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"AdapterConfig.{key}: {name!r} matches no module of this GPT. Did you mean "
        f"{near!r}? {_LAYERS}"
    )


def test_a_model_peft_does_not_know_needs_target_modules():
    with pytest.raises(
        ValueError, match=r"target_modules=None: peft has no default layers for a GPT"
    ):
        apply_adapter(gpt(), AdapterConfig())


def test_a_model_with_adapters_already_is_refused():
    model = apply_adapter(gpt(), AdapterConfig(target_modules=["qkv"]))
    with pytest.raises(ValueError, match=r"already has adapters \(\['default'\]\)"):
        apply_adapter(model, AdapterConfig(target_modules=["fc"]))


def test_a_model_on_meta_is_refused():
    with init_empty():
        model = GPT(GPTConfig())
    with pytest.raises(ValueError, match=r"on the meta device.*lora_B = 0"):
        apply_adapter(model, AdapterConfig(target_modules=["qkv"]))


def test_without_peft_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ImportError, match=r"needs peft, .*`pip install shardwise\[peft\]`"):
        apply_adapter(gpt(), AdapterConfig(target_modules=["qkv"]))


@pytest.mark.heavy
def test_reading_a_run_file_does_not_import_peft(tmp_path):
    (tmp_path / "run.yaml").write_text(SECTION)
    code = (
        "import sys, shardwise\n"
        "from shardwise.config.run_file import load_config\n"
        f"assert load_config({str(tmp_path / 'run.yaml')!r}).adapter.r == 4\n"
        "assert 'peft' not in sys.modules, 'peft imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- every entry of the section's tables ---------------------------------------------------


@pytest.mark.parametrize(
    ("key", "hint"),
    [("rank", "r"), ("lora_r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout"),
     ("target_layers", "target_modules"), ("dora", "use_dora"), ("rslora", "use_rslora")],
)  # fmt: skip
def test_every_other_tools_name_points_to_its_key(tmp_path, key, hint):
    with pytest.raises(ConfigError, match=rf"unknown key 'adapter.{key}'. Did you mean '{hint}'\?"):
        loaded(tmp_path, f"adapter: {{{key}: 4}}\n")


def test_every_default_of_the_section(tmp_path):
    cfg = loaded(tmp_path, "adapter: {}\n").adapter
    assert cfg == AdapterConfig()
    assert (cfg.method, cfg.r, cfg.alpha, cfg.dropout) == ("lora", 8, 16.0, 0.0)
    assert (cfg.target_modules, cfg.modules_to_save, cfg.use_dora, cfg.use_rslora) == (
        None, None, False, False)  # fmt: skip


def test_every_field_reaches_its_peft_name():
    config = AdapterConfig(r=3, alpha=5.5, dropout=0.25, target_modules=["qkv"],
                           modules_to_save=["head"], use_dora=True, use_rslora=True)  # fmt: skip
    lora = config.peft_config()
    got = {name: getattr(lora, name) for name in ("r", "lora_alpha", "lora_dropout",
           "modules_to_save", "use_dora", "use_rslora")}  # fmt: skip
    assert got == {"r": 3, "lora_alpha": 5.5, "lora_dropout": 0.25, "modules_to_save": ["head"],
                   "use_dora": True, "use_rslora": True}  # fmt: skip
    assert set(lora.target_modules) == {"qkv"}  # type: ignore[attr-defined]
