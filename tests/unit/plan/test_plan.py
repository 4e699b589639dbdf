"""The wrap planner: every policy form, tied/frozen/fp32 handling, and the errors."""

import contextlib
import json
import re
import warnings

import pytest
import torch
from torch import nn

import shardwise
from shardwise import ParallelConfig, PlanNotice, plan_wrap
from shardwise.plan import detect_blocks, registered_policies
from shardwise.testing.models import (
    GPT,
    MLP,
    Attention,
    Block,
    ConvNet,
    CrossTied,
    Embeddings,
    GPTConfig,
)
from shardwise.testing.models import LoRALM as LoRAModel

CFG = GPTConfig(n_layers=3)


def units(plan):
    return [(u.fqn, u.module_class, u.reason) for u in plan]


# --- models for the plans the issue names ------------------------------------------------


class NoDeclaredBlocks(GPT):
    """The GPT without a _no_split_modules declaration: blocks must be found by repetition."""

    _no_split_modules = None


class Nested(nn.Module):
    """Sizes chosen so `size` (min 2,000) must pick at different depths."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # 4,160 each
        self.inner = nn.Sequential(
            nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)),  # 2,112 together
            nn.Linear(32, 32),  # 1,056
        )
        self.small = nn.Linear(8, 8)  # 72


# --- policies -------------------------------------------------------------------------------


def test_auto_is_the_default_and_uses_no_split_modules():
    plan = plan_wrap(GPT(CFG), ParallelConfig())
    assert units(plan) == [
        ("blocks.0", "Block", "policy"),
        ("blocks.1", "Block", "policy"),
        ("blocks.2", "Block", "policy"),
        ("", "GPT", "root"),
    ]
    assert plan.policy == "auto: 3x Block in GPT._no_split_modules (from _no_split_modules)"
    assert [u.reshard_after_forward for u in plan] == [True, True, True, False]


def test_auto_finds_repeated_children_without_declaration():
    plan = plan_wrap(NoDeclaredBlocks(CFG), ParallelConfig())
    assert [u.fqn for u in plan] == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert plan.policy == "auto: 3x Block in blocks (from repeated children)"


def test_auto_prefers_outermost_composite_blocks():
    inner = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2)])
    found = detect_blocks(nn.Sequential(inner, nn.Linear(4, 4)))
    # Linear repeats inside each block too, but the composite Sequential blocks win.
    assert [c.__name__ for c in found.classes] == ["Sequential"]


def test_auto_without_blocks_is_root_only_and_says_so():
    plan = plan_wrap(nn.Linear(4, 4), ParallelConfig())
    assert [u.fqn for u in plan] == [""]
    assert "no repeated blocks found" in plan.policy


def test_class_policy_units_in_post_order_root_last():
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={Block, Attention, MLP}))
    fqns = [u.fqn for u in plan]
    assert fqns.index("blocks.0.attn") < fqns.index("blocks.0") < fqns.index("blocks.1.attn")
    assert plan.unit("blocks.0").num_params == 4 * CFG.d_model  # only its two LayerNorms
    assert fqns[-1] == ""


def test_params_counted_once_including_tied_embedding():
    model = GPT(CFG)
    plan = plan_wrap(model, ParallelConfig(auto_wrap_policy={Block}))
    assert plan.total_params == model.num_params()
    d, v, t = CFG.d_model, CFG.vocab_size, CFG.seq_len
    assert plan.unit("").num_params == v * d + t * d + 2 * d
    assert plan.unit("").bytes_by_dtype == {"float32": 4 * (v * d + t * d + 2 * d)}
    assert plan.tied == [["tok_emb.weight", "head.weight"]]


def test_class_names_resolve_against_model():
    assert units(plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={"Block"}))) == units(
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={Block}))
    )


def test_size_policy_on_gpt_picks_blocks():
    block = sum(p.numel() for p in GPT(CFG).blocks[0].parameters())
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy="size", min_num_params=block))
    assert [u.fqn for u in plan] == ["blocks.0", "blocks.1", "blocks.2", ""]


def test_size_policy_chooses_at_different_depths():
    plan = plan_wrap(Nested(), ParallelConfig(auto_wrap_policy="size", min_num_params=2000))
    assert units(plan) == [
        ("big.0", "Linear", "policy"),
        ("big.1", "Linear", "policy"),
        ("inner.0", "Sequential", "policy"),
        ("", "Nested", "root"),
    ]
    # big owns nothing once both Linears are units; inner.1 and small stay in the root.
    assert plan.unit("").num_params == 1056 + 72


def test_regex_policy_fullmatches_fqns():
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=r"re:blocks\.[02]"))
    assert [u.fqn for u in plan] == ["blocks.0", "blocks.2", ""]


def test_fqn_callable_policy():
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=lambda fqn, m: fqn == "blocks.1"))
    assert [u.fqn for u in plan] == ["blocks.1", ""]


def test_fsdp1_style_callable_gets_nonwrapped_numel():
    seen = {}

    def fsdp1_policy(module, recurse, nonwrapped_numel):
        seen[type(module).__name__] = nonwrapped_numel
        return isinstance(module, MLP)

    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=fsdp1_policy))
    assert [u.fqn for u in plan] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp", ""]
    # A Block is asked after its MLP became a unit: the MLP's parameters no longer count.
    mlp = sum(p.numel() for p in GPT(CFG).blocks[0].mlp.parameters())
    assert seen["Block"] == sum(p.numel() for p in GPT(CFG).blocks[0].parameters()) - mlp


def test_registered_policy_by_name():
    @shardwise.register_wrap_policy("test_attention_only")
    def attention_only(model, config):
        return {Attention}

    assert "test_attention_only" in registered_policies()
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy="test_attention_only"))
    assert [u.fqn for u in plan][:2] == ["blocks.0.attn", "blocks.1.attn"]
    assert plan.policy.startswith("test_attention_only: classes ['Attention']")


def test_registering_a_taken_name_fails():
    with pytest.raises(ValueError, match=r"a policy named 'auto' is already registered"):
        shardwise.register_wrap_policy("auto")(lambda model, config: None)
    with pytest.raises(ValueError, match=r"use a non-empty name that does not start with 're:'"):
        shardwise.register_wrap_policy("re:x")


def test_builtin_names_registered():
    assert {"auto", "none", "size", "transformer_blocks"} <= set(registered_policies())
    assert [u.fqn for u in plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy="none"))] == [""]
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy="transformer_blocks"))
    assert [u.fqn for u in plan] == ["blocks.0", "blocks.1", "blocks.2", ""]


# --- policy errors --------------------------------------------------------------------------


def test_unknown_name_lists_closest_classes_and_registered_policies():
    with pytest.raises(
        ValueError,
        match=r"names 'Blok', which is neither a module class in the model nor a registered policy\. Did you mean 'Block'\? Parameter-holding classes present: \['Attention', 'Block'.*Registered policies: \['auto'",
    ):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={"Blok"}))


def test_a_string_never_imports_code():
    with pytest.raises(ValueError, match=r"names 'os\.system', which is neither a module class"):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy="os.system"))


def test_policy_matching_nothing_lists_classes():
    with pytest.raises(
        ValueError,
        match=r"auto_wrap_policy \(classes \['Conv2d'\]\) matches no submodule of GPT that holds parameters\. Parameter-holding classes present",
    ):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={nn.Conv2d}))


def test_regex_matching_nothing():
    with pytest.raises(
        ValueError, match=r"\(FQNs fully matching 'layers.* matches no submodule of GPT"
    ):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=r"re:layers\.\d+"))


def test_invalid_regex():
    with pytest.raises(ValueError, match=r"'blocks\.\(' is not a valid regular expression"):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy="re:blocks.("))


def test_size_matching_nothing_lists_largest_modules():
    with pytest.raises(
        ValueError,
        match=r"'size' with min_num_params=10,000,000 made no unit below the root of GPT\. Largest submodules: blocks\.2: 12,608, .* Lower min_num_params",
    ):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy="size", min_num_params=10_000_000))


def test_transformer_blocks_without_blocks():
    with pytest.raises(
        ValueError, match=r"'transformer_blocks' found no repeated blocks in Linear"
    ):
        plan_wrap(nn.Linear(2, 2), ParallelConfig(auto_wrap_policy="transformer_blocks"))


def test_non_module_in_policy():
    with pytest.raises(TypeError, match=r"contains 3, which is not an nn.Module subclass"):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=[3]))


def test_empty_policy():
    with pytest.raises(ValueError, match=r"auto_wrap_policy is an empty collection"):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=set()))


def test_policy_of_wrong_type():
    with pytest.raises(TypeError, match=r"auto_wrap_policy got float \(1\.5\); expected 'auto'"):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=1.5))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("min_num_params", 0, r"min_num_params=0 must be >= 1"),
        (
            "frozen_policy",
            "splt",
            r"frozen_policy='splt' is not valid\. Did you mean 'split'\? Choose one of \['split', 'warn', 'error'\]",
        ),
        (
            "activation_checkpointing",
            "every_0",
            r"activation_checkpointing='every_0' is not valid\. Use 'none', 'full', 'every_<k>'",
        ),
        ("activation_checkpointing", "some", r"activation_checkpointing='some' is not valid"),
    ],
)
def test_planner_config_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**{field: value})


# --- tied parameters -----------------------------------------------------------------------


def test_tied_weight_split_across_units_is_merged():
    # Embeddings as units would put tok_emb.weight in one unit and its user head in the root.
    plan = plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy={nn.Embedding}))
    assert units(plan) == [
        ("pos_emb", "Embedding", "policy"),
        ("tok_emb + head", "Embedding+Linear", "tied"),
        ("", "GPT", "root"),
    ]
    assert plan.unit("tok_emb + head").num_params == CFG.vocab_size * CFG.d_model
    assert any("tied parameter tok_emb.weight" in n for n in plan.notes)


def test_shared_module_registered_twice():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.ReLU()))
    plan = plan_wrap(model, ParallelConfig(auto_wrap_policy={nn.Linear}))
    assert units(plan) == [("0.0 + 1.0", "Linear", "tied"), ("", "Sequential", "root")]
    assert plan.total_params == 20


def test_ties_reaching_outside_their_common_ancestor_land_in_one_unit():
    # The head's bias tie sits under `head`, but the head's decoder is also tied to the
    # embeddings unit: all three must end in one unit, and the plan says so.
    plan = plan_wrap(CrossTied(), ParallelConfig(auto_wrap_policy={Embeddings, nn.Linear}))
    assert units(plan) == [
        ("layers.0", "Linear", "policy"),
        ("layers.1", "Linear", "policy"),
        ("head.transform", "Linear", "policy"),
        ("embeddings + head", "Embeddings+Head", "tied"),
        ("", "CrossTied", "root"),
    ]
    assert plan.tied_units == ["embeddings + head", "embeddings + head"]
    text = str(plan)
    assert "tied: embeddings.word.weight = head.decoder.weight -> unit embeddings + head" in text
    assert "tied: head.decoder.bias = head.bias -> unit embeddings + head" in text


def test_bert_for_masked_lm_ties_are_planned_whole():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
    )
    plan = plan_wrap(transformers.BertForMaskedLM(cfg), ParallelConfig())
    assert plan.tied_units == ["bert.embeddings + cls.predictions"] * 2
    assert [u.fqn for u in plan] == [
        "bert.encoder.layer.0",
        "bert.encoder.layer.1",
        "bert.embeddings + cls.predictions",
        "",
    ]


def test_tie_held_by_the_root_folds_units_into_the_root():
    class RootHeld(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            self.weight = self.inner[0].weight  # the root holds it directly, too

    plan = plan_wrap(RootHeld(), ParallelConfig(auto_wrap_policy={nn.Linear}))
    assert units(plan) == [("inner.1", "Linear", "policy"), ("", "RootHeld", "root")]
    assert plan.tied_units == [""]
    assert any("fold into the root unit" in n for n in plan.notes)


# --- frozen parameters ---------------------------------------------------------------------


def test_lora_mixed_units_are_listed_in_the_plan_and_nothing_is_printed():
    """FSDP2 makes a unit mixing frozen and trainable parameters free (one all-gather, and
    only the gradients that exist reduced), so wrap says nothing; the plan lists them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanNotice)
        plan = plan_wrap(LoRAModel(), ParallelConfig())
    assert [u.fqn for u in plan] == ["blocks.0", "blocks.1", ""]
    model = LoRAModel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(u.trainable_params for u in plan) == trainable > 0
    assert all(u.frozen_params + u.trainable_params == u.num_params for u in plan)
    text = str(plan)
    assert "params     frozen  trainable" in text
    assert text.splitlines()[-1] == (
        "mixed: 2 unit(s) hold frozen and trainable parameters (blocks.0, blocks.1); free "
        "under FSDP2, which gathers both and reduces only the trainable ones' gradients"
    )
    mixed = plan.mixed_units[0]
    assert mixed.unit == "blocks.0"
    assert "blocks.0.fc.base.weight" in mixed.frozen
    assert mixed.trainable == [
        "blocks.0.fc.lora_a.weight",
        "blocks.0.fc.lora_b.weight",
        "blocks.0.proj.lora_a.weight",
        "blocks.0.proj.lora_b.weight",
    ]
    assert plan.unit("").frozen_params == plan.unit("").num_params  # emb + head: all frozen


def test_lora_frozen_policy_error():
    with pytest.raises(
        ValueError,
        match=r"frozen_policy='error': 2 unit\(s\) mix frozen and trainable parameters: blocks\.0: frozen \[.*\], trainable \['blocks\.0\.fc\.lora_a\.weight'.*Use frozen_policy='split'",
    ):
        plan_wrap(LoRAModel(), ParallelConfig(frozen_policy="error"))


def test_lora_frozen_policy_split():
    plan = plan_wrap(LoRAModel(), ParallelConfig(frozen_policy="split"))
    assert plan.mixed_units == []
    split = [u.fqn for u in plan if u.reason == "trainable-split"]
    assert split == [
        "blocks.0.fc.lora_a", "blocks.0.fc.lora_b", "blocks.0.proj.lora_a", "blocks.0.proj.lora_b",
        "blocks.1.fc.lora_a", "blocks.1.fc.lora_b", "blocks.1.proj.lora_a", "blocks.1.proj.lora_b",
    ]  # fmt: skip
    for u in plan:
        assert u.frozen_params == 0 or u.trainable_params == 0, u
    assert any("split 2 of 2 mixed unit(s)" in n for n in plan.notes)


def test_frozen_split_reports_modules_holding_both():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].bias.requires_grad_(False)  # weight trains, bias frozen: one module, both kinds
    plan = plan_wrap(model, ParallelConfig(auto_wrap_policy={nn.Linear}, frozen_policy="split"))
    assert [m.unit for m in plan.mixed_units] == ["0"]
    assert any("cannot split (a module directly holds both kinds): ['0']" in n for n in plan.notes)


# --- per-module precision --------------------------------------------------------------------


def test_cnn_batchnorm_gets_fp32_units_under_bf16():
    with pytest.warns(
        PlanNotice,
        match=r"2 module\(s\) compute in float32 under torch.bfloat16, each in its own unit: features\.1, features\.4",
    ):
        plan = plan_wrap(ConvNet(), ParallelConfig(mixed_precision="bf16"))
    assert [(u.fqn, u.reason, u.compute_dtype) for u in plan] == [
        ("features.0", "policy", "bfloat16"),
        ("features.1", "keep_fp32", "float32"),
        ("features.3", "policy", "bfloat16"),
        ("features.4", "keep_fp32", "float32"),
        ("", "root", "bfloat16"),
    ]


def test_cnn_in_fp32_needs_no_fp32_units():
    plan = plan_wrap(ConvNet(), ParallelConfig())
    assert {u.reason for u in plan} == {"policy", "root"}
    assert {u.compute_dtype for u in plan} == {"native"}


def test_keep_fp32_explicit_classes_and_names():
    with pytest.warns(PlanNotice, match="7 module"):
        plan = plan_wrap(GPT(CFG), ParallelConfig(mixed_precision="bf16", keep_fp32=["LayerNorm"]))
    fp32 = [u.fqn for u in plan if u.compute_dtype == "float32"]
    assert fp32 == [
        "blocks.0.ln1",
        "blocks.0.ln2",
        "blocks.1.ln1",
        "blocks.1.ln2",
        "blocks.2.ln1",
        "blocks.2.ln2",
        "ln_f",
    ]
    with pytest.raises(
        ValueError, match=r"ParallelConfig\.keep_fp32 names 'BatchNorm2d', which is neither"
    ):
        plan_wrap(GPT(CFG), ParallelConfig(mixed_precision="bf16", keep_fp32=["BatchNorm2d"]))


def test_ddp_plan_has_no_fp32_units():
    plan = plan_wrap(ConvNet(), ParallelConfig(strategy="ddp", mixed_precision="bf16"))
    assert not any(u.reason == "keep_fp32" for u in plan)


# --- ignored, activation checkpointing, output --------------------------------------------


def test_ignored_modules_and_params_leave_units():
    plan = plan_wrap(
        GPT(CFG), ParallelConfig(ignored_modules=["re:pos_emb"], ignored_params=["ln_f.bias"])
    )
    assert plan.ignored_params == ["pos_emb.weight", "ln_f.bias"]
    assert plan.total_params == GPT(CFG).num_params() - CFG.seq_len * CFG.d_model - CFG.d_model


def test_unknown_ignored_param():
    with pytest.raises(
        ValueError,
        match=r"ignored_params names 'ln_f\.biass', which is not a parameter of GPT\. Did you mean 'ln_f\.bias'\?",
    ):
        plan_wrap(GPT(CFG), ParallelConfig(ignored_params=["ln_f.biass"]))


@pytest.mark.parametrize(
    ("value", "flagged"), [("none", []), ("full", [0, 1, 2]), ("every_2", [0, 2]), (3, [0])]
)
def test_activation_checkpointing_marks_blocks(value, flagged):
    plan = plan_wrap(GPT(CFG), ParallelConfig(activation_checkpointing=value))
    assert [i for i, u in enumerate(plan.units) if u.activation_checkpointing] == flagged


def test_plan_prints_and_serialises():
    plan = plan_wrap(
        GPT(CFG), ParallelConfig(mixed_precision="bf16", activation_checkpointing="full")
    )
    text = str(plan)
    assert "4 unit(s)" in text and "<root>" in text and "policy: auto: 3x Block" in text
    assert re.search(
        r"blocks\.2\s+Block\s+([\d,]+)\s+0\s+\1\s+bfloat16\s+True\s+yes\s+policy", text
    )
    data = json.loads(plan.to_json())
    assert data["total_params"] == plan.total_params
    assert [u["fqn"] for u in data["units"]] == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert data["units"][0]["activation_checkpointing"] is True


@pytest.mark.parametrize(
    "make",
    [lambda: GPT(CFG), lambda: ConvNet(), lambda: LoRAModel(), lambda: Nested()],
    ids=["gpt", "cnn", "lora", "nested"],
)
def test_plan_on_meta_equals_materialised_plan(make):
    cfg = ParallelConfig(mixed_precision="bf16", auto_wrap_policy="size", min_num_params=100)
    with torch.device("meta"):
        meta_model = make()
    noisy = isinstance(make(), ConvNet)  # its BatchNorms get fp32 units
    with pytest.warns(PlanNotice) if noisy else contextlib.nullcontext():
        meta_plan = plan_wrap(meta_model, cfg)
    with pytest.warns(PlanNotice) if noisy else contextlib.nullcontext():
        real_plan = plan_wrap(make(), cfg)
    assert meta_plan == real_plan


def test_tied_merge_keeps_a_merged_fp32_unit_in_fp32():
    # keep_fp32 makes tok_emb an fp32 unit; its tied user (head) joins it, still fp32.
    with pytest.warns(PlanNotice):
        plan = plan_wrap(GPT(CFG), ParallelConfig(mixed_precision="bf16", keep_fp32=["Embedding"]))
    merged = plan.unit("tok_emb + head")
    assert (merged.reason, merged.compute_dtype) == ("tied", "float32")


class DictBlocks(nn.Module):
    """Blocks as ModuleDicts in a ModuleList: containers with no forward of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)}) for _ in range(3)
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer["b"](layer["a"](x))
        return self.head(x)


def test_a_container_without_forward_is_never_a_unit():
    # fully_shard refuses a ModuleDict ("containers that do not implement forward"): auto
    # looks through it to the Linears it holds.
    plan = plan_wrap(DictBlocks(), ParallelConfig())
    assert {u.module_class for u in plan} == {"Linear", "DictBlocks"}
    assert [u.fqn for u in plan if u.reason == "policy"] == [
        *(f"layers.{i}.{n}" for i in range(3) for n in "ab"),
        "head",
    ]


def test_a_size_policy_passes_a_container_up():
    # 100 is above a Linear's 72 parameters and below a ModuleDict's 144: torch's FSDP1
    # size policy excluded ModuleList/ModuleDict, and so does shardwise's.
    with pytest.raises(
        ValueError,
        match=r"made no unit below the root of DictBlocks\. Largest submodules: "
        r"layers\.2\.b: 72, ",
    ):
        plan_wrap(DictBlocks(), ParallelConfig(auto_wrap_policy="size", min_num_params=100))


def test_a_policy_naming_only_containers_says_so():
    with pytest.raises(
        ValueError,
        match=r"matches no submodule of DictBlocks that holds parameters\. It matched only "
        r"ModuleDict, which has no forward of its own \(FSDP cannot shard a container\): name "
        r"the classes inside it\.",
    ):
        plan_wrap(DictBlocks(), ParallelConfig(auto_wrap_policy={nn.ModuleDict}))
