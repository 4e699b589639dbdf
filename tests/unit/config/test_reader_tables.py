"""Every entry of the foreign readers' tables, asserted against values written out here.

Each table of translations, defaults or verdicts in config/deepspeed.py, accelerate.py and
torchtitan.py is checked key by key (a wrong entry fails its own case), each compound
refusal with each of its conditions alone false, and each formula at values where the
plausible wrong formulas (swapped operands, floor for ceil, a missing factor) differ.
"""

from __future__ import annotations

import math

import pytest

from shardwise.config.accelerate import translate_accelerate
from shardwise.config.deepspeed import translate_deepspeed
from shardwise.config.deepspeed_schedules import deepspeed_lr
from shardwise.config.torchtitan import translate_torchtitan
from shardwise.config.translation import Row, Translation


def _row(t: Translation, key: str) -> Row:
    found = [r for r in t.rows if r.key == key]
    assert len(found) == 1, (key, t.rows)
    return found[0]


# ---------------------------------------------------------------------------- DeepSpeed

_DS_TOP_NO_EFFECT = [
    "steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb",
    "csv_monitor", "comet", "flops_profiler", "comms_logger", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "prescale_gradients", "gradient_predivide_factor",
    "memory_breakdown",
]  # fmt: skip
_DS_TOP_REFUSED = [
    "amp", "pipeline", "sparse_attention", "compression_training", "activation_checkpointing",
    "aio", "data_efficiency", "curriculum_learning", "elasticity", "autotuning",
    "sequence_parallel_size", "tensor_parallel", "moe",
]  # fmt: skip
_DS_ZERO_NO_EFFECT = [
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
    "allgather_partitions", "reduce_scatter", "round_robin_gradients",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size",
    "memory_efficient_linear", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "elastic_checkpoint", "load_from_fp32_weights",
    "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
]  # fmt: skip
_DS_ZERO_REFUSED = [
    "zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_hpz_partition_size", "mics_shard_size", "mics_hierarchical_params_gather",
]  # fmt: skip


@pytest.mark.parametrize(
    ("key", "verdict"),
    [(k, "no effect") for k in _DS_TOP_NO_EFFECT] + [(k, "refused") for k in _DS_TOP_REFUSED],
)
def test_deepspeed_every_listed_top_level_key_has_its_verdict(key: str, verdict: str) -> None:
    t = translate_deepspeed({key: 1})
    row = _row(t, key)
    assert (row.verdict, row.became) == (verdict, "-")
    assert not row.note.startswith("not a")  # its listed reason, not the unknown key's


@pytest.mark.parametrize(
    ("key", "verdict"),
    [(k, "no effect") for k in _DS_ZERO_NO_EFFECT] + [(k, "refused") for k in _DS_ZERO_REFUSED],
)
def test_deepspeed_every_listed_zero_key_has_its_verdict(key: str, verdict: str) -> None:
    t = translate_deepspeed({"zero_optimization": {"stage": 3, key: 1}})
    row = _row(t, f"zero_optimization.{key}")
    assert (row.verdict, row.became) == (verdict, "-")
    assert not row.note.startswith("not a")  # its listed reason, not the unknown key's


@pytest.mark.parametrize(
    ("stage", "strategy", "verdict"),
    [(0, "ddp", "exact"), (1, "shard_grad_op", "differs"), (2, "shard_grad_op", "exact"),
     (3, "full_shard", "exact")],
)  # fmt: skip
def test_deepspeed_every_zero_stage(stage: int, strategy: str, verdict: str) -> None:
    t = translate_deepspeed({"zero_optimization": {"stage": stage}})
    assert t.parallel["strategy"] == strategy
    row = _row(t, "zero_optimization.stage")
    assert (row.became, row.verdict) == (f"parallel.strategy='{strategy}'", verdict)


@pytest.mark.parametrize("stage", [4, -1, "3"])
def test_deepspeed_a_stage_outside_the_table_is_refused(stage: object) -> None:
    t = translate_deepspeed({"zero_optimization": {"stage": stage}})
    row = _row(t, "zero_optimization.stage")
    assert (row.verdict, row.note) == ("refused", "stage must be 0, 1, 2 or 3")
    assert "strategy" not in t.parallel


def test_deepspeed_a_silent_zero_stage_is_0() -> None:
    t = translate_deepspeed({"zero_optimization": {}})
    assert t.parallel["strategy"] == "ddp"


@pytest.mark.parametrize(
    ("key", "field", "section", "want"),
    [
        ("train_micro_batch_size_per_gpu", "batch_size", "runner", 8),
        ("gradient_accumulation_steps", "accumulate_steps", "train", 1),
        ("gradient_clipping", "max_grad_norm", "train", 1.0),
    ],
)
def test_deepspeed_each_top_level_auto_is_the_trainers_default(
    key: str, field: str, section: str, want: object
) -> None:
    t = translate_deepspeed({key: "auto"})
    assert getattr(t, section)[field] == want
    assert _row(t, key).verdict == "exact"


@pytest.mark.parametrize(
    ("param", "want"),
    [("lr", 5e-5), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0)],
)
def test_deepspeed_each_optimizer_auto_is_the_trainers_default(param: str, want: object) -> None:
    t = translate_deepspeed({"optimizer": {"type": "AdamW", "params": {param: "auto"}}})
    assert t.optimizer[param] == want
    assert _row(t, f"optimizer.params.{param}").became == f"optimizer.{param}={want}"


@pytest.mark.parametrize(("param", "want"), [("warmup_min_lr", 0.0), ("warmup_num_steps", 0)])
def test_deepspeed_each_schedule_auto_is_the_trainers_default(param: str, want: object) -> None:
    t = translate_deepspeed({"scheduler": {"type": "WarmupLR", "params": {param: "auto"}}})
    assert _row(t, f"scheduler.params.{param}").became == f"WarmupLR's {param}={want}"


@pytest.mark.parametrize(
    ("kind", "params", "name"),
    [
        ("Adam", {}, "adamw"),
        ("Adam", {"adam_w_mode": True}, "adamw"),
        ("Adam", {"adam_w_mode": False}, "adam"),
        ("AdamW", {}, "adamw"),
        ("AdamW", {"adam_w_mode": False}, None),  # adam_w_mode is Adam's alone
        ("adam_w", {}, "adamw"),
        ("SGD", {}, "sgd"),
        ("sgd", {"momentum": 0.9}, "sgd"),
    ],
)
def test_deepspeed_every_torch_optimizer(kind: str, params: dict, name: str | None) -> None:  # type: ignore[type-arg]
    t = translate_deepspeed({"optimizer": {"type": kind, "params": params}})
    if name is None:
        assert _row(t, "optimizer.params.adam_w_mode").verdict == "refused"
        assert t.optimizer["name"] == "adamw"
        return
    assert t.optimizer["name"] == name
    assert _row(t, "optimizer.type").verdict == "exact"


@pytest.mark.parametrize(
    "kind", ["OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lamb", "Lion", "MuAdam", "onebit_adam"]
)
def test_deepspeed_every_deepspeed_only_optimizer_is_refused_as_such(kind: str) -> None:
    row = _row(translate_deepspeed({"optimizer": {"type": kind}}), "optimizer.type")
    assert row.verdict == "refused"
    assert row.note == "a DeepSpeed-only optimizer; torch has none that computes the same update"


def test_deepspeed_another_optimizer_is_refused_as_not_torchs() -> None:
    row = _row(translate_deepspeed({"optimizer": {"type": "Adagrad"}}), "optimizer.type")
    assert row.note == "not a torch optimizer shardwise builds (Adam, AdamW, SGD)"


def test_deepspeed_torch_adam_is_no_effect_under_adam_only() -> None:
    t = translate_deepspeed({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}})
    assert _row(t, "optimizer.params.torch_adam").verdict == "no effect"
    t = translate_deepspeed({"optimizer": {"type": "SGD", "params": {"torch_adam": True}}})
    assert _row(t, "optimizer.params.torch_adam").verdict == "refused"


@pytest.mark.parametrize(
    ("block", "preset"), [("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")]
)
def test_deepspeed_every_precision_block(block: str, preset: str) -> None:
    t = translate_deepspeed({block: {"enabled": True}})
    assert t.parallel["mixed_precision"] == preset
    assert _row(t, f"{block}.enabled").became == f"parallel.mixed_precision='{preset}'"


@pytest.mark.parametrize("enabled", [False, "auto"])
def test_deepspeed_a_precision_block_off_or_auto_is_fp32(enabled: object) -> None:
    t = translate_deepspeed({"bf16": {"enabled": enabled, "loss_scale": 0}})
    assert "mixed_precision" not in t.parallel
    assert _row(t, "bf16.enabled").became == "fp32"
    assert _row(t, "bf16.loss_scale").verdict == "no effect"


def test_deepspeed_bf16_and_fp16_both_enabled_is_refused_only_when_both_are() -> None:
    both = translate_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert _row(both, "fp16").note == "bf16 and fp16 both enabled"
    for one in (
        {"bf16": {"enabled": True}, "fp16": {"enabled": False}},
        {"bf16": {"enabled": False}, "fp16": {"enabled": True}},
        {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}},  # the same preset twice
    ):
        assert not any(r.verdict == "refused" for r in translate_deepspeed(one).rows), one


@pytest.mark.parametrize(
    ("sub", "value", "verdict"),
    [
        ("loss_scale_window", 1000, "differs"),
        ("hysteresis", 2, "differs"),
        ("consecutive_hysteresis", False, "differs"),
        ("min_loss_scale", 1, "differs"),
        ("auto_cast", False, "no effect"),
        ("immediate_grad_update", False, "no effect"),
        ("check_grad_overflow", False, "no effect"),
        ("loss_scale", 0, "exact"),
        ("loss_scale", 0.0, "exact"),
        ("loss_scale", 128, "refused"),
        ("initial_scale_power", 12, "exact"),
        ("loss_scal", 0, "refused"),
    ],
)
def test_deepspeed_every_fp16_key(sub: str, value: object, verdict: str) -> None:
    t = translate_deepspeed({"fp16": {"enabled": True, sub: value}})
    assert _row(t, f"fp16.{sub}").verdict == verdict
    if sub == "initial_scale_power":
        assert t.train["init_scale"] == 4096.0
    if sub == "loss_scale" and verdict == "exact":
        assert t.train["grad_scaler"] is True


@pytest.mark.parametrize(
    ("value", "verdict"), [("fp32", "exact"), ("float32", "exact"), ("fp16", "refused"),
                           ("bf16", "refused")]
)  # fmt: skip
def test_deepspeed_every_communication_data_type(value: str, verdict: str) -> None:
    row = _row(translate_deepspeed({"communication_data_type": value}), "communication_data_type")
    assert row.verdict == verdict


@pytest.mark.parametrize(
    ("sub", "device", "stage", "verdict", "offload"),
    [
        ("offload_param", "none", 3, "exact", False),
        ("offload_param", None, 3, "exact", False),
        ("offload_param", "nvme", 3, "refused", False),
        ("offload_param", "cpu", 0, "refused", False),
        # DeepSpeed reads offload_param at stage 3 only ("Valid only with stage 3")
        ("offload_param", "cpu", 1, "no effect", False),
        ("offload_param", "cpu", 2, "no effect", False),
        ("offload_param", "cpu", 3, "exact", True),
        ("offload_optimizer", "cpu", 1, "differs", True),
        ("offload_optimizer", "cpu", 3, "differs", True),
        ("offload_optimizer", "cpu", 2, "differs", True),
        ("offload_optimizer", "cpu", 0, "refused", False),
        ("offload_optimizer", "nvme", 0, "refused", False),
    ],
)
def test_deepspeed_every_offload(
    sub: str, device: object, stage: int, verdict: str, offload: bool
) -> None:
    t = translate_deepspeed({"zero_optimization": {"stage": stage, sub: {"device": device}}})
    row = _row(t, f"zero_optimization.{sub}")
    assert row.verdict == verdict
    assert t.parallel.get("cpu_offload", False) is offload
    if device == "cpu" and stage == 0:
        assert row.note == "offload needs ZeRO stage 1 or more"
    if device == "nvme":
        assert row.note == "offload to 'nvme' is not built"


@pytest.mark.parametrize(("value", "norm"), [(0, None), (0.0, None), (2, 2.0), (0.5, 0.5)])
def test_deepspeed_clipping_zero_is_off(value: object, norm: float | None) -> None:
    assert translate_deepspeed({"gradient_clipping": value}).train["max_grad_norm"] == norm


@pytest.mark.parametrize(
    ("given", "world", "micro", "steps"),
    [
        # accumulation = total / (micro x world): 96 / (4 x 4) = 6 (96 / 4 = 24, 96 / 16 ...)
        ({"train_batch_size": 96, "train_micro_batch_size_per_gpu": 4}, 4, 4, 6),
        # micro = total / (accumulation x world): 96 / (3 x 4) = 8
        ({"train_batch_size": 96, "gradient_accumulation_steps": 3}, 4, 8, 3),
        # neither: accumulation 1, micro = 60 / 5 = 12
        ({"train_batch_size": 60}, 5, 12, 1),
        # all three consistent: 2 x 3 x 7 = 42
        ({"train_batch_size": 42, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 3}, 7, 2, 3),
    ],
)  # fmt: skip
def test_deepspeed_batch_arithmetic(given: dict, world: int, micro: int, steps: int) -> None:  # type: ignore[type-arg]
    t = translate_deepspeed(given, world=world)
    row = _row(t, "train_batch_size")
    assert row.verdict == "exact", row
    assert (t.runner["batch_size"], t.train.get("accumulate_steps", 1)) == (micro, steps)
    assert row.note == f"{micro} x {steps} x {world} ranks = {given['train_batch_size']}"


@pytest.mark.parametrize(
    ("given", "world"),
    [
        ({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4}, 3),  # 100 / 12
        ({"train_batch_size": 90, "gradient_accumulation_steps": 4}, 3),  # 90 / 12
        ({"train_batch_size": 41, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 3}, 7),
        ({"train_batch_size": 43, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 3}, 7),
    ],
)  # fmt: skip
def test_deepspeed_a_batch_that_does_not_multiply_out_is_refused(given: dict, world: int) -> None:  # type: ignore[type-arg]
    row = _row(translate_deepspeed(given, world=world), "train_batch_size")
    assert row.verdict == "refused"
    assert row.note.endswith("DeepSpeed would refuse this too")


def test_deepspeed_train_batch_without_a_world_needs_both_others() -> None:
    both = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2}  # fmt: skip
    assert _row(translate_deepspeed(both), "train_batch_size").became == "checked at launch"
    for drop in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        one = {k: v for k, v in both.items() if k != drop}
        row = _row(translate_deepspeed(one), "train_batch_size")
        assert row.verdict == "refused", drop
        assert row.note.endswith("give world=")
    assert _row(translate_deepspeed({"train_batch_size": "auto"}), "train_batch_size").became == (
        "implied"
    )


@pytest.mark.parametrize(
    ("kind", "params", "lrs"),
    [
        # log warm-up over 10 steps from 0.1 to 1.0: step s runs at iteration s - 1
        ("WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 1.0, "warmup_num_steps": 10},
         {0: 0.1, 1: 0.1, 2: 0.1 + 0.9 * math.log(2) / math.log(10), 11: 1.0, 50: 1.0}),
        ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4,
                      "warmup_type": "linear"},
         {1: 0.0, 2: 0.25, 4: 0.75, 5: 1.0}),
        # linear decay from 1.0 at iteration 4 to 0 at iteration 12
        ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4,
                           "warmup_type": "linear", "total_num_steps": 12},
         {5: 1.0, 7: 0.75, 11: 0.25, 13: 0.0, 20: 0.0}),
        ("WarmupCosineLR", {"warmup_num_steps": 4, "warmup_type": "linear",
                            "total_num_steps": 12, "warmup_min_ratio": 0.0,
                            "cos_min_ratio": 0.0},
         {0: 0.0, 1: 0.0, 3: 0.5, 5: 1 * (1 + math.cos(math.pi / 8)) / 2,
          9: 0.5 * (1 + math.cos(math.pi * 5 / 8)), 12: 0.0,
          13: 0.5 * (1 + math.cos(math.pi * 9 / 8))}),  # DeepSpeed's cosine turns back up
    ],
)  # fmt: skip
def test_deepspeed_schedules_at_steps_where_wrong_formulas_differ(
    kind: str,
    params: dict,  # type: ignore[type-arg]
    lrs: dict[int, float],
) -> None:
    lr = deepspeed_lr(kind, params)
    for step, want in lrs.items():
        assert lr(step, 1.0) == pytest.approx(want), step


def test_deepspeed_schedule_defaults() -> None:
    # warmup_num_steps 1000, log warm-up, from 0 to 1e-3; warm-up floor of 2 steps
    lr = deepspeed_lr("WarmupLR", {})
    assert lr(0, 1.0) == 0.0
    assert lr(2, 1.0) == pytest.approx(1e-3 * math.log(2) / math.log(1000))
    assert lr(1001, 1.0) == pytest.approx(1e-3)
    one = deepspeed_lr("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"})
    assert one(2, 1.0) == pytest.approx(0.5e-3)  # max(2, 1) steps of warm-up
    cos = deepspeed_lr("WarmupCosineLR", {"total_num_steps": 2000})
    assert cos(1000, 1.0) == pytest.approx(1.0)  # the last warm-up step
    first = (1 + math.cos(math.pi / 1000)) / 2
    assert cos(1001, 1.0) == pytest.approx(1e-4 + (1 - 1e-4) * first, abs=1e-12)
    last = (1 + math.cos(math.pi * 999 / 1000)) / 2
    assert cos(1999, 1.0) == pytest.approx(1e-4 + (1 - 1e-4) * last, abs=1e-12)
    assert cos(2000, 1.0) == pytest.approx(1e-4)  # cos_min_ratio's default


# ---------------------------------------------------------------------------- Accelerate


@pytest.mark.parametrize(
    ("value", "strategy"),
    [(1, "full_shard"), (2, "shard_grad_op"), (3, "no_shard"), (4, "hybrid_shard"),
     (5, "hybrid_shard_zero2"), ("1", "full_shard"), ("FULL_SHARD", "full_shard"),
     ("SHARD_GRAD_OP", "shard_grad_op"), ("NO_SHARD", "no_shard"),
     ("HYBRID_SHARD", "hybrid_shard"), ("_HYBRID_SHARD_ZERO2", "hybrid_shard_zero2")],
)  # fmt: skip
def test_accelerate_every_sharding_strategy(value: object, strategy: str) -> None:
    t = translate_accelerate(
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": value}}
    )
    assert t.parallel["strategy"] == strategy
    assert _row(t, "fsdp_config.fsdp_sharding_strategy").verdict == "exact"


@pytest.mark.parametrize("value", [0, 6, "FULL"])
def test_accelerate_a_sharding_strategy_outside_the_table_is_refused(value: object) -> None:
    t = translate_accelerate(
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": value}}
    )
    assert _row(t, "fsdp_config.fsdp_sharding_strategy").verdict == "refused"


@pytest.mark.parametrize(
    ("value", "prefetch", "verdict"),
    [("BACKWARD_PRE", "pre", "exact"), ("BACKWARD_POST", "post", "differs"),
     ("NO_PREFETCH", None, "exact")],
)  # fmt: skip
def test_accelerate_every_backward_prefetch(value: str, prefetch: object, verdict: str) -> None:
    t = translate_accelerate(
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_backward_prefetch": value}}
    )
    assert t.parallel["backward_prefetch"] == prefetch
    row = _row(t, "fsdp_config.fsdp_backward_prefetch")
    assert (row.verdict, row.became) == (verdict, f"parallel.backward_prefetch={prefetch!r}")


def test_accelerate_another_backward_prefetch_is_refused() -> None:
    t = translate_accelerate(
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_backward_prefetch": "PRE"}}
    )
    assert _row(t, "fsdp_config.fsdp_backward_prefetch").verdict == "refused"
    assert "backward_prefetch" not in t.parallel


_LAUNCH = [
    "compute_environment", "debug", "machine_rank", "main_process_ip", "main_process_port",
    "main_training_function", "rdzv_backend", "same_network", "gpu_ids", "num_machines",
    "num_processes", "enable_cpu_affinity", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "use_cpu", "downcast_bf16", "deepspeed_multinode_launcher", "ipex_config", "mpirun_config",
]  # fmt: skip


@pytest.mark.parametrize("key", _LAUNCH)
def test_accelerate_every_launch_key_is_no_effect(key: str) -> None:
    row = _row(translate_accelerate({key: 1}), key)
    assert row.verdict == "no effect"


@pytest.mark.parametrize(
    ("kind", "strategy", "verdict"),
    [("MULTI_GPU", "ddp", "exact"), ("MULTI_CPU", "ddp", "exact"), ("NO", "ddp", "exact"),
     ("FSDP", "full_shard", "exact"), ("DEEPSPEED", None, "exact"), ("XLA", None, "refused"),
     ("MEGATRON_LM", None, "refused"), ("MULTI_XPU", None, "refused")],
)  # fmt: skip
def test_accelerate_every_distributed_type(kind: str, strategy: str | None, verdict: str) -> None:
    t = translate_accelerate({"distributed_type": kind})
    assert t.parallel.get("strategy") == strategy
    assert _row(t, "distributed_type").verdict == verdict


def test_accelerate_a_silent_distributed_type_is_one_process() -> None:
    t = translate_accelerate({"mixed_precision": "no"})
    assert t.parallel["strategy"] == "ddp"
    assert _row(t, "distributed_type").value == "NO"


@pytest.mark.parametrize(
    ("version", "value", "strategy"),
    [
        # FSDP1 (Accelerate's default version): a sharding strategy, by name or number
        (1, True, "full_shard"), (1, False, "shard_grad_op"), (1, "FULL_SHARD", "full_shard"),
        (1, "SHARD_GRAD_OP", "shard_grad_op"), (1, "shard_grad_op", "shard_grad_op"),
        (1, "NO_SHARD", "no_shard"), (1, "HYBRID_SHARD", "hybrid_shard"),
        (1, "_HYBRID_SHARD_ZERO2", "hybrid_shard_zero2"), (1, "2", "shard_grad_op"),
        (1, 4, "hybrid_shard"), (1, 3, "no_shard"),
        # FSDP2: a truth value (Accelerate's str_to_bool)
        (2, True, "full_shard"), (2, False, "shard_grad_op"), (2, "true", "full_shard"),
        (2, "false", "shard_grad_op"), (2, "0", "shard_grad_op"), (2, "yes", "full_shard"),
    ],
)  # fmt: skip
def test_accelerate_every_reshard_after_forward(version: int, value: object, strategy: str) -> None:
    """Found by this table: a string under FSDP1 was full_shard unless it was SHARD_GRAD_OP
    (HYBRID_SHARD, NO_SHARD and numbers lost), and 'false' under FSDP2 resharded."""
    t = translate_accelerate({"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": version, "fsdp_reshard_after_forward": value}})  # fmt: skip
    assert t.parallel["strategy"] == strategy
    assert _row(t, "fsdp_config.fsdp_reshard_after_forward").verdict == "exact"


@pytest.mark.parametrize(("version", "value"), [(1, "PARTIAL"), (1, 7), (2, "SHARD_GRAD_OP")])
def test_accelerate_a_reshard_after_forward_of_the_other_version_is_refused(
    version: int, value: object
) -> None:
    t = translate_accelerate({"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": version, "fsdp_reshard_after_forward": value}})  # fmt: skip
    assert _row(t, "fsdp_config.fsdp_reshard_after_forward").verdict == "refused"
    assert t.parallel["strategy"] == "full_shard"  # distributed_type FSDP's, unchanged


@pytest.mark.parametrize(
    ("sub", "value", "field", "want"),
    [
        ("fsdp_offload_params", True, "cpu_offload", True),
        ("fsdp_offload_params", False, "cpu_offload", False),
        ("fsdp_forward_prefetch", True, "forward_prefetch", True),
        ("fsdp_sync_module_states", True, "sync_module_states", True),
        ("fsdp_sync_module_states", False, "sync_module_states", False),
        ("fsdp_activation_checkpointing", True, "activation_checkpointing", "full"),
        ("fsdp_activation_checkpointing", False, "activation_checkpointing", "none"),
    ],
)
def test_accelerate_every_fsdp_switch(sub: str, value: object, field: str, want: object) -> None:
    t = translate_accelerate({"distributed_type": "FSDP", "fsdp_config": {sub: value}})
    assert t.parallel[field] == want
    assert _row(t, f"fsdp_config.{sub}").verdict == "exact"


@pytest.mark.parametrize(
    ("sub", "value", "verdict"),
    [("fsdp_use_orig_params", True, "no effect"), ("fsdp_use_orig_params", False, "refused"),
     ("fsdp_cpu_ram_efficient_loading", True, "no effect"),
     ("fsdp_state_dict_type", "SHARDED_STATE_DICT", "no effect"),
     ("fsdp_version", 2, "exact"), ("fsdp_wrap", 1, "refused")],
)  # fmt: skip
def test_accelerate_every_other_fsdp_key(sub: str, value: object, verdict: str) -> None:
    t = translate_accelerate({"distributed_type": "FSDP", "fsdp_config": {sub: value}})
    assert _row(t, f"fsdp_config.{sub}").verdict == verdict


@pytest.mark.parametrize(
    ("block", "policy", "min_params"),
    [
        ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
          "fsdp_transformer_layer_cls_to_wrap": "Block, MLP"}, ["Block", "MLP"], None),
        ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}, None, None),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000}, "size", 1000),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, "size", None),
        ({"fsdp_auto_wrap_policy": "NO_WRAP"}, "none", None),
    ],
)  # fmt: skip
def test_accelerate_every_wrap_policy(block: dict, policy: object, min_params: object) -> None:  # type: ignore[type-arg]
    t = translate_accelerate({"distributed_type": "FSDP", "fsdp_config": block})
    assert t.parallel.get("auto_wrap_policy") == policy
    assert t.parallel.get("min_num_params") == min_params
    assert _row(t, "fsdp_config.fsdp_auto_wrap_policy").verdict == "exact"


def test_accelerate_another_wrap_policy_is_refused() -> None:
    t = translate_accelerate(
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_auto_wrap_policy": "LAMBDA"}}
    )
    assert _row(t, "fsdp_config.fsdp_auto_wrap_policy").verdict == "refused"


def test_accelerate_fsdp_config_is_read_only_under_fsdp_as_a_mapping() -> None:
    block = {"fsdp_offload_params": True}
    read = translate_accelerate({"distributed_type": "FSDP", "fsdp_config": block})
    assert read.parallel["cpu_offload"] is True
    for data in (
        {"distributed_type": "MULTI_GPU", "fsdp_config": block},
        {"distributed_type": "FSDP", "fsdp_config": "full"},
    ):
        t = translate_accelerate(data)
        assert _row(t, "fsdp_config").verdict == "no effect"
        assert "cpu_offload" not in t.parallel


@pytest.mark.parametrize(
    ("kind", "value", "preset", "verdict"),
    [("MULTI_GPU", "no", None, "exact"), ("MULTI_GPU", None, None, "exact"),
     ("MULTI_GPU", "bf16", "bf16", "differs"), ("FSDP", "fp16", "fp16", "differs"),
     ("MULTI_GPU", "fp8", None, "refused"), ("DEEPSPEED", "bf16", "bf16", "exact")],
)  # fmt: skip
def test_accelerate_every_mixed_precision(
    kind: str, value: object, preset: str | None, verdict: str
) -> None:
    data: dict[str, object] = {"distributed_type": kind, "mixed_precision": value}
    if kind == "DEEPSPEED":
        data["deepspeed_config"] = {"zero_stage": 2}
    t = translate_accelerate(data)
    assert t.parallel.get("mixed_precision") == preset
    assert _row(t, "mixed_precision").verdict == verdict


_INLINE = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer",
    "offload_param_device": "zero_optimization.offload_param",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}
_INLINE_NO_EFFECT = [
    "zero3_init_flag", "zero3_save_16bit_model", "offload_optimizer_nvme_path",
    "offload_param_nvme_path", "deepspeed_moe_layer_cls_names", "deepspeed_multinode_launcher",
    "deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter",
]  # fmt: skip


@pytest.mark.parametrize(("sub", "means"), list(_INLINE.items()))
def test_accelerate_every_inline_deepspeed_key(sub: str, means: str) -> None:
    value = {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu",
             "gradient_accumulation_steps": 4, "gradient_clipping": 0.5}[sub]  # fmt: skip
    t = translate_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {sub: value}})
    row = _row(t, f"deepspeed_config.{sub}")
    assert (row.verdict, row.became) == ("exact", f"read as {means} (its row below)")
    # offload_param_device beside Accelerate's default zero_stage 2: DeepSpeed does not read it
    assert _row(t, f"deepspeed_config: {means}").verdict in ("exact", "differs", "no effect")


def test_accelerate_inline_deepspeed_keys_translate_to_their_values() -> None:
    t = translate_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                              "deepspeed_config": {"zero_stage": 3,
                                                   "offload_param_device": "cpu",
                                                   "gradient_accumulation_steps": 4,
                                                   "gradient_clipping": 0.5}})  # fmt: skip
    assert t.parallel["strategy"] == "full_shard"
    assert t.parallel["cpu_offload"] is True
    assert t.parallel["mixed_precision"] == "bf16"
    assert (t.train["accumulate_steps"], t.train["max_grad_norm"]) == (4, 0.5)


def test_accelerate_inline_deepspeed_defaults() -> None:
    # Accelerate's zero_stage default is 2; no offload, no precision
    t = translate_accelerate({"distributed_type": "DEEPSPEED",
                              "deepspeed_config": {"offload_param_device": "none"}})  # fmt: skip
    assert t.parallel["strategy"] == "shard_grad_op"
    assert "cpu_offload" not in t.parallel and "mixed_precision" not in t.parallel


@pytest.mark.parametrize("sub", _INLINE_NO_EFFECT)
def test_accelerate_every_inline_no_effect_key(sub: str) -> None:
    t = translate_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {sub: "x"}})
    assert _row(t, f"deepspeed_config.{sub}").verdict == "no effect"


@pytest.mark.parametrize("sub", list(_INLINE))
def test_accelerate_an_inline_key_beside_a_file_is_refused(sub: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1}}')
    t = translate_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": str(tmp_path / "ds.json"), sub: 1}})  # fmt: skip
    row = _row(t, f"deepspeed_config.{sub}")
    assert row.verdict == "refused"
    assert row.note == "beside deepspeed_config_file, which decides (Accelerate refuses both)"
    none = translate_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": "none", sub: 1}})  # fmt: skip
    assert _row(none, f"deepspeed_config.{sub}").verdict == "exact"


def test_accelerate_deepspeed_config_is_read_only_under_deepspeed() -> None:
    for data in (
        {"distributed_type": "FSDP", "deepspeed_config": {"zero_stage": 3}},
        {"distributed_type": "DEEPSPEED", "deepspeed_config": "z3"},
    ):
        t = translate_accelerate(data)
        assert _row(t, "deepspeed_config").verdict == "no effect"


@pytest.mark.parametrize("prefix", ["", "parallelism_config_"])
@pytest.mark.parametrize(
    ("name", "value", "field", "want"),
    [("dp_shard_size", 4, "dp_shard", 4), ("tp_size", 2, "tp", 2), ("cp_size", 2, "cp", 2),
     ("sp_size", 4, "cp", 4), ("dp_replicate_size", 2, "strategy", "hybrid_shard")],
)  # fmt: skip
def test_accelerate_every_parallelism_size(
    prefix: str, name: str, value: int, field: str, want: object
) -> None:
    t = translate_accelerate({"parallelism_config": {prefix + name: value}})
    assert t.parallel[field] == want


def test_accelerate_one_replica_keeps_the_strategy() -> None:
    t = translate_accelerate({"distributed_type": "FSDP",
                              "parallelism_config": {"dp_replicate_size": 1}})  # fmt: skip
    assert t.parallel["strategy"] == "full_shard"


@pytest.mark.parametrize("name", ["cp_backend", "cp_comm_strategy", "sp_backend"])
def test_accelerate_every_sequence_backend_is_no_effect(name: str) -> None:
    t = translate_accelerate({"parallelism_config": {name: "x"}})
    assert _row(t, f"parallelism_config.{name}").verdict == "no effect"


@pytest.mark.parametrize(
    ("cp", "sp", "refused"), [(2, 2, True), (2, 1, False), (1, 2, False), (1, 1, False)]
)
def test_accelerate_cp_and_sp_both_above_one_is_refused(cp: int, sp: int, refused: bool) -> None:
    for prefix in ("", "parallelism_config_"):
        t = translate_accelerate({"parallelism_config": {prefix + "cp_size": cp,
                                                         prefix + "sp_size": sp}})  # fmt: skip
        verdicts = {r.verdict for r in t.rows if r.key.startswith("parallelism_config.")}
        assert ("refused" in verdicts) is refused, (prefix, cp, sp)
        assert t.parallel.get("cp") == (None if refused or cp == sp == 1 else max(cp, sp))


@pytest.mark.parametrize(
    ("backend", "compile_"), [("NO", None), ("no", None), ("INDUCTOR", "inductor"),
                              ("aot_eager", "aot_eager")]
)  # fmt: skip
def test_accelerate_every_dynamo_backend(backend: str, compile_: object) -> None:
    t = translate_accelerate({"dynamo_config": {"dynamo_backend": backend}})
    assert t.parallel.get("compile") == compile_


def test_accelerate_a_silent_dynamo_backend_is_no_compile() -> None:
    t = translate_accelerate({"dynamo_config": {"dynamo_mode": "default"}})
    assert "compile" not in t.parallel
    assert _row(t, "dynamo_config.dynamo_backend").became == "parallel.compile=False"


@pytest.mark.parametrize(
    "sub", ["dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
            "dynamo_use_regional_compilation"]
)  # fmt: skip
def test_accelerate_every_dynamo_no_effect_key(sub: str) -> None:
    t = translate_accelerate({"dynamo_config": {"dynamo_backend": "INDUCTOR", sub: True}})
    assert _row(t, f"dynamo_config.{sub}").verdict == "no effect"


# ---------------------------------------------------------------------------- torchtitan

_TT_OWN = ["job", "metrics", "profiling", "checkpoint", "comm", "model", "validation",
           "memory_estimation", "experimental", "debug", "dataloader"]  # fmt: skip
_TT_REFUSED = ["float8", "mx", "quantize", "fault_tolerance"]


@pytest.mark.parametrize(
    ("section", "verdict"),
    [(s, "no effect") for s in _TT_OWN] + [(s, "refused") for s in _TT_REFUSED],
)
def test_torchtitan_every_listed_section(section: str, verdict: str) -> None:
    row = _row(translate_torchtitan({section: {"x": 1}}), section)
    assert row.verdict == verdict
    assert not row.note.startswith("not a")  # its listed reason, not the unknown section's


@pytest.mark.parametrize(
    ("value", "schedule"),
    [("1F1B", "1f1b"), ("GPipe", "gpipe"), ("Interleaved1F1B", "interleaved_1f1b")],
)
def test_torchtitan_every_pipeline_schedule(value: str, schedule: str) -> None:
    t = translate_torchtitan({"parallelism": {"pipeline_parallel_schedule": value}})
    assert t.parallel["pp_schedule"] == schedule


@pytest.mark.parametrize("value", ["ZBVZeroBubble", "1f1b", "InterleavedZeroBubble"])
def test_torchtitan_another_pipeline_schedule_is_refused(value: str) -> None:
    t = translate_torchtitan({"parallelism": {"pipeline_parallel_schedule": value}})
    assert _row(t, "parallelism.pipeline_parallel_schedule").verdict == "refused"


def test_torchtitan_every_default_where_the_file_is_silent() -> None:
    t = translate_torchtitan({})
    assert t.optimizer == {"name": "adamw", "lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                           "weight_decay": 0.1}  # fmt: skip
    assert t.parallel == {"mixed_precision": "bf16"}
    assert t.train == {"max_grad_norm": 1.0}


def test_torchtitan_defaults_fill_only_what_is_silent() -> None:
    t = translate_torchtitan({"optimizer": {"lr": 1e-3, "beta1": 0.8},
                              "training": {"mixed_precision_param": "float32",
                                           "max_norm": 0}})  # fmt: skip
    assert t.optimizer == {"name": "adamw", "lr": 1e-3, "betas": (0.8, 0.95), "eps": 1e-8,
                           "weight_decay": 0.1}  # fmt: skip
    assert t.parallel["mixed_precision"] == "fp32"
    assert t.train["max_grad_norm"] is None
    assert translate_torchtitan({"optimizer": {"beta2": 0.99}}).optimizer["betas"] == (0.9, 0.99)


def test_torchtitan_no_optimizer_defaults_under_a_refused_optimizer() -> None:
    t = translate_torchtitan({"optimizer": {"name": "Lion"}})
    assert t.optimizer == {}


@pytest.mark.parametrize(
    ("name", "want"), [("AdamW", "adamw"), ("Adam", "adam"), ("adamw", "adamw")]
)
def test_torchtitan_every_optimizer_name(name: str, want: str) -> None:
    assert translate_torchtitan({"optimizer": {"name": name}}).optimizer["name"] == want


@pytest.mark.parametrize(
    ("p", "strategy", "dp_shard"),
    [
        ({}, "full_shard", None),
        ({"data_parallel_shard_degree": 4}, "full_shard", 4),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}, "ddp", None),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 4},
         "hybrid_shard", 4),
        ({"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1},
         "full_shard", None),
        ({"fsdp_reshard_after_forward": "never"}, "shard_grad_op", None),
        ({"fsdp_reshard_after_forward": "always", "pipeline_parallel_degree": 2},
         "full_shard", None),
        ({"pipeline_parallel_degree": 2}, "shard_grad_op", None),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2,
          "fsdp_reshard_after_forward": "never"}, "hybrid_shard_zero2", 2),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1,
          "fsdp_reshard_after_forward": "never"}, "ddp", None),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1,
          "pipeline_parallel_degree": 2}, "ddp", None),
    ],
)  # fmt: skip
def test_torchtitan_every_data_parallel_layout(p: dict, strategy: str, dp_shard: object) -> None:  # type: ignore[type-arg]
    t = translate_torchtitan({"parallelism": p})
    assert t.parallel["strategy"] == strategy
    assert t.parallel.get("dp_shard") == dp_shard


@pytest.mark.parametrize(
    ("replicate", "tp", "pp", "cp", "world", "shard"),
    # world // (replicate x tp x pp x cp), at values where dropping any factor differs
    [(2, 1, 1, 1, 8, 4), (2, 2, 1, 1, 16, 4), (2, 1, 2, 1, 16, 4), (2, 1, 1, 2, 16, 4),
     (3, 2, 1, 1, 24, 4)],
)  # fmt: skip
def test_torchtitan_shard_degree_of_the_rest(
    replicate: int, tp: int, pp: int, cp: int, world: int, shard: int
) -> None:
    p = {"data_parallel_replicate_degree": replicate, "tensor_parallel_degree": tp,
         "pipeline_parallel_degree": pp, "context_parallel_degree": cp}  # fmt: skip
    t = translate_torchtitan({"parallelism": p}, world=world)
    assert t.parallel["dp_shard"] == shard


@pytest.mark.parametrize(("local", "size", "count"), [(12, 3, 4), (12, 4, 3), (8, 8, 1), (6, 1, 6)])
def test_torchtitan_micro_batches_are_the_local_batch_over_their_size(
    local: int, size: int, count: int
) -> None:
    t = translate_torchtitan({"training": {"local_batch_size": local}, "parallelism": {
        "pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": size}})  # fmt: skip
    assert t.parallel["pp_microbatches"] == count


def test_torchtitan_micro_batch_defaults() -> None:
    # a silent micro-batch size is 1, a silent local batch 8: 8 micro-batches
    t = translate_torchtitan({"parallelism": {"pipeline_parallel_degree": 2}})
    assert t.parallel["pp_microbatches"] == 8
    t = translate_torchtitan({"training": {"local_batch_size": 6},
                              "parallelism": {"pipeline_parallel_degree": 2}})  # fmt: skip
    assert t.parallel["pp_microbatches"] == 6
    t = translate_torchtitan({"parallelism": {"pipeline_parallel_degree": 2,
                                              "pipeline_parallel_microbatch_size": 2}})  # fmt: skip
    assert t.parallel["pp_microbatches"] == 4


@pytest.mark.parametrize(("local", "size"), [(12, 5), (12, 0), (6, 4), (4, 8)])
def test_torchtitan_a_micro_batch_size_that_does_not_divide_is_refused(
    local: int, size: int
) -> None:
    t = translate_torchtitan({"training": {"local_batch_size": local}, "parallelism": {
        "pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": size}})  # fmt: skip
    row = _row(t, "parallelism.pipeline_parallel_microbatch_size")
    assert row.verdict == "refused"
    divisors = ", ".join(str(d) for d in (1, 2, 3, 4, 6, 12) if local % d == 0)
    assert row.note.endswith(f"give a divisor of {local} ({divisors})")


def test_torchtitan_num_pp_microbatches_must_agree_with_the_split() -> None:
    base = {"training": {"local_batch_size": 12}}
    agree = translate_torchtitan({**base, "parallelism": {"pipeline_parallel_degree": 2,
        "pipeline_parallel_microbatch_size": 3, "num_pp_microbatches": 4}})  # fmt: skip
    assert agree.parallel["pp_microbatches"] == 4
    differ = translate_torchtitan({**base, "parallelism": {"pipeline_parallel_degree": 2,
        "pipeline_parallel_microbatch_size": 3, "num_pp_microbatches": 3}})  # fmt: skip
    row = _row(differ, "parallelism.pipeline_parallel_microbatch_size")
    assert row.verdict == "refused"
    assert row.note.startswith("training.local_batch_size=12 // 3 = 4 micro-batches")


@pytest.mark.parametrize(("count", "pp", "set_"), [(4, 2, True), (1, 2, False), (4, 1, False)])
def test_torchtitan_num_pp_microbatches_alone(count: int, pp: int, set_: bool) -> None:
    t = translate_torchtitan({"parallelism": {"pipeline_parallel_degree": pp,
                                              "num_pp_microbatches": count}})  # fmt: skip
    assert t.parallel.get("pp_microbatches") == (count if set_ else None)


@pytest.mark.parametrize(("value", "preset"), [("bfloat16", "bf16"), ("float32", "fp32")])
def test_torchtitan_every_param_precision(value: str, preset: str) -> None:
    t = translate_torchtitan({"training": {"mixed_precision_param": value}})
    assert t.parallel["mixed_precision"] == preset


@pytest.mark.parametrize(
    ("key", "value", "verdict"),
    [("mixed_precision_param", "float16", "refused"), ("mixed_precision_reduce", "float32",
     "exact"), ("mixed_precision_reduce", "bfloat16", "refused"), ("dtype", "float32",
     "no effect"), ("dtype", "bfloat16", "refused"), ("seq_len", 2048, "no effect"),
     ("max_context_length", 1, "no effect"), ("dataset", "c4", "no effect"),
     ("dataset_path", "x", "no effect"), ("gc_freq", 50, "no effect"),
     ("gc_debug", False, "no effect"), ("disable_cuda_graphs", True, "no effect"),
     ("mixed_precision_output", "float32", "no effect"), ("enable_cpu_offload", True, "exact"),
     ("steps", 10, "exact"), ("batch_size", 4, "exact")],
)  # fmt: skip
def test_torchtitan_every_training_key(key: str, value: object, verdict: str) -> None:
    t = translate_torchtitan({"training": {key: value}})
    assert next(r.verdict for r in t.rows if r.key == f"training.{key}") == verdict


def test_torchtitan_training_values() -> None:
    t = translate_torchtitan({"training": {"steps": 10, "local_batch_size": 4,
                                           "enable_cpu_offload": True, "max_norm": 0.5}})  # fmt: skip
    assert (t.runner["max_steps"], t.runner["max_epochs"], t.runner["batch_size"]) == (10, None, 4)
    assert t.parallel["cpu_offload"] is True
    assert t.train["max_grad_norm"] == 0.5


@pytest.mark.parametrize(
    ("a", "ac", "verdict"),
    [({}, "none", "exact"), ({"mode": "full"}, "full", "exact"),
     ({"mode": "selective"}, "every_2", "exact"),
     ({"mode": "selective", "selective_ac_option": "3"}, "every_3", "exact"),
     ({"mode": "selective", "selective_ac_option": 1}, "every_1", "exact"),
     ({"mode": "selective", "selective_ac_option": "op"}, None, "refused"),
     ({"mode": "partial"}, None, "refused")],
)  # fmt: skip
def test_torchtitan_every_checkpointing_mode(a: dict, ac: object, verdict: str) -> None:  # type: ignore[type-arg]
    t = translate_torchtitan({"activation_checkpoint": a})
    assert t.parallel.get("activation_checkpointing") == ac
    assert _row(t, "activation_checkpoint.mode").verdict == verdict


def test_torchtitan_a_selective_option_without_selective_is_no_effect() -> None:
    t = translate_torchtitan({"activation_checkpoint": {"mode": "full",
                                                        "selective_ac_option": "op"}})  # fmt: skip
    assert _row(t, "activation_checkpoint.selective_ac_option").verdict == "no effect"
    assert t.parallel["activation_checkpointing"] == "full"


@pytest.mark.parametrize(
    ("c", "compile_", "backend_verdict"),
    [({}, False, None), ({"enable": True}, "inductor", None),
     ({"enable": True, "backend": "aot_eager"}, "aot_eager", "exact"),
     ({"enable": False, "backend": "aot_eager"}, False, "no effect")],
)  # fmt: skip
def test_torchtitan_every_compile(c: dict, compile_: object, backend_verdict: object) -> None:  # type: ignore[type-arg]
    t = translate_torchtitan({"compile": c})
    assert t.parallel["compile"] == compile_
    if backend_verdict is not None:
        assert _row(t, "compile.backend").verdict == backend_verdict


@pytest.mark.parametrize(
    ("s", "refused"),
    [
        # torchtitan: warmup_steps 200 where silent; decay_ratio None decays linearly to 0
        # over all the steps after the warm-up. Only no warm-up and no decay is constant.
        ({"warmup_steps": 0, "decay_ratio": 0.0}, False),
        ({"warmup_steps": 0, "decay_ratio": 0}, False),
        ({}, True),
        ({"warmup_steps": 0}, True),
        ({"decay_ratio": 0.0}, True),
        ({"warmup_steps": 10, "decay_ratio": 0.0}, True),
        ({"warmup_steps": 0, "decay_ratio": 0.5}, True),
        ({"warmup_steps": 10, "decay_ratio": 0.5}, True),
    ],
)
def test_torchtitan_only_a_constant_lr_schedule_is_built(s: dict, refused: bool) -> None:  # type: ignore[type-arg]
    row = _row(translate_torchtitan({"lr_scheduler": s}), "lr_scheduler")
    assert row.verdict == ("refused" if refused else "exact")
    if refused:
        assert "give warmup_steps = 0 and decay_ratio = 0.0" in row.note
    else:
        assert row.became == "a constant lr"


def test_torchtitan_a_silent_lr_scheduler_is_its_warm_up_and_decay() -> None:
    row = _row(translate_torchtitan({"training": {"steps": 10}}), "lr_scheduler")
    assert (row.value, row.became, row.verdict) == ("(not given)", "a constant lr", "differs")
    assert row.note.startswith("torchtitan's default warms up over 200 steps, then decays ")


@pytest.mark.parametrize(
    ("tp", "value", "loss_parallel"), [(2, False, True), (2, True, None), (1, False, None)]
)
def test_torchtitan_loss_parallel_needs_tp_and_no_disable(
    tp: int, value: bool, loss_parallel: object
) -> None:
    t = translate_torchtitan({"parallelism": {"tensor_parallel_degree": tp,
                                              "disable_loss_parallel": value}})  # fmt: skip
    assert t.parallel.get("loss_parallel") == loss_parallel


@pytest.mark.parametrize(
    "key", ["enable_async_tensor_parallel", "enable_fsdp_symm_mem",
            "context_parallel_load_balancer", "context_parallel_rotate_method", "spmd_backend",
            "pipeline_parallel_schedule_csv"]
)  # fmt: skip
def test_torchtitan_every_kernel_choice_is_no_effect(key: str) -> None:
    t = translate_torchtitan({"parallelism": {key: "x"}})
    assert _row(t, f"parallelism.{key}").verdict == "no effect"


@pytest.mark.parametrize(
    ("key", "value", "verdict", "field"),
    [("context_parallel_degree", 2, "differs", ("cp", 2)),
     ("context_parallel_degree", 1, "exact", ("cp", None)),
     ("expert_tensor_parallel_degree", 2, "refused", ("ep", None)),
     ("expert_tensor_parallel_degree", 1, "exact", ("ep", None)),
     ("expert_parallel_degree", 4, "exact", ("ep", 4)),
     ("expert_parallel_degree", 1, "exact", ("ep", None))],
)  # fmt: skip
def test_torchtitan_every_other_degree(
    key: str, value: int, verdict: str, field: tuple[str, object]
) -> None:
    t = translate_torchtitan({"parallelism": {key: value}})
    assert _row(t, f"parallelism.{key}").verdict == verdict
    assert t.parallel.get(field[0]) == field[1]


@pytest.mark.parametrize(
    ("tp", "given", "sp"), [(2, {}, True), (2, {"enable_sequence_parallel": False}, False),
                            (2, {"enable_sequence_parallel": True}, True)]
)  # fmt: skip
def test_torchtitan_sequence_parallel_is_on_by_default_under_tp(
    tp: int,
    given: dict,  # type: ignore[type-arg]
    sp: bool,
) -> None:
    t = translate_torchtitan({"parallelism": {"tensor_parallel_degree": tp, **given}})
    assert (t.parallel["tp"], t.parallel["sequence_parallel"]) == (tp, sp)


@pytest.mark.parametrize(
    ("key", "pp", "verdict"),
    [(k, pp, "no effect" if pp == 1 else "differs")
     for k in ("pipeline_parallel_first_stage_less_layers",
               "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
               "module_fqns_per_model_part")
     for pp in (1, 2)],
)  # fmt: skip
def test_torchtitan_every_stage_split_key(key: str, pp: int, verdict: str) -> None:
    t = translate_torchtitan({"parallelism": {"pipeline_parallel_degree": pp, key: 1}})
    assert _row(t, f"parallelism.{key}").verdict == verdict


# ---------------------------------------------------------------------------- suffixes and kinds


@pytest.mark.parametrize(
    ("suffix", "reader"),
    [(".json", "DeepSpeed"), (".yaml", "Accelerate"), (".yml", "Accelerate"),
     (".toml", "torchtitan"), (".JSON", "DeepSpeed"), (".YML", "Accelerate")],
)  # fmt: skip
def test_every_suffix_picks_its_reader(suffix: str, reader: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shardwise.config.foreign import read_foreign

    body = {"DeepSpeed": '{"gradient_clipping": 1.0}', "Accelerate": "distributed_type: NO\n",
            "torchtitan": "[training]\nsteps = 1\n"}[reader]  # fmt: skip
    path = tmp_path / f"config{suffix}"
    path.write_text(body)
    assert read_foreign(path).source == reader


@pytest.mark.parametrize(
    ("tool", "suffix", "taken"),
    [("DeepSpeed", ".json", True), ("DeepSpeed", ".yaml", False), ("DeepSpeed", ".toml", False),
     ("Accelerate", ".yaml", True), ("Accelerate", ".yml", True), ("Accelerate", ".json", True),
     ("Accelerate", ".toml", False), ("torchtitan", ".toml", True),
     ("torchtitan", ".json", False), ("torchtitan", ".yml", False),
     ("DeepSpeed", ".txt", True), ("torchtitan", ".cfg", True)],
)  # fmt: skip
def test_every_reader_takes_its_suffixes(tool: str, suffix: str, taken: bool) -> None:
    from pathlib import Path

    from shardwise.config.foreign_checks import check_suffix
    from shardwise.config.run_file import ConfigError

    if taken:
        check_suffix(Path(f"c{suffix}"), tool)  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigError, match=f"a {suffix} file is"):
        check_suffix(Path(f"c{suffix}"), tool)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flag", "suffix", "refused"),
    [("--deepspeed", ".json", False), ("--deepspeed", ".yaml", True),
     ("--deepspeed", ".toml", True), ("--accelerate-config", ".yaml", False),
     ("--accelerate-config", ".yml", False), ("--accelerate-config", ".json", True),
     ("--accelerate-config", ".toml", True), ("--from", ".json", False),
     ("--from", ".toml", False), ("--deepspeed", ".txt", False)],
)  # fmt: skip
def test_every_flag_and_suffix(flag: str, suffix: str, refused: bool) -> None:
    from shardwise.config.foreign import check_flag

    if not refused:
        check_flag(flag, f"c{suffix}")
        return
    with pytest.raises(ValueError, match=f"{flag} c{suffix}: a {suffix} file is read as"):
        check_flag(flag, f"c{suffix}")


_SIGNS = {
    "a transformers model config": ("model_type", "architectures"),
    "a shardwise run file": ("parallel", "train", "runner", "adapter"),
    "DeepSpeed": ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
                  "gradient_accumulation_steps", "gradient_clipping", "fp16", "bf16"),
    "Accelerate": ("distributed_type", "compute_environment", "fsdp_config", "num_processes"),
    "torchtitan": ("parallelism", "training", "job", "activation_checkpoint"),
}  # fmt: skip
_NAMED = {"DeepSpeed": "a DeepSpeed config", "Accelerate": "an Accelerate config",
          "torchtitan": "a torchtitan config"}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "sign", "tool"),
    [(kind, sign, tool) for kind, signs in _SIGNS.items() for sign in signs
     for tool in ("DeepSpeed", "Accelerate", "torchtitan") if tool != kind],
)  # fmt: skip
def test_every_telling_key_names_its_kind(kind: str, sign: str, tool: str) -> None:
    from shardwise.config.foreign_checks import check_kind
    from shardwise.config.run_file import ConfigError

    name = _NAMED.get(kind, kind)
    with pytest.raises(ConfigError, match=f"^the file is {name} \\(it has {sign}\\), not "):
        check_kind({sign: 1}, tool, "the file")  # type: ignore[arg-type]
    check_kind({sign: 1, **dict.fromkeys(_SIGNS[tool][:1], 1)}, tool, "the file")  # type: ignore[arg-type]
