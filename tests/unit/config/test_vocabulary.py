"""Words from mmengine, Lightning/fairscale, torch FSDP1, DDP and the trainer mixin: each is
either translated to the shardwise setting with the same meaning, or refused with what
FSDP2/shardwise does instead. Never a bare TypeError, never silently dropped."""

from __future__ import annotations

import pytest
import torch
import yaml
from torch import nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

from shardwise import ParallelConfig, plan_wrap
from shardwise.config.run_file import Config, ConfigError, load_config
from shardwise.testing.models import GPT, Block, ConvNet, GPTConfig

CFG = GPTConfig()


# --- strategy words ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "strategy"),
    [
        ({"sharding_strategy": "FULL_SHARD"}, "full_shard"),  # mmengine / FSDP1
        ({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}, "shard_grad_op"),
        ({"sharding_strategy": "ShardingStrategy.HYBRID_SHARD"}, "hybrid_shard"),  # mixin YAML
        ({"strategy": "ShardingStrategy.NO_SHARD"}, "no_shard"),
        ({"strategy": "ddp_fully_sharded"}, "full_shard"),  # Lightning's fairscale strategy
        ({"use_fsdp": False, "sharding_strategy": "FULL_SHARD"}, "ddp"),  # mixin: DDP
        ({"use_fsdp": True}, "hybrid_shard"),  # the mixin's own default sharding strategy
        ({"use_fsdp": True, "sharding_strategy": "SHARD_GRAD_OP"}, "shard_grad_op"),
        ({"strategy": "full_shard", "sharding_strategy": "FULL_SHARD"}, "full_shard"),
    ],
)
def test_strategy_words(kwargs, strategy):
    assert ParallelConfig(**kwargs).strategy == strategy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"strategy": "ddp", "sharding_strategy": "FULL_SHARD"},
            r"sharding_strategy='FULL_SHARD' and strategy='ddp' name different strategies\. Set only strategy",
        ),
        ({"use_fsdp": True, "strategy": "ddp"}, r"use_fsdp=True contradicts strategy='ddp'"),
        ({"use_fsdp": "yes"}, r"use_fsdp='yes' must be True or False"),
    ],
)
def test_contradicting_strategy_words(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


# --- words accepted with one value, and words refused ------------------------------------------


@pytest.mark.parametrize(
    ("word", "ok", "bad", "match"),
    [
        ("use_orig_params", True, False, r"FSDP2 has no FlatParameter"),
        ("flatten_parameters", False, True, r"FSDP2 shards each parameter on its own"),
        ("limit_all_gathers", True, False, r"FSDP2 always bounds the all-gathers in flight"),
        ("dim", 0, 1, r"DDP scatters along dim 0 only when one process drives several devices"),
        ("check_reduction", False, True, r"DDP ignores check_reduction"),
    ],
)
def test_words_with_one_meaning_under_fsdp2(word, ok, bad, match):
    assert ParallelConfig(**{word: ok}) == ParallelConfig()
    with pytest.raises(
        ValueError, match=rf"ParallelConfig: {word}={bad!r} is not supported\. {match}"
    ):
        ParallelConfig(**{word: bad})


@pytest.mark.parametrize(
    ("word", "match"),
    [
        ("state_dict_to_cpu", r"shardwise\.export_weights .*get_model_state_dict"),
        ("ignored_states", r"ParallelConfig\.ignored_modules"),
        ("detect_anomalous_params", r"TrainConfig\.detect_anomalous_params"),
    ],
)
def test_words_without_an_fsdp2_meaning(word, match):
    with pytest.raises(
        ValueError, match=rf"{word}=True has no FSDP2/shardwise equivalent\. .*{match}"
    ):
        ParallelConfig(**{word: True})


def test_unknown_keyword_names_the_valid_ones_not_a_bare_type_error():
    with pytest.raises(
        TypeError,
        match=r"ParallelConfig got unknown keyword\(s\) \['shard_strategy'\]\. Did you mean 'strategy'\? Valid keywords: \[",
    ):
        ParallelConfig(shard_strategy="full_shard")


# --- fairscale precision words -----------------------------------------------------------------


def test_fairscale_compute_dtype_reduces_in_it_unless_fp32_reduce_scatter():
    p = ParallelConfig(compute_dtype=torch.bfloat16).precision
    assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    p = ParallelConfig(compute_dtype="bf16", fp32_reduce_scatter=True).precision
    assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.float32)
    p = ParallelConfig(mixed_precision="bf16", fp32_reduce_scatter=False).precision
    assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"compute_dtype=.* and mixed_precision='bf16' both set"):
        ParallelConfig(compute_dtype="bf16", mixed_precision="bf16")


def test_move_grads_to_cpu_goes_with_cpu_offload_only():
    assert ParallelConfig(move_grads_to_cpu=True, cpu_offload=True).offload_policy is not None
    assert ParallelConfig(move_grads_to_cpu=False).offload_policy is None
    with pytest.raises(
        ValueError,
        match=r"move_grads_to_cpu=True with cpu_offload=False is not possible under FSDP2: its CPU offload moves parameters, gradients and optimizer state together",
    ):
        ParallelConfig(move_grads_to_cpu=True)


# --- wrap policies -----------------------------------------------------------------------------


def _units(config):
    return [u.fqn for u in plan_wrap(GPT(CFG), config) if u.reason != "root"]


def test_mmengine_policy_dicts_and_dotted_names():
    blocks = [f"blocks.{i}" for i in range(CFG.n_layers)]
    for kind in (
        "transformer_auto_wrap_policy",
        "torch.distributed.fsdp.wrap.transformer_auto_wrap_policy",
    ):
        cfg = ParallelConfig(auto_wrap_policy={"type": kind, "transformer_layer_cls": ["Block"]})
        assert cfg.auto_wrap_policy == ("Block",) and _units(cfg) == blocks
    block = sum(p.numel() for p in Block(CFG).parameters())
    for kind in (
        "size_based_auto_wrap_policy",
        "torch.distributed.fsdp.wrap.size_based_auto_wrap_policy",
    ):
        cfg = ParallelConfig(auto_wrap_policy={"type": kind, "min_num_params": block})
        assert (cfg.auto_wrap_policy, cfg.min_num_params) == ("size", block)
        assert _units(cfg) == _units(ParallelConfig(auto_wrap_policy="size", min_num_params=block))


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (
            {"type": "lambda_auto_wrap_policy"},
            r"dict\(type='lambda_auto_wrap_policy', \.\.\.\) is not a policy shardwise knows",
        ),
        (
            {"type": "size_based_auto_wrap_policy", "force_leaf_modules": []},
            r"has unknown argument\(s\) \['force_leaf_modules'\]",
        ),
        ({"type": "transformer_auto_wrap_policy"}, r"needs transformer_layer_cls="),
    ],
)
def test_bad_policy_dicts_fail_when_the_config_is_built(policy, match):
    # Before: the config took any dict, and it failed only at wrap time.
    with pytest.raises(ValueError, match=match):
        ParallelConfig(auto_wrap_policy=policy)


def test_torch_fsdp1_policy_objects():
    assert _units(ParallelConfig(auto_wrap_policy=ModuleWrapPolicy({Block}))) == [
        "blocks.0",
        "blocks.1",
    ]
    custom = CustomPolicy(lambda m: isinstance(m, Block))
    assert _units(ParallelConfig(auto_wrap_policy=custom)) == ["blocks.0", "blocks.1"]
    overrides = CustomPolicy(
        lambda m: {"sharding_strategy": "NO_SHARD"} if isinstance(m, Block) else False
    )
    with pytest.raises(
        ValueError,
        match=r"CustomPolicy returned per-unit overrides \['sharding_strategy'\] for 'blocks\.0'",
    ):
        plan_wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=overrides))


def test_min_num_params_under_a_policy_that_ignores_it():
    # Before: silently ignored under the default 'auto' policy.
    with pytest.raises(
        ValueError,
        match=r"min_num_params=10,000,000 applies to the 'size' policy only, but auto_wrap_policy='auto', which would ignore it\. Set auto_wrap_policy='size'",
    ):
        ParallelConfig(min_num_params=1e7)
    assert ParallelConfig(auto_wrap_policy="size", min_num_params=1e7).min_num_params == 10_000_000
    with pytest.raises(TypeError, match=r"min_num_params must be an int, got 1\.5"):
        ParallelConfig(auto_wrap_policy="size", min_num_params=1.5)


def test_ignored_modules_as_instances():
    model = GPT(CFG)
    plan = plan_wrap(model, ParallelConfig(ignored_modules=[model.pos_emb]))
    assert plan.ignored_params == ["pos_emb.weight"]
    with pytest.raises(
        ValueError, match=r"ignored_modules holds 1 module instance\(s\) that are not part of GPT"
    ):
        plan_wrap(model, ParallelConfig(ignored_modules=[nn.Linear(2, 2)]))


# --- precision words ---------------------------------------------------------------------------


def test_fsdp1_module_classes_to_ignore_are_kept_in_fp32():
    # Before: dropped, so LayerNorm ran in bf16.
    mp = MixedPrecision(param_dtype=torch.bfloat16, _module_classes_to_ignore=(nn.LayerNorm,))
    plan = plan_wrap(GPT(CFG), ParallelConfig(mixed_precision=mp))
    fp32 = [u.fqn for u in plan if u.compute_dtype == "float32"]
    assert fp32 and all("ln" in name for name in fp32), fp32
    with pytest.raises(
        ValueError,
        match=r"keep_fp32=.* and FSDP1 MixedPrecision\(_module_classes_to_ignore=.*\) name different fp32 classes",
    ):
        ParallelConfig(mixed_precision=mp, keep_fp32=["BatchNorm2d"])
    # FSDP1's default is (_BatchNorm,): BatchNorm stays fp32, as with keep_fp32's default.
    default = ParallelConfig(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    assert [u.reason for u in plan_wrap(ConvNet(), default)].count("keep_fp32") == 2


def test_mmengine_mixed_precision_dict_with_buffer_dtype():
    p = ParallelConfig(
        mixed_precision={
            "param_dtype": "float16",
            "reduce_dtype": "float32",
            "buffer_dtype": "float32",
        }
    ).precision
    assert (p.param_dtype, p.reduce_dtype) == (torch.float16, torch.float32)
    with pytest.raises(
        ValueError,
        match=r"buffer_dtype=torch\.float16 has no FSDP2 equivalent: FSDP2 keeps buffers in their own dtype",
    ):
        ParallelConfig(mixed_precision={"param_dtype": "float16", "buffer_dtype": "float16"})


# --- DDP words ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("word", "value"),
    [
        ("bucket_cap_mb", 50.0),
        ("find_unused_parameters", True),
        ("broadcast_buffers", False),
        ("gradient_as_bucket_view", True),
        ("static_graph", True),
    ],
)
def test_ddp_settings_are_refused_under_fsdp_strategies(word, value):
    assert getattr(ParallelConfig(strategy="ddp", **{word: value}), word) == value
    # Before: bucket_cap_mb (and find_unused_parameters) were silently ignored under FSDP.
    with pytest.raises(
        ValueError,
        match=rf"ParallelConfig\.{word}={value!r} is a DistributedDataParallel setting, but strategy='full_shard' uses FSDP2",
    ):
        ParallelConfig(strategy="full_shard", **{word: value})


def test_placement_words_are_kept_for_wrap_to_check():
    cfg = ParallelConfig(strategy="ddp", device_ids=[0], output_device=0)
    assert cfg._placement == {"device_ids": [0], "output_device": 0}


def test_device_mesh_shape_must_fit_the_strategy():
    with pytest.raises(
        TypeError, match=r"device_mesh got str; expected a torch DeviceMesh, a ProcessGroup"
    ):
        ParallelConfig(device_mesh="mesh")


# --- files and integral floats -----------------------------------------------------------------


def test_yaml_config_with_other_systems_words(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "parallel": {
                    "sharding_strategy": "ShardingStrategy.HYBRID_SHARD",
                    "use_orig_params": True,
                    "auto_wrap_policy": {
                        "type": "size_based_auto_wrap_policy",
                        "min_num_params": "1e7",
                    },
                }
            }
        )
    )
    cfg = load_config(path, cls=Config).parallel
    assert (cfg.strategy, cfg.auto_wrap_policy, cfg.min_num_params) == (
        "hybrid_shard",
        "size",
        10_000_000,
    )
    # Before: "unknown key ... Did you mean 'find_unused_parameters'?"
    with pytest.raises(
        ConfigError,
        match=r"flatten_parameters=True is not supported\. FSDP2 shards each parameter on its own",
    ):
        load_config(overrides=["parallel.flatten_parameters=true"])


def test_integral_floats_for_int_fields_from_yaml():
    cfg = load_config(
        overrides=[
            "parallel.auto_wrap_policy=size",
            "parallel.min_num_params=1e7",
            "runner.max_steps=1e3",
        ]
    )
    assert (cfg.parallel.min_num_params, cfg.runner.max_steps) == (10_000_000, 1000)
    with pytest.raises(
        ConfigError,
        match=r"runner\.max_steps: expected int \| null, got str \('1\.5e0'\)|runner\.max_steps",
    ):
        load_config(overrides=["runner.max_steps=1.5e0"])


def test_placement_words_naming_another_device_are_refused_at_world_one():
    from shardwise import wrap

    wrap(GPT(CFG), ParallelConfig(strategy="ddp", device_ids=[0]))  # this process's device
    with pytest.raises(
        ValueError,
        match=r"ParallelConfig: device_ids=\[5\] on rank 0, whose device is cpu \(LOCAL_RANK 0\)\. shardwise places each rank on its own local device",
    ):
        wrap(GPT(CFG), ParallelConfig(strategy="ddp", device_ids=[5]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"ignored_parameters": ["a.weight"], "ignored_params": ["b.weight"]},
            r"ignored_parameters=\['a\.weight'\] and ignored_params=\['b\.weight'\] both set the same thing differently\. Set only ignored_params",
        ),
        ({"fp32_reduce_scatter": "yes"}, r"fp32_reduce_scatter='yes' must be a bool"),
        (
            {
                "auto_wrap_policy": {"type": "size_based_auto_wrap_policy", "min_num_params": 10},
                "min_num_params": 20,
            },
            r"auto_wrap_policy gives min_num_params=10 and ParallelConfig\.min_num_params=20\. Set it in one place",
        ),
    ],
)
def test_words_that_set_one_thing_twice(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_device_mesh_of_the_wrong_rank_for_the_strategy():
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise

    shardwise.init_distributed()  # a one-rank group: enough to build meshes
    flat = init_device_mesh("cpu", (1,))
    with pytest.raises(
        ValueError,
        match=r"device_mesh is 1-D but strategy='hybrid_shard' needs a 2-D mesh: 1-D for ddp, full_shard and shard_grad_op, 2-D \(replicate, shard\) for hybrid_shard",
    ):
        ParallelConfig(strategy="hybrid_shard", device_mesh=flat)
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("r", "s"))
    with pytest.raises(
        ValueError, match=r"device_mesh is 2-D but strategy='full_shard' needs a 1-D mesh"
    ):
        ParallelConfig(device_mesh=grid)
    with pytest.raises(
        TypeError, match=r"a pair must be two ProcessGroups, \(shard group, replicate group\)"
    ):
        ParallelConfig(strategy="hybrid_shard", device_mesh=("a", "b"))


def test_dp_shard_contradicting_a_user_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise
    from shardwise.distributed import from_user_mesh

    shardwise.init_distributed()
    mesh = init_device_mesh("cpu", (1,))
    spec, got = from_user_mesh("full_shard", -1, mesh, "cpu")
    assert (spec.dp_replicate, spec.dp_shard, got) == (1, 1, mesh)
    with pytest.raises(
        ValueError,
        match=r"ParallelConfig\.dp_shard=2 contradicts the device_mesh, whose shard dimension has 1 rank\(s\)\. Leave dp_shard=-1",
    ):
        from_user_mesh("full_shard", 2, mesh, "cpu")


@pytest.mark.parametrize("dim", ["pp", "ep"])
def test_pp_or_ep_with_a_mesh_of_ones_own_is_refused_with_the_fix(dim: str):
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise
    from shardwise.parallelize.apply import _resolve_layout

    shardwise.init_distributed()
    mesh = init_device_mesh("cpu", (1,))
    config = ParallelConfig(strategy="full_shard", device_mesh=mesh, **{dim: 2})
    with pytest.raises(
        NotImplementedError,
        match=rf"ParallelConfig\.{dim}=2 with a device_mesh of your own is not built yet: "
        r"shardwise lays out .* Leave device_mesh unset\.",
    ):
        _resolve_layout(config, shardwise.get_dist_info())
