"""Accelerate configs as `accelerate config` writes them: each translates to the
documented layout, or is refused naming the key and the reason. The YAMLs follow the
shapes Accelerate writes (FSDP1 and FSDP2 keys, DeepSpeed inline and from a file, the
parallelism config); the values are this file's own."""

from __future__ import annotations

import json

import pytest
from _refusals import assert_refused, unnamed_keys

from shardwise.cli.main import main
from shardwise.config.accelerate import translate_accelerate
from shardwise.config.run_file import ConfigError

LAUNCH = """compute_environment: LOCAL_MACHINE
debug: false
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
FSDP1 = (
    LAUNCH
    + """distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
mixed_precision: bf16
"""
)
FSDP1_NUMBERED = (
    LAUNCH
    + """distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_min_num_params: 100000000
  fsdp_backward_prefetch: BACKWARD_POST
  fsdp_offload_params: true
  fsdp_sharding_strategy: 2
  fsdp_state_dict_type: FULL_STATE_DICT
mixed_precision: 'no'
"""
)
FSDP2 = (
    LAUNCH
    + """distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_activation_checkpointing: true
mixed_precision: fp16
"""
)
HSDP_TP = (
    LAUNCH
    + """distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
mixed_precision: bf16
"""
)
DS_INLINE = (
    LAUNCH
    + """distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
mixed_precision: bf16
"""
)
DDP = (
    LAUNCH
    + """distributed_type: MULTI_GPU
mixed_precision: 'no'
dynamo_config:
  dynamo_backend: INDUCTOR
"""
)


def _layout(config):  # type: ignore[no-untyped-def]
    p = config.parallel
    return (p.strategy, bool(p.cpu_offload), str(p.precision), p.auto_wrap_policy,
            p.backward_prefetch, p.activation_checkpointing, p.tp, p.dp_shard)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "layout"),
    [
        (FSDP1, ("full_shard", False, "param=bfloat16 reduce=float32 output=None",
                 ("LlamaDecoderLayer",), "pre", "none", 1, -1)),
        (FSDP1_NUMBERED, ("shard_grad_op", True, "fp32", "size", "post", "none", 1, -1)),
        (FSDP2, ("shard_grad_op", False, "param=float16 reduce=float32 output=None", "auto",
                 "pre", "full", 1, -1)),
        (HSDP_TP, ("hybrid_shard", False, "param=bfloat16 reduce=float32 output=None", "auto",
                   "pre", "none", 2, 2)),
        (DS_INLINE, ("shard_grad_op", True, "param=bfloat16 reduce=float32 output=None", "auto",
                     "pre", "none", 1, -1)),
        (DDP, ("ddp", False, "fp32", "auto", "pre", "none", 1, -1)),
    ],
    ids=["fsdp1", "fsdp1_numbered", "fsdp2", "hsdp_tp", "deepspeed_inline", "ddp"],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:ParallelConfig.backward_prefetch='post'")
def test_a_yaml_translates_to_its_documented_layout(tmp_path, text, layout) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "default_config.yaml"
    path.write_text(text)
    translation = translate_accelerate(path)
    config = translation.config
    assert _layout(config) == layout, translation.table()
    rows = {r.key: r for r in translation.rows}
    assert rows["num_processes"].verdict == "no effect"  # a launch setting


def test_the_rows_say_what_differs_and_what_has_no_effect(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = {r.key: r for r in translate_accelerate(_yaml(tmp_path, FSDP1)).rows}
    assert rows["mixed_precision"].verdict == "differs"
    assert "reduces in the compute dtype" in rows["mixed_precision"].note
    assert rows["fsdp_config.fsdp_use_orig_params"].verdict == "no effect"
    assert "init_empty" in rows["fsdp_config.fsdp_cpu_ram_efficient_loading"].note
    inline = translate_accelerate(_yaml(tmp_path, DS_INLINE))
    rows = {r.key: r for r in inline.rows}
    assert rows["deepspeed_config: zero_optimization.offload_optimizer"].verdict == "differs"
    assert inline.config.train.accumulate_steps == 4 and inline.config.train.max_grad_norm == 1.0
    assert translate_accelerate(_yaml(tmp_path, DDP)).config.parallel.compile == "inductor"
    rows = {r.key: r for r in translate_accelerate(_yaml(tmp_path, FSDP1_NUMBERED)).rows}
    assert rows["fsdp_config.fsdp_backward_prefetch"].verdict == "differs"


def test_a_deepspeed_config_file_is_read_as_deepspeeds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3},
                                                  "gradient_clipping": 0.5}))  # fmt: skip
    text = (
        LAUNCH
        + "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
    )
    config = translate_accelerate(_yaml(tmp_path, text)).config
    assert (config.parallel.strategy, config.train.max_grad_norm) == ("full_shard", 0.5)


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (FSDP1.replace("fsdp_use_orig_params: true", "fsdp_use_orig_params: false"),
         {"fsdp_config.fsdp_use_orig_params": "no flat parameters"}),
        (LAUNCH + "distributed_type: XLA\n", {"distributed_type": "no XLA"}),
        (FSDP2.replace("mixed_precision: fp16", "mixed_precision: fp8"),
         {"mixed_precision": "fp8 is not built"}),
        (HSDP_TP.replace("cp_size: 1", "cp_size: 2\n  parallelism_config_sp_size: 2"),
         {"parallelism_config.parallelism_config_cp_size": "cp_size and sp_size both above 1",
          "parallelism_config.parallelism_config_sp_size": "over one dimension, parallel.cp"}),
        (FSDP1 + "fsdp_extra_key: 1\n", {"fsdp_extra_key": "not an Accelerate key"}),
        (DS_INLINE.replace("zero_stage: 2", "zero_stage: 3\n  offload_param_device: nvme")
         .replace("  offload_param_device: none\n", ""),
         {"deepspeed_config: zero_optimization.offload_param": "offload to 'nvme'"}),
    ],
    ids=["orig_params_off", "xla", "fp8", "context_parallel", "unknown_key", "nvme"],
)  # fmt: skip
def test_what_cannot_mean_the_same_is_refused_by_key(tmp_path, text, refused) -> None:  # type: ignore[no-untyped-def]
    assert_refused(translate_accelerate(_yaml(tmp_path, text)), refused)


def test_config_show_from_reads_a_yaml_as_accelerates(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["config", "show", "--from", str(_yaml(tmp_path, FSDP1))]) == 0
    out = capsys.readouterr().out
    assert "fsdp_config.fsdp_sharding_strategy" in out and "strategy: full_shard" in out
    assert main(["config", "show", "--from", str(tmp_path / "config.ini")]) == 2
    assert "an Accelerate config .yaml or .yml, a torchtitan config .toml" in (
        capsys.readouterr().err
    )


def _yaml(tmp_path, text):  # type: ignore[no-untyped-def]
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    return path


def test_a_yaml_that_is_not_a_mapping_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"an Accelerate config is a YAML mapping"):
        translate_accelerate(_yaml(tmp_path, "- FSDP\n"))


@pytest.mark.parametrize("order", ["distributed_type_first", "fsdp_config_first"])
def test_the_named_sharding_strategy_wins_whatever_the_key_order(order) -> None:  # type: ignore[no-untyped-def]
    """Issue 48: a hand-written file may put fsdp_config before distributed_type; the
    strategy its fsdp_config names must not be replaced by FSDP's default."""
    fsdp = {"fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}}
    kind = {"distributed_type": "FSDP"}
    data = {**kind, **fsdp} if order == "distributed_type_first" else {**fsdp, **kind}
    assert translate_accelerate(data).parallel["strategy"] == "shard_grad_op"


@pytest.mark.parametrize(("replicas", "strategy"), [(1, "full_shard"), (2, "hybrid_shard")])
def test_replicas_of_one_are_no_replication(replicas, strategy) -> None:  # type: ignore[no-untyped-def]
    """Issue 48: parallelism_config's dp_replicate_size of 1, the usual value, is plain
    FSDP; only more than one replica makes hybrid_shard."""
    config = {"parallelism_config_dp_replicate_size": replicas,
              "parallelism_config_dp_shard_size": 4}  # fmt: skip
    data = {"distributed_type": "FSDP", "parallelism_config": config}
    assert translate_accelerate(data).parallel["strategy"] == strategy


_FSDP1_STRATEGIES = [(1, "FULL_SHARD", "full_shard"), (2, "SHARD_GRAD_OP", "shard_grad_op"),
                     (3, "NO_SHARD", "no_shard"), (4, "HYBRID_SHARD", "hybrid_shard"),
                     (5, "HYBRID_SHARD_ZERO2", "hybrid_shard_zero2")]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "strategy"),
    [(spelling, strategy) for number, name, strategy in _FSDP1_STRATEGIES
     for spelling in (number, str(number), name)],
)  # fmt: skip
def test_every_fsdp_sharding_strategy_number_and_name_maps_to_its_strategy(value, strategy) -> None:  # type: ignore[no-untyped-def]
    """Fourth audit: Accelerate writes torch's ShardingStrategy by number (1-5, an int in
    its YAML) or by name; each of the five means the same strategy either way. 5 is
    HYBRID_SHARD_ZERO2: parameters kept gathered after forward, not hybrid_shard's reshard."""
    data = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": value}}
    translation = translate_accelerate(data)
    assert translation.config.parallel.strategy == strategy
    (row,) = [r for r in translation.rows if r.key == "fsdp_config.fsdp_sharding_strategy"]
    assert (row.became, row.verdict) == (f"parallel.strategy='{strategy}'", "exact")


@pytest.mark.parametrize("device", ["none", None])
def test_a_deepspeed_file_offloading_to_none_is_no_offload(tmp_path, device) -> None:  # type: ignore[no-untyped-def]
    """Fourth audit: the DeepSpeed file an Accelerate config names may say no offload as
    its templates do ("device": "none"); read as none, not refused as a target."""
    zero = {"stage": 2, "offload_optimizer": {"device": device},
            "offload_param": {"device": device}}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": zero}))
    text = (
        LAUNCH
        + "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
    )
    translation = translate_accelerate(_yaml(tmp_path, text))
    assert translation.refused == []
    config = translation.config
    assert (config.parallel.strategy, config.parallel.cpu_offload) == ("shard_grad_op", False)


@pytest.mark.parametrize(
    ("key", "verdict", "said"),
    [("cp_size", "differs", "in place of torch's ring"), ("sp_size", "exact", "as DeepSpeed's")],
)
def test_a_sequence_split_becomes_context_parallel(tmp_path, key, verdict, said) -> None:  # type: ignore[no-untyped-def]
    text = FSDP2 + (
        "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
        f"  parallelism_config_{key}: 2\n  parallelism_config_cp_backend: torch\n"
    )
    translation = translate_accelerate(_yaml(tmp_path, text))
    rows = {r.key: r for r in translation.rows}
    row = rows[f"parallelism_config.parallelism_config_{key}"]
    assert translation.config.parallel.cp == 2
    assert (row.became, row.verdict) == ("parallel.cp=2", verdict) and said in row.note
    assert rows["parallelism_config.parallelism_config_cp_backend"].verdict == "no effect"


# --------------------------------------------------------------------------- issue 50: a newcomer


def test_a_misspelt_key_names_the_closest_key_of_its_level() -> None:
    translation = translate_accelerate({
        "distributed_typ": "FSDP",
        "distributed_type": "FSDP",
        "fsdp_config": {"fsdp_sharding_stratgy": 1},
        "parallelism_config": {"parallelism_config_dp_shrd_size": 2, "tp_sze": 2},
        "dynamo_config": {"dynamo_backnd": "inductor"},
        "xyzzy": 1,
    })  # fmt: skip
    assert {r.key: r.note for r in translation.refused} == {
        "distributed_typ": "not an Accelerate key shardwise reads. Did you mean "
        "'distributed_type'?",
        "fsdp_config.fsdp_sharding_stratgy": "not an fsdp_config key shardwise reads. Did you "
        "mean 'fsdp_sharding_strategy'?",
        "parallelism_config.parallelism_config_dp_shrd_size": "not a parallelism_config key "
        "shardwise reads. Did you mean 'parallelism_config_dp_shard_size'?",
        "parallelism_config.tp_sze": "not a parallelism_config key shardwise reads. Did you "
        "mean 'tp_size'?",
        "dynamo_config.dynamo_backnd": "not a dynamo_config key shardwise reads. Did you mean "
        "'dynamo_backend'?",
        "xyzzy": "not an Accelerate key shardwise reads",
    }
    inline = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stag": 3}}
    assert {r.key: r.note for r in translate_accelerate(inline).refused} == {
        "deepspeed_config.zero_stag": "not a deepspeed_config key shardwise reads. Did you "
        "mean 'zero_stage'?"
    }


def test_the_inline_deepspeed_keys_are_named_and_refused_beside_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import yaml

    rows = {r.key: r for r in translate_accelerate(yaml.safe_load(DS_INLINE)).rows}
    assert rows["deepspeed_config.zero_stage"].became == (
        "read as zero_optimization.stage (its row below)"
    )
    assert rows["deepspeed_config.zero3_init_flag"].verdict == "no effect"
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    both = {"distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero_stage": 2}}  # fmt: skip
    path = tmp_path / "accelerate.yaml"
    path.write_text(json.dumps(both))
    assert_refused(
        translate_accelerate(path),
        {"deepspeed_config.zero_stage": "beside deepspeed_config_file, which decides "
         "(Accelerate refuses both)"},
    )  # fmt: skip


@pytest.mark.parametrize("text", [FSDP1, FSDP1_NUMBERED, FSDP2, HSDP_TP, DS_INLINE, DDP],
                         ids=["fsdp1", "numbered", "fsdp2", "hsdp_tp", "ds_inline", "ddp"])  # fmt: skip
def test_every_key_read_is_named_in_the_table(text) -> None:  # type: ignore[no-untyped-def]
    import yaml

    data = yaml.safe_load(text)
    translation = translate_accelerate(data)
    assert unnamed_keys(translation, data) == [], translation.table()


def test_a_file_of_another_kind_is_named_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torchtitan = {"parallelism": {"tensor_parallel_degree": 2}, "training": {"steps": 10}}
    with pytest.raises(ConfigError) as exc:
        translate_accelerate(torchtitan)
    assert str(exc.value) == (
        "the config given is a torchtitan config (it has parallelism, training), not an "
        "Accelerate config: read it as torchtitan's (a .toml file, --from)."
    )
    path = tmp_path / "ds_config.yaml"  # a DeepSpeed config written out as YAML
    path.write_text("zero_optimization:\n  stage: 3\ntrain_micro_batch_size_per_gpu: 4\n")
    with pytest.raises(ConfigError) as exc:
        translate_accelerate(path)
    assert str(exc.value) == (
        f"{path} is a DeepSpeed config (it has zero_optimization, "
        "train_micro_batch_size_per_gpu), not an Accelerate config: read it as DeepSpeed's "
        "(a .json file, --deepspeed or --from)."
    )
    as_json = tmp_path / "accelerate.json"  # Accelerate reads a JSON config too
    as_json.write_text(json.dumps({"distributed_type": "MULTI_GPU"}))
    assert translate_accelerate(as_json).parallel["strategy"] == "ddp"
    run_file = tmp_path / "run.yaml"  # a shardwise run file
    run_file.write_text("parallel:\n  strategy: full_shard\ntrain:\n  accumulate_steps: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"run.yaml is a shardwise run file \(it has parallel, "
        r"train\), not an Accelerate config: give it to the script as --config",
    ):
        translate_accelerate(run_file)
