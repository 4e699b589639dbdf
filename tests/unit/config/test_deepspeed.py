"""DeepSpeed configs as users bring them: each translates to the documented layout, or is
refused naming the key and the reason.

The configs below follow the shapes published with transformers' DeepSpeed integration
(the ZeRO-2 and ZeRO-3 templates full of "auto"), DeepSpeed's own tutorials (ZeRO-1 with
fp16, ZeRO-Offload, ZeRO-Infinity, ZeRO++, MiCS, 1-bit Adam, Lamb for BERT) and the
schedulers' documented parameters; the values are this file's own.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from _refusals import assert_refused, unnamed_keys

from shardwise.cli.main import main
from shardwise.config.deepspeed import translate_deepspeed
from shardwise.config.run_file import ConfigError

HF_ZERO3 = {  # transformers' ZeRO-3 template
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}  # fmt: skip
HF_ZERO2 = {  # transformers' ZeRO-2 template
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True,
                          "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}  # fmt: skip
ZERO3_BF16 = {  # ZeRO-3 in bf16, numbers given
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "overlap_comm": True},
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
    "train_batch_size": 64, "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                              "eps": 1e-8, "weight_decay": 0.1}},
}  # fmt: skip
ZERO1_FP16 = {  # Megatron-style ZeRO-1 with fp16 and dynamic loss scaling
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
    "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "weight_decay": 0.01}},
}  # fmt: skip
ZERO_OFFLOAD = {  # ZeRO-Offload: ZeRO-2 with the optimizer on CPU
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                          "contiguous_gradients": True, "overlap_comm": True},
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
}  # fmt: skip
ZERO_INFINITY = {  # ZeRO-Infinity: parameters to NVMe
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                        "nvme_path": "/local_nvme"}},
    "aio": {"block_size": 1048576},
}  # fmt: skip
ZERO_PP = {  # ZeRO++: quantized weights and gradients, hierarchical partition
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                          "zero_hpz_partition_size": 8, "zero_quantized_gradients": True},
}  # fmt: skip
MICS = {"zero_optimization": {"stage": 3, "mics_shard_size": 8}}
ONEBIT = {  # 1-bit Adam (communication-compressed)
    "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000}},
    "fp16": {"enabled": True},
}  # fmt: skip
BERT_LAMB = {
    "optimizer": {"type": "Lamb", "params": {"lr": 11e-3}},
    "zero_optimization": {"stage": 1},
}
DECAY = {  # a fixed schedule, warm-up then linear decay
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                  "warmup_num_steps": 10, "total_num_steps": 20, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2},
}  # fmt: skip
COSINE = {
    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20,
                  "warmup_num_steps": 10, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0}},
}  # fmt: skip
STATIC_SCALE = {"fp16": {"enabled": True, "loss_scale": 128}, "zero_optimization": {"stage": 0}}
AUTO_STEPS = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}


def _layout(config):  # type: ignore[no-untyped-def]
    p, t = config.parallel, config.train
    return (p.strategy, bool(p.cpu_offload), str(p.precision), t.accumulate_steps,
            t.max_grad_norm, config.runner.batch_size, config.optimizer.name)  # fmt: skip


@pytest.mark.parametrize(
    ("data", "layout"),
    [
        (HF_ZERO3, ("full_shard", True, "fp32", 1, 1.0, 8, "adamw")),
        (HF_ZERO2, ("shard_grad_op", False, "fp32", 1, 1.0, 8, "adamw")),
        (ZERO3_BF16, ("full_shard", False, "param=bfloat16 reduce=float32 output=None", 8, 0.5,
                      4, "adamw")),
        (ZERO1_FP16, ("shard_grad_op", False, "param=float16 reduce=float32 output=None", 4,
                      None, 4, "adamw")),
        (ZERO_OFFLOAD, ("shard_grad_op", True, "fp32", 4, None, 2, "adamw")),
        (DECAY, ("shard_grad_op", False, "fp32", 1, None, 8, "adamw")),
        (COSINE, ("full_shard", False, "fp32", 1, None, 8, "sgd")),
    ],
    ids=["hf_zero3", "hf_zero2", "zero3_bf16", "zero1_fp16", "zero_offload", "decay", "cosine"],
)  # fmt: skip
def test_a_config_translates_to_its_documented_layout(data, layout) -> None:  # type: ignore[no-untyped-def]
    translation = translate_deepspeed(data, world=2)
    assert _layout(translation.config) == layout, translation.table()
    keys = {r.key.split(".")[0] for r in translation.rows}
    assert keys == set(data), "every key read is listed"


def test_each_row_says_how_faithful_it_is() -> None:
    rows = {r.key: r for r in translate_deepspeed(HF_ZERO3).rows}
    assert rows["zero_optimization.overlap_comm"].verdict == "no effect"
    assert rows["zero_optimization.offload_optimizer"].verdict == "differs"
    assert "optimizer state" in rows["zero_optimization.offload_optimizer"].note
    assert rows["optimizer.params.lr"].became == "optimizer.lr=5e-05"
    assert rows["fp16.loss_scale_window"].verdict == "no effect"  # fp16 is off ('auto')
    rows = {r.key: r for r in translate_deepspeed(ZERO1_FP16, world=8).rows}
    assert rows["zero_optimization.stage"].verdict == "differs"
    assert "ZeRO-1 shards optimizer state only" in rows["zero_optimization.stage"].note
    assert rows["optimizer.type"].became == "optimizer.name='adamw'"  # adam_w_mode
    assert "reduces in the compute dtype" in rows["fp16.enabled"].note
    assert rows["fp16.initial_scale_power"].became == "train.init_scale=2**12"
    assert rows["train_batch_size"].became == "runner.batch_size=4, train.accumulate_steps=1"
    config = translate_deepspeed(ZERO1_FP16, world=8).config
    assert (config.train.grad_scaler, config.train.init_scale, config.optimizer.lr) == (
        True, 2.0**12, 1.5e-4)  # fmt: skip
    alone = translate_deepspeed({"train_batch_size": 32}, world=2).config  # DeepSpeed: 16 x 1
    assert (alone.runner.batch_size, alone.train.accumulate_steps) == (16, 1)
    no_decoupling = {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    assert translate_deepspeed(no_decoupling).config.optimizer.name == "adam"


@pytest.mark.parametrize(
    ("data", "refused"),
    [
        (ZERO_INFINITY, {"zero_optimization.offload_param": "offload to 'nvme' is not built",
                         "aio": "NVMe offload is not built"}),
        (ZERO_PP, {"zero_optimization.zero_quantized_weights": "ZeRO++ quantized weights",
                   "zero_optimization.zero_hpz_partition_size": "strategy='hybrid_shard'",
                   "zero_optimization.zero_quantized_gradients": "ZeRO++ quantized gradients"}),
        (MICS, {"zero_optimization.mics_shard_size": "MiCS is not built"}),
        (ONEBIT, {"optimizer.type": "a DeepSpeed-only optimizer"}),
        (BERT_LAMB, {"optimizer.type": "a DeepSpeed-only optimizer"}),
        (STATIC_SCALE, {"fp16.loss_scale": "a static loss scale"}),
        (AUTO_STEPS, {"scheduler.params.total_num_steps": "only a running Trainer knows"}),
        ({"zero_optimisation": {"stage": 2}}, {"zero_optimisation": "not a DeepSpeed key"}),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
         {"train_batch_size": "(4 x None x 2 ranks): DeepSpeed would refuse this too"}),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2},
         {"train_batch_size": "(4 x 2 x 2 ranks): DeepSpeed would refuse this too"}),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, {"scheduler.type": "not built"}),
    ],
    ids=["zero_infinity", "zero_pp", "mics", "onebit_adam", "lamb", "static_scale",
         "auto_total_steps", "typo", "batch_mismatch", "batch_mismatch_given", "one_cycle"],
)  # fmt: skip
def test_what_cannot_mean_the_same_is_refused_by_key(data, refused) -> None:  # type: ignore[no-untyped-def]
    assert_refused(translate_deepspeed(data, world=2), refused)


def _lrs(data, steps):  # type: ignore[no-untyped-def]
    translation = translate_deepspeed(data)
    config = translation.config
    optimizer = config.optimizer.build([torch.nn.Parameter(torch.zeros(1))])
    scheduler = translation.build_scheduler(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_schedulers_give_each_step_deepspeeds_lr() -> None:
    # DeepSpeed steps its scheduler after each optimizer step: step s runs at the lr of
    # iteration s - 1 (the constructor's for step 0). WarmupDecayLR, linear, 10 warm-up
    # steps of 20: min, then min + i/10, then linear decay to 0 at iteration 20.
    lrs = _lrs(DECAY, 22)
    expected = [0.0, 0.0] + [1e-3 * i / 10 for i in range(1, 10)]
    expected += [1e-3 * (20 - i) / 10 for i in range(10, 21)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    # WarmupCosineLR: 0 at step 0 (DeepSpeed's constructor sets 0), the ratio after.
    lrs = _lrs(COSINE, 21)
    # warmup_type defaults to 'log': ratio log(i + 1) / log(10) at iteration i
    assert lrs[0] == 0.0 and lrs[1] == 0.0
    assert lrs[6] == pytest.approx(0.1 * math.log(6) / math.log(10))
    assert lrs[11] == pytest.approx(0.1 * (1 + math.cos(math.pi * 1 / 10)) / 2)
    assert lrs[20] == pytest.approx(0.0, abs=1e-12)
    # WarmupLR with 'auto' (the Trainer's): warm-up over DeepSpeed's minimum of 2
    # iterations, log-shaped, to the optimizer's lr.
    lrs = _lrs(HF_ZERO2 | {"scheduler": HF_ZERO3["scheduler"]}, 4)
    assert lrs == pytest.approx([0.0, 0.0, 5e-5, 5e-5])


def test_config_show_from_prints_the_table_then_the_config(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3_BF16))
    assert main(["config", "show", "--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "zero_optimization.stage" in out and "parallel.strategy='full_shard'" in out
    assert "strategy: full_shard" in out and "accumulate_steps: 8" in out
    path.write_text(json.dumps(ZERO_PP))
    assert main(["config", "show", "--from", str(path)]) == 2
    assert "zero_optimization.zero_quantized_weights" in capsys.readouterr().err
    path.write_text("{not json")
    assert main(["config", "show", "--from", str(path)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_a_launched_script_reads_the_file_at_its_world_size(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import shardwise

    monkeypatch.delenv("SHARDWISE_FROM", raising=False)
    assert shardwise.translation_from_env() is None
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("SHARDWISE_FROM", str(path))
    monkeypatch.setenv("WORLD_SIZE", "4")  # DeepSpeed derives micro-batch 32 / 4 = 8
    launched = shardwise.translation_from_env()
    assert launched is not None and launched.source == "DeepSpeed"
    assert (launched.config.parallel.strategy, launched.config.runner.batch_size) == (
        "shard_grad_op", 8)  # fmt: skip


def test_the_engine_and_the_runner_take_a_launched_files_values(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import shardwise
    from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
                                "gradient_accumulation_steps": 2, "scheduler": DECAY["scheduler"]}))  # fmt: skip
    monkeypatch.setenv("SHARDWISE_FROM", str(path))
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    engine = shardwise.Engine(GPT(cfg), functools.partial(torch.optim.SGD, lr=0.1))
    assert (engine.train_config.accumulate_steps, engine.train_config.max_grad_norm) == (2, 0.5)
    assert engine.scheduler is not None  # DeepSpeed's WarmupDecayLR: step 0 at warmup_min_lr
    assert engine.optimizer.param_groups[0]["lr"] == 0.0
    x, y = random_lm_batches(cfg, 1, 8)[0]
    data = torch.utils.data.TensorDataset(x, y)
    runner = shardwise.Runner(engine, data)
    assert runner.config.batch_size == 4
    given = shardwise.Runner(engine, data, config=shardwise.RunnerConfig(batch_size=2))
    assert given.config.batch_size == 2  # a config given wins


def test_the_engine_builds_the_files_optimizer_when_the_script_passes_none(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # As deepspeed.initialize does with no client optimizer; a client optimizer wins.
    import shardwise
    from shardwise.testing.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    monkeypatch.delenv("SHARDWISE_FROM", raising=False)
    with pytest.raises(TypeError, match=r"Engine\(model\) needs an optimizer: pass one"):
        shardwise.Engine(GPT(cfg))
    path = tmp_path / "ds_config.json"
    block = {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1, "betas": [0.8, 0.9]}}
    path.write_text(json.dumps({"optimizer": block}))
    monkeypatch.setenv("SHARDWISE_FROM", str(path))
    built = shardwise.Engine(GPT(cfg)).optimizer
    assert isinstance(built, torch.optim.AdamW)
    group = built.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (2e-3, 0.1, (0.8, 0.9))
    with pytest.warns(UserWarning, match=r"the script's optimizer is used, not the optimizer "):
        given = shardwise.Engine(GPT(cfg), functools.partial(torch.optim.SGD, lr=0.1))
    assert isinstance(given.optimizer, torch.optim.SGD)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(TypeError, match=r"the DeepSpeed file the script was launched with has no"):
        shardwise.Engine(GPT(cfg))


def test_every_param_group_gets_deepspeeds_lr() -> None:
    # WarmupDecayLR sets absolute lrs: every group reaches warmup_max_lr whatever its own.
    translation = translate_deepspeed(DECAY)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (1e-3, 1e-2)]
    optimizer = torch.optim.AdamW(groups)
    scheduler = translation.build_scheduler(optimizer)
    for _ in range(11):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3, 1e-3])


def test_files_that_are_not_a_config_are_refused_with_what_they_are(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ds_config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"a DeepSpeed config is a JSON object, got list"):
        translate_deepspeed(path)
    with pytest.raises(ConfigError, match=r"cannot read the DeepSpeed config"):
        translate_deepspeed(tmp_path / "missing.json")
    argv = ["config", "show", "--from", str(path), "--config", str(path)]
    assert main(argv) == 2
    assert "config show --from FILE reads that file alone" in capsys.readouterr().err


@pytest.mark.parametrize(
    "given",
    [{}, {"train_micro_batch_size_per_gpu": 4}, {"gradient_accumulation_steps": 2}],
    ids=["total_alone", "with_micro", "with_accumulation"],
)
def test_without_a_world_size_a_total_batch_missing_a_factor_is_refused(given) -> None:  # type: ignore[no-untyped-def]
    """Issue 48: DeepSpeed derives a missing micro-batch or accumulation from the total and
    the world size; with no world size given neither can be derived, whichever is missing.
    Given both, the product is checked at launch."""
    rows = {r.key: r for r in translate_deepspeed({"train_batch_size": 64, **given}).rows}
    assert (rows["train_batch_size"].became, rows["train_batch_size"].verdict) == ("-", "refused")
    assert "give world=" in rows["train_batch_size"].note
    both = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2}  # fmt: skip
    row = {r.key: r for r in translate_deepspeed(both).rows}["train_batch_size"]
    assert (row.became, row.verdict) == ("checked at launch", "exact")


@pytest.mark.parametrize("key", ["bf16", "bfloat16", "fp16"])
def test_every_spelling_of_a_precision_block_means_its_dtype(key) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed reads "bfloat16" as "bf16" (third audit: read as fp16, a silent wrong)."""
    want = "fp16" if key == "fp16" else "bf16"
    translation = translate_deepspeed({"zero_optimization": {"stage": 3}, key: {"enabled": True}})
    assert (
        translation.config.parallel.precision
        == translate_deepspeed(
            {"zero_optimization": {"stage": 3}, want: {"enabled": True}}
        ).config.parallel.precision
    )
    rows = {r.key: r for r in translation.rows}
    assert rows[f"{key}.enabled"].became == f"parallel.mixed_precision='{want}'"


ALL_AUTO = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
}  # fmt: skip


def test_every_auto_takes_the_trainers_default() -> None:
    """Fourth audit: each "auto" is what transformers.TrainingArguments holds by default
    (per_device_train_batch_size 8, gradient_accumulation_steps 1, max_grad_norm 1.0,
    learning_rate 5e-5, adam_beta1/2 0.9/0.999, adam_epsilon 1e-8, weight_decay 0,
    warmup_steps 0), every one of them, not only the first."""
    translation = translate_deepspeed(ALL_AUTO)
    config = translation.config
    assert (config.runner.batch_size, config.train.accumulate_steps,
            config.train.max_grad_norm) == (8, 1, 1.0)  # fmt: skip
    optimizer = config.optimizer
    assert (optimizer.name, optimizer.lr, optimizer.betas, optimizer.eps,
            optimizer.weight_decay) == ("adamw", 5e-5, (0.9, 0.999), 1e-8, 0.0)  # fmt: skip
    rows = {r.key: r for r in translation.rows}
    became = {
        "train_micro_batch_size_per_gpu": ("runner.batch_size=8", "8"),
        "gradient_accumulation_steps": ("train.accumulate_steps=1", "1"),
        "gradient_clipping": ("train.max_grad_norm=1.0", "1.0"),
        "optimizer.params.lr": ("optimizer.lr=5e-05", "5e-05"),
        "optimizer.params.betas": ("optimizer.betas=(0.9, 0.999)", "(0.9, 0.999)"),
        "optimizer.params.eps": ("optimizer.eps=1e-08", "1e-08"),
        "optimizer.params.weight_decay": ("optimizer.weight_decay=0.0", "0.0"),
        "scheduler.params.warmup_min_lr": ("WarmupLR's warmup_min_lr=0.0", "0.0"),
        "scheduler.params.warmup_num_steps": ("WarmupLR's warmup_num_steps=0", "0"),
    }
    for key, (value, default) in became.items():
        note = f"'auto': the transformers Trainer's default, {default}"
        assert (rows[key].became, rows[key].verdict, rows[key].note) == (value, "exact", note)
    # the schedule: warm-up of 0 steps (DeepSpeed's minimum of 2) from 0 to the lr
    assert _lrs(ALL_AUTO, 4) == pytest.approx([0.0, 0.0, 5e-5, 5e-5])


@pytest.mark.parametrize(
    "block",
    [{"device": "none"}, {"device": "none", "pin_memory": True}, {}, {"device": None}, "none"],
    ids=["none", "none_pinned", "no_device", "null", "bare_none"],
)
@pytest.mark.parametrize("stage", [2, 3])
def test_an_offload_to_none_is_no_offload(block, stage) -> None:  # type: ignore[no-untyped-def]
    """Fourth audit: device "none" is how DeepSpeed's templates (and Accelerate's
    offload_*_device) say no offload; it is read as none, not refused as a target."""
    zero = {"stage": stage, "offload_optimizer": block, "offload_param": block}
    translation = translate_deepspeed({"zero_optimization": zero})
    assert translation.refused == []
    rows = {r.key: r for r in translation.rows}
    for sub in ("offload_optimizer", "offload_param"):
        row = rows[f"zero_optimization.{sub}"]
        assert (row.became, row.verdict, row.note) == ("-", "exact", "no offload")
    parallel = translation.config.parallel
    assert (parallel.strategy, parallel.cpu_offload) == (
        "shard_grad_op" if stage == 2 else "full_shard",
        False,
    )


# --------------------------------------------------------------------------- issue 50: a newcomer


def test_a_misspelt_key_names_the_closest_key_of_its_level() -> None:
    """Each level the reader walks compares a key it does not read with its own keys: the
    top, ZeRO, a precision block on and off (a misspelt 'enabled' leaves bf16 off, so it
    must be refused, not listed as having no effect), the optimizer and scheduler blocks
    and their params. A key near none of them gets no guess."""
    translation = translate_deepspeed({
        "zero_optimisation": {"stage": 3},
        "zero_optimization": {"stage": 2, "overlap_com": True},
        "bf16": {"enabeld": True},
        "fp16": {"enabled": True, "loss_scal": 0},
        "optimizer": {"type": "AdamW", "parms": {}, "params": {"weight_decy": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
        "xyzzy": 1,
    })  # fmt: skip
    assert {r.key: r.note for r in translation.refused} == {
        "zero_optimisation": "not a DeepSpeed key shardwise reads. Did you mean "
        "'zero_optimization'?",
        "zero_optimization.overlap_com": "not a ZeRO key shardwise reads. Did you mean "
        "'overlap_comm'?",
        "bf16.enabeld": "not a bf16 key shardwise reads. Did you mean 'enabled'?",
        "fp16.loss_scal": "not an fp16 key shardwise reads. Did you mean 'loss_scale'?",
        "optimizer.parms": "not an optimizer key shardwise reads. Did you mean 'params'?",
        "optimizer.params.weight_decy": "not an optimizer parameter shardwise reads. Did you "
        "mean 'weight_decay'?",
        "scheduler.params.warmup_num_step": "not a WarmupLR parameter shardwise reads. Did you "
        "mean 'warmup_num_steps'?",
        "xyzzy": "not a DeepSpeed key shardwise reads",
    }


def test_a_refusal_shows_the_key_and_the_reason_not_the_whole_block() -> None:
    block = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    with pytest.raises(ConfigError) as exc:
        translate_deepspeed({"zero_optimisation": block}).config  # noqa: B018
    assert str(exc.value) == (
        "this DeepSpeed config cannot mean the same in shardwise; refused:\n"
        "  zero_optimisation = {'stage': 3, 'overlap_comm': True, 'c...: not a DeepSpeed key "
        "shardwise reads. Did you mean 'zero_optimization'?"
    )
    with pytest.raises(ConfigError) as short:  # a value of 40 characters is shown whole
        translate_deepspeed({"zero_optimisation": {"stage": 3, "overlap_comm": 1234567890}}).config  # noqa: B018
    assert "= {'stage': 3, 'overlap_comm': 1234567890}: not" in str(short.value)


MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}


def test_a_file_of_another_kind_is_named_in_one_line(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODEL_CONFIG))
    assert main(["config", "show", "--from", str(path)]) == 2
    got = capsys.readouterr()
    assert got.out == ""  # no table of refusals
    assert got.err == (
        f"shardwise config: error: {path} is a transformers model config (it has model_type, "
        "architectures), not a DeepSpeed config: the script builds the model from it "
        "(from_pretrained); give shardwise the training config (a DeepSpeed .json, an "
        "Accelerate .yaml or a torchtitan .toml).\n"
    )
    run_file = {"parallel": {"strategy": "ddp"}, "runner": {"max_steps": 3}}
    with pytest.raises(ConfigError) as exc:
        translate_deepspeed(run_file)
    assert str(exc.value) == (
        "the config given is a shardwise run file (it has parallel, runner), not a DeepSpeed "
        "config: give it to the script as --config FILE (shardwise.load_config reads it)."
    )
    accelerate = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP"}
    with pytest.raises(ConfigError) as exc:
        translate_deepspeed(accelerate)
    assert str(exc.value) == (
        "the config given is an Accelerate config (it has distributed_type, "
        "compute_environment), not a DeepSpeed config: read it as Accelerate's (a .yaml "
        "file, --accelerate-config or --from)."
    )
    yaml = tmp_path / "default_config.yaml"  # the other tool's suffix, before its contents
    yaml.write_text("distributed_type: FSDP\n")
    with pytest.raises(ConfigError) as exc:
        translate_deepspeed(yaml)
    assert str(exc.value) == (
        f"{yaml}: a .yaml file is an Accelerate config to shardwise, not a DeepSpeed one "
        "(.json): read it with shardwise.translate_accelerate (shardwise run --from picks the "
        "reader by the suffix)."
    )


def test_a_deepspeed_file_with_a_stray_key_of_another_kind_is_read_as_deepspeeds() -> None:
    # Both halves of the condition: another kind's key *and* none of DeepSpeed's own.
    translation = translate_deepspeed({"zero_optimization": {"stage": 2}, "model_type": "x"})
    assert {r.key for r in translation.refused} == {"model_type"}
    assert translate_deepspeed({"optimizer": {"type": "SGD"}}).optimizer == {"name": "sgd"}


@pytest.mark.parametrize(
    ("flag", "name", "message"),
    [
        ("--deepspeed", "acc.yaml", "a .yaml file is read as an Accelerate config, and "
         "--deepspeed names a DeepSpeed one (.json). Pass it with --accelerate-config, or give "
         "the DeepSpeed config as .json."),
        ("--deepspeed", "job.toml", "a .toml file is read as a torchtitan config, and "
         "--deepspeed names a DeepSpeed one (.json). Pass it with --from, or give the DeepSpeed "
         "config as .json."),
        ("--accelerate-config", "ds.json", "a .json file is read as a DeepSpeed config, and "
         "--accelerate-config names an Accelerate one (.yaml or .yml). Pass it with "
         "--deepspeed, or give the Accelerate config as .yaml or .yml."),
    ],
)  # fmt: skip
def test_a_flag_and_a_suffix_that_disagree_stop_the_launch(
    tmp_path, capsys, flag, name, message
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text("{}")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('started')\n")
    assert main(["run", "--nproc", "1", flag, str(path), str(script)]) == 2
    assert capsys.readouterr().err == f"shardwise run: error: {flag} {path}: {message}\n"


def test_a_flag_that_agrees_with_the_suffix_passes_the_check() -> None:
    from shardwise.config.foreign import check_flag

    for flag, name in [("--deepspeed", "ds.json"), ("--accelerate-config", "a.yaml"),
                       ("--accelerate-config", "a.yml"), ("--from", "a.yaml"),
                       ("--from", "ds.json"), ("--from", "job.toml")]:  # fmt: skip
        check_flag(flag, name)  # no error


def test_parallel_config_from_env_without_its_reader_is_a_bug_not_a_default(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from shardwise.config import parallel

    monkeypatch.setattr(parallel, "LAUNCHED", [])
    with pytest.raises(
        RuntimeError, match=r"^ParallelConfig.from_env: no reader of the launched file$"
    ):
        parallel.ParallelConfig.from_env()


def test_parallel_config_from_env_is_the_launched_files_layout(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import shardwise

    monkeypatch.delenv("SHARDWISE_FROM", raising=False)
    assert shardwise.ParallelConfig.from_env() == shardwise.ParallelConfig()  # as wrap(model)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    monkeypatch.setenv("SHARDWISE_FROM", str(path))
    got = shardwise.ParallelConfig.from_env()
    assert (got.strategy, got.mixed_precision) == ("full_shard", "bf16")
    path.write_text(json.dumps({"zero_optimisation": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"zero_optimisation = \{'stage': 3\}: not a DeepSpeed"):
        shardwise.ParallelConfig.from_env()


@pytest.mark.parametrize(
    "data",
    [HF_ZERO3, HF_ZERO2, ZERO3_BF16, ZERO1_FP16, ZERO_OFFLOAD, DECAY, COSINE,
     {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False,
                                               "torch_adam": True}}},
     {"bf16": {"enabled": False, "immediate_grad_update": True}}],
    ids=["hf_zero3", "hf_zero2", "zero3_bf16", "zero1_fp16", "offload", "decay", "cosine",
         "adam_modes", "bf16_off"],
)  # fmt: skip
def test_every_key_read_is_named_in_the_table(data) -> None:  # type: ignore[no-untyped-def]
    translation = translate_deepspeed(data, world=2)
    assert unnamed_keys(translation, data) == [], translation.table()
