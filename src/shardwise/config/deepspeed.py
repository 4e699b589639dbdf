"""A DeepSpeed configuration (the JSON a transformers or DeepSpeed user brings), read as it
is: every key becomes what it means in shardwise, or is refused with the reason.

Owns: `translate_deepspeed`, which reads a DeepSpeed config (a path to its JSON, or the
dict) into a `Translation`: the shardwise `Config` it implies (parallel layout,
accumulation, clipping, micro-batch, optimizer) and, for a `scheduler` block, a torch
scheduler computing DeepSpeed's own schedule (`Translation.build_scheduler`), with one
`Row` per key read: the key, its value, what it became, and whether that is exact,
differs in a stated way, has no effect under FSDP2 (a tuning knob FSDP2 handles its own
way), or is refused. `Translation.config` raises a ConfigError naming every refused key.

"auto" values resolve as the transformers Trainer resolves them when no TrainingArguments
say otherwise (micro-batch 8, accumulation 1, clipping 1.0, no fp16/bf16, lr 5e-5, betas
(0.9, 0.999), eps 1e-8, weight decay 0, no warm-up); an "auto" only a running Trainer can
resolve (a schedule's total steps) is refused, naming the key.

Must not: import deepspeed or transformers, or read the environment (the world size, when
a check needs it, is an argument).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from shardwise.config.deepspeed_schedules import SCHEDULE_PARAMS, deepspeed_lr
from shardwise.config.foreign_checks import check_kind, check_suffix, unknown_key
from shardwise.config.run_file import ConfigError
from shardwise.config.translation import Row, Translation, Verdict

__all__ = ["translate_deepspeed"]

# transformers.TrainingArguments' defaults: what the Trainer fills an "auto" with.
_AUTO = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "lr": 5e-5,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "warmup_min_lr": 0.0,
    "warmup_num_steps": 0,
}

_NO_EFFECT_ZERO = {
    "overlap_comm": "FSDP2 overlaps communication with compute by its own prefetching",
    "contiguous_gradients": "FSDP2 reduces each unit's gradients from one flat buffer",
    "reduce_bucket_size": "FSDP2 reduces one shard unit at a time, not by buckets",
    "allgather_bucket_size": "FSDP2 gathers one shard unit at a time, not by buckets",
    "allgather_partitions": "FSDP2 always all-gathers a unit's shards",
    "reduce_scatter": "FSDP2 always reduce-scatters gradients",
    "round_robin_gradients": "a ZeRO-2 CPU-offload ordering FSDP2 has no use for",
    "stage3_prefetch_bucket_size": "FSDP2 prefetches whole units (backward_prefetch)",
    "stage3_param_persistence_threshold": "FSDP2 shards every parameter of a unit",
    "stage3_max_live_parameters": "FSDP2 bounds gathered units itself",
    "stage3_max_reuse_distance": "FSDP2 bounds gathered units itself",
    "sub_group_size": "the optimizer steps the local shards as they are",
    "memory_efficient_linear": "a DeepSpeed kernel choice; torch's linear runs as it is",
    "stage3_gather_16bit_weights_on_model_save": (
        "shardwise.export_weights writes whole weights from any checkpoint"
    ),
    "stage3_gather_fp16_weights_on_model_save": (
        "shardwise.export_weights writes whole weights from any checkpoint"
    ),
    "elastic_checkpoint": "shardwise's checkpoints load at any world size",
    "load_from_fp32_weights": "shardwise keeps fp32 parameters and loads them",
    "ignore_unused_parameters": "FSDP2 reduces whatever gradients exist",
    "use_multi_rank_bucket_allreduce": "FSDP2 reduces one shard unit at a time",
}
_REFUSED_ZERO = {
    "zero_quantized_weights": "ZeRO++ quantized weights are not built in shardwise",
    "zero_quantized_gradients": "ZeRO++ quantized gradients are not built in shardwise",
    "zero_quantized_nontrainable_weights": "ZeRO++ quantized weights are not built",
    "zero_hpz_partition_size": (
        "ZeRO++'s secondary partition is not built (strategy='hybrid_shard' shards inside "
        "a node and replicates across nodes, the nearest layout)"
    ),
    "mics_shard_size": (
        "MiCS is not built (strategy='hybrid_shard' with dp_shard=N shards over groups of "
        "N ranks and replicates across them, the nearest layout)"
    ),
    "mics_hierarchical_params_gather": "MiCS is not built",
}
_NO_EFFECT_TOP = {
    "steps_per_print": "shardwise logs every runner.log_every steps",
    "wall_clock_breakdown": "a DeepSpeed timer report",
    "dump_state": "a DeepSpeed debug print",
    "tensorboard": "shardwise logs to TensorBoard with runner.tensorboard",
    "wandb": "a DeepSpeed monitor; log from your script",
    "csv_monitor": "a DeepSpeed monitor; log from your script",
    "comet": "a DeepSpeed monitor; log from your script",
    "flops_profiler": "a DeepSpeed profiler (bench/mfu.py measures MFU)",
    "comms_logger": "a DeepSpeed communication log",
    "zero_allow_untested_optimizer": "any torch optimizer runs on FSDP2's shards",
    "zero_force_ds_cpu_optimizer": "the optimizer is torch's, on CPU shards when offloaded",
    "prescale_gradients": "FSDP2 averages gradients itself (the same mean)",
    "gradient_predivide_factor": "FSDP2 averages gradients itself (the same mean)",
    "memory_breakdown": "a DeepSpeed memory print (shardwise plan --simulate shows it)",
}
_REFUSED_TOP = {
    "amp": "apex AMP is not supported; use bf16 (mixed_precision='bf16') or fp16",
    "pipeline": "DeepSpeed's pipeline engine: use ParallelConfig.pp",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not in torch",
    "compression_training": "DeepSpeed's compression is not built",
    "activation_checkpointing": (
        "DeepSpeed's activation checkpointing is driven by the model's own calls to "
        "deepspeed.checkpointing; use ParallelConfig.activation_checkpointing"
    ),
    "aio": "NVMe offload is not built",
    "data_efficiency": "DeepSpeed's data sampling is not built",
    "curriculum_learning": "DeepSpeed's data sampling is not built",
    "elasticity": "DeepSpeed elasticity is not built",
    "autotuning": "DeepSpeed's autotuner is not built",
    "sequence_parallel_size": "Ulysses sequence parallel is not built (cp is not yet)",
    "tensor_parallel": "DeepSpeed AutoTP: use ParallelConfig.tp",
    "moe": "DeepSpeed MoE layers: use ParallelConfig.ep on a transformers MoE",
}


def translate_deepspeed(
    source: str | Path | Mapping[str, object], *, world: int | None = None
) -> Translation:
    """Read a DeepSpeed config (see the module docstring). `world` (the number of ranks)
    lets train_batch_size be checked against micro-batch x accumulation x ranks."""
    data = _load(source)
    check_kind(
        data, "DeepSpeed", "the config given" if isinstance(source, Mapping) else str(source)
    )
    out = Translation(source="DeepSpeed", rows=[])
    known = [*_TOP, *_NO_EFFECT_TOP, *_REFUSED_TOP]
    for key, value in data.items():
        handler = _TOP.get(key)
        if handler is not None:
            handler(out, key, value)
        else:
            out.rows.append(_listed(key, value, _NO_EFFECT_TOP, _REFUSED_TOP, "a DeepSpeed", known))
    _batch(out, data, world)
    return out


def _listed(
    key: str,
    value: object,
    no_effect: dict[str, str],
    refused: dict[str, str],
    what: str,
    known: list[str],
) -> Row:
    """The row of a key a handler does not read: listed as no effect or refused, with the
    reason, or refused as unknown, naming the closest of the `known` keys of its level."""
    name = key.rsplit(".", 1)[-1]
    if name in no_effect:
        return Row(key, value, "-", "no effect", no_effect[name])
    if name in refused:
        return Row(key, value, "-", "refused", refused[name])
    return Row(key, value, "-", "refused", unknown_key(name, known, what))


def _load(source: str | Path | Mapping[str, object]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    check_suffix(path, "DeepSpeed")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the DeepSpeed config {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object, got {type(data).__name__}")
    return data


def _auto(value: object, default: Any) -> tuple[Any, str]:
    """The value, or the Trainer's default for "auto" (and a note saying so)."""
    if value == "auto":
        return default, f"'auto': the transformers Trainer's default, {default}"
    return value, ""


# --------------------------------------------------------------------------- top level


def _micro_batch(out: Translation, key: str, value: object) -> None:
    size, note = _auto(value, _AUTO[key])
    out.runner["batch_size"] = size
    out.rows.append(Row(key, value, f"runner.batch_size={size}", "exact", note))


def _accumulation(out: Translation, key: str, value: object) -> None:
    steps, note = _auto(value, _AUTO[key])
    out.train["accumulate_steps"] = steps
    out.rows.append(Row(key, value, f"train.accumulate_steps={steps}", "exact", note))


def _clipping(out: Translation, key: str, value: object) -> None:
    norm, note = _auto(value, _AUTO[key])
    norm = None if not norm else float(norm)  # DeepSpeed: 0 turns clipping off
    out.train["max_grad_norm"] = norm
    out.rows.append(Row(key, value, f"train.max_grad_norm={norm}", "exact", note))


def _train_batch(out: Translation, key: str, value: object) -> None:
    pass  # checked with the other batch keys in _batch, once all are read


def _batch(out: Translation, data: Mapping[str, Any], world: int | None) -> None:
    """train_batch_size = micro-batch x accumulation x data-parallel ranks, as DeepSpeed
    checks it; DeepSpeed derives whichever of the two others is missing."""
    if "train_batch_size" not in data:
        return
    total = data["train_batch_size"]
    micro = "train_micro_batch_size_per_gpu" in data
    accum = "gradient_accumulation_steps" in data
    key = "train_batch_size"
    if total == "auto":
        note = "micro-batch x accumulation x data-parallel ranks, as DeepSpeed derives it"
        out.rows.append(Row(key, total, "implied", "exact", note))
        return
    if world is None:
        if micro and accum:
            note = "must equal micro-batch x accumulation x the data-parallel ranks"
            out.rows.append(Row(key, total, "checked at launch", "exact", note))
        else:
            note = "DeepSpeed derives the rest from it and the world size: give world="
            out.rows.append(Row(key, total, "-", "refused", note))
        return
    size = out.runner.get("batch_size")
    steps = out.train.get("accumulate_steps", 1)
    if not micro or size is None:  # DeepSpeed: micro = total / (accumulation x ranks)
        size = total // (steps * world) if total % (steps * world) == 0 else None
        out.runner["batch_size"] = size
    elif not accum:  # accumulation = total / (micro x ranks)
        steps = total // (size * world) if total % (size * world) == 0 else None
        out.train["accumulate_steps"] = steps
    ok = size is not None and steps is not None and total == size * steps * world
    how = f"{size} x {steps} x {world} ranks"
    if ok:
        out.rows.append(
            Row(
                key,
                total,
                f"runner.batch_size={size}, train.accumulate_steps={steps}",
                "exact",
                f"{how} = {total}",
            )
        )
    else:
        out.rows.append(
            Row(
                key,
                total,
                "-",
                "refused",
                f"not micro-batch x accumulation x {world} ranks ({how}): DeepSpeed would "
                "refuse this too",
            )
        )


_SCALER = ("loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale")
_NO_EFFECT_PRECISION = ("auto_cast", "immediate_grad_update", "check_grad_overflow")
_PRECISION_KEYS = ("enabled", "loss_scale", "initial_scale_power", *_SCALER, *_NO_EFFECT_PRECISION)


def _unknown_precision(key: str, sub: str) -> str:
    block = key.split(".")[0]
    return unknown_key(sub, _PRECISION_KEYS, f"{'an' if block == 'fp16' else 'a'} {block}")


def _precision(out: Translation, key: str, value: object) -> None:
    block = value if isinstance(value, Mapping) else {"enabled": value}
    enabled, note = _auto(block.get("enabled", False), False)
    if not enabled:
        out.rows.append(Row(f"{key}.enabled", block.get("enabled"), "fp32", "exact", note))
        for sub, sub_value in block.items():
            name = f"{key}.{sub}"
            if sub == "enabled":
                continue
            if sub in _PRECISION_KEYS:
                out.rows.append(Row(name, sub_value, "-", "no effect", f"{key} is off"))
            else:  # a misspelt "enabled" leaves the block off: say so, never pass it by
                out.rows.append(Row(name, sub_value, "-", "refused", _unknown_precision(name, sub)))
        return
    preset = "fp16" if key == "fp16" else "bf16"
    if out.parallel.get("mixed_precision", preset) != preset:
        out.rows.append(Row(key, value, "-", "refused", "bf16 and fp16 both enabled"))
        return
    out.parallel["mixed_precision"] = preset
    out.rows.append(
        Row(
            f"{key}.enabled",
            True,
            f"parallel.mixed_precision='{preset}'",
            "differs",
            f"compute in {preset} from fp32 parameters, as DeepSpeed; shardwise reduces "
            "gradients in fp32 where DeepSpeed reduces in the compute dtype unless "
            "communication_data_type says fp32 (more exact, twice the bytes)",
        )
    )
    for sub, sub_value in block.items():
        if sub != "enabled":
            _loss_scale(out, f"{key}.{sub}", sub, sub_value)


def _loss_scale(out: Translation, key: str, sub: str, value: object) -> None:
    if sub == "loss_scale":
        if value not in (0, 0.0):
            out.rows.append(
                Row(
                    key,
                    value,
                    "-",
                    "refused",
                    "a static loss scale: shardwise's scaler is dynamic (0)",
                )
            )
            return
        out.train["grad_scaler"] = True
        out.rows.append(Row(key, value, "train.grad_scaler=True", "exact", "dynamic"))
    elif sub == "initial_scale_power":
        out.train["init_scale"] = 2.0 ** int(value)  # type: ignore[call-overload]
        out.rows.append(Row(key, value, f"train.init_scale=2**{value}", "exact"))
    elif sub in _SCALER:
        out.rows.append(
            Row(
                key,
                value,
                "-",
                "differs",
                "torch's GradScaler grows the scale every 2000 clean steps and "
                "halves it on each overflow, with no floor or hysteresis",
            )
        )
    elif sub in _NO_EFFECT_PRECISION:
        out.rows.append(Row(key, value, "-", "no effect", "FSDP2's mixed precision casts"))
    else:
        out.rows.append(Row(key, value, "-", "refused", _unknown_precision(key, sub)))


def _comm_dtype(out: Translation, key: str, value: object) -> None:
    if value in ("fp32", "float32"):
        out.rows.append(
            Row(
                key,
                value,
                "gradients reduced in fp32",
                "exact",
                "shardwise's bf16/fp16 presets reduce in fp32",
            )
        )
    else:
        out.rows.append(
            Row(
                key,
                value,
                "-",
                "refused",
                "shardwise reduces gradients in fp32 under its presets; give "
                "parallel.mixed_precision a reduce_dtype to change it",
            )
        )


# --------------------------------------------------------------------------- zero


def _zero(out: Translation, key: str, value: object) -> None:
    if not isinstance(value, Mapping):
        out.rows.append(Row(key, value, "-", "refused", "zero_optimization is an object"))
        return
    stage = value.get("stage", 0)
    strategy, verdict, note = cast(
        tuple[str | None, Verdict, str],
        {
            0: ("ddp", "exact", "no sharding: DistributedDataParallel"),
            1: (
                "shard_grad_op",
                "differs",
                "ZeRO-1 shards optimizer state only; FSDP2 has no such layout, and the nearest, "
                "ZeRO-2, also shards gradients: less memory, the same training",
            ),
            2: ("shard_grad_op", "exact", "ZeRO-2: optimizer state and gradients sharded"),
            3: ("full_shard", "exact", "ZeRO-3: parameters sharded too"),
        }.get(stage, (None, "refused", "stage must be 0, 1, 2 or 3")),
    )
    if strategy is None:
        out.rows.append(Row(f"{key}.stage", stage, "-", "refused", note))
        return
    out.parallel["strategy"] = strategy
    out.rows.append(Row(f"{key}.stage", stage, f"parallel.strategy='{strategy}'", verdict, note))
    for sub, sub_value in value.items():
        name = f"{key}.{sub}"
        if sub == "stage":
            continue
        if sub in ("offload_optimizer", "offload_param"):
            _offload(out, name, sub, sub_value, stage)
        else:
            known = [
                "stage",
                "offload_optimizer",
                "offload_param",
                *_NO_EFFECT_ZERO,
                *_REFUSED_ZERO,
            ]
            out.rows.append(
                _listed(name, sub_value, _NO_EFFECT_ZERO, _REFUSED_ZERO, "a ZeRO", known)
            )


def _offload(out: Translation, key: str, sub: str, value: object, stage: int) -> None:
    device = value.get("device", "none") if isinstance(value, Mapping) else value
    if device in (None, "none"):
        out.rows.append(Row(key, value, "-", "exact", "no offload"))
        return
    if device != "cpu":
        out.rows.append(Row(key, value, "-", "refused", f"offload to {device!r} is not built"))
        return
    if stage == 0:
        out.rows.append(Row(key, value, "-", "refused", "offload needs ZeRO stage 1 or more"))
        return
    if sub == "offload_param" and stage != 3:  # DeepSpeed reads it at stage 3 only
        why = "DeepSpeed offloads parameters at ZeRO stage 3 only; below it the key is not read"
        out.rows.append(Row(key, value, "-", "no effect", why))
        return
    out.parallel["cpu_offload"] = True
    note = (
        "parameters, gradients and optimizer state on CPU; the optimizer steps there"
        if sub == "offload_param"
        else "FSDP2 offloads the parameters and gradients with the optimizer state (less "
        "GPU memory than DeepSpeed's optimizer-only offload); the step runs on CPU either way"
    )
    verdict: Verdict = "exact" if sub == "offload_param" else "differs"
    out.rows.append(Row(key, value, "parallel.cpu_offload=True", verdict, note))


# --------------------------------------------------------------------------- optimizer


_TORCH_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd"}
_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "momentum")


def _block_keys(out: Translation, key: str, block: Mapping[str, Any]) -> None:
    """Rows for the keys of an optimizer or scheduler block besides its type and params."""
    for sub, value in block.items():
        if sub not in ("type", "params"):
            why = unknown_key(
                sub, ("type", "params"), f"{'an' if key == 'optimizer' else 'a'} {key}"
            )
            out.rows.append(Row(f"{key}.{sub}", value, "-", "refused", why))


_DEEPSPEED_ONLY = ("onebitadam", "onebitlamb", "zerooneadam", "lamb", "lion", "muadam")


def _optimizer(out: Translation, key: str, value: object) -> None:
    block = value if isinstance(value, Mapping) else {}
    kind = str(block.get("type", "")).lower().replace("_", "")
    params = dict(block.get("params", {}))
    if kind not in _TORCH_OPTIMIZERS:
        why = (
            "a DeepSpeed-only optimizer; torch has none that computes the same update"
            if kind in _DEEPSPEED_ONLY
            else "not a torch optimizer shardwise builds (Adam, AdamW, SGD)"
        )
        out.rows.append(Row(f"{key}.type", block.get("type"), "-", "refused", why))
        return
    name = _TORCH_OPTIMIZERS[kind]
    note = ""
    if kind == "adam":
        # DeepSpeed's Adam decays weights decoupled unless adam_w_mode is false.
        name = "adamw" if params.get("adam_w_mode", True) else "adam"
        note = "DeepSpeed's Adam is AdamW unless adam_w_mode is false" if name == "adamw" else ""
    out.optimizer["name"] = name
    out.rows.append(
        Row(f"{key}.type", block.get("type"), f"optimizer.name='{name}'", "exact", note)
    )
    _block_keys(out, key, block)
    for param, raw in params.items():
        where = f"{key}.params.{param}"
        if kind == "adam" and param == "adam_w_mode":
            out.rows.append(Row(where, raw, f"optimizer.name='{name}'", "exact", "with type Adam"))
            continue
        if kind == "adam" and param == "torch_adam":
            why = "a kernel choice: torch's Adam computes the same step"
            out.rows.append(Row(where, raw, "-", "no effect", why))
            continue
        if param not in _OPTIMIZER_PARAMS:
            known = [*_OPTIMIZER_PARAMS, *(("adam_w_mode", "torch_adam") if kind == "adam" else ())]
            why = unknown_key(param, known, "an optimizer", noun="parameter")
            out.rows.append(Row(where, raw, "-", "refused", why))
            continue
        got, why = _auto(raw, _AUTO.get(param))
        got = tuple(got) if param == "betas" else got
        out.optimizer[param] = got
        out.rows.append(Row(where, raw, f"optimizer.{param}={got}", "exact", why))


# --------------------------------------------------------------------------- scheduler


def _scheduler(out: Translation, key: str, value: object) -> None:
    block = value if isinstance(value, Mapping) else {}
    kind = block.get("type")
    params = dict(block.get("params", {}))
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        out.rows.append(
            Row(
                f"{key}.type",
                kind,
                "-",
                "refused",
                "not built; WarmupLR, WarmupDecayLR and WarmupCosineLR are",
            )
        )
        return
    _block_keys(out, key, block)
    got: dict[str, Any] = {}
    for param, raw in params.items():
        where = f"{key}.params.{param}"
        if param not in SCHEDULE_PARAMS:
            why = unknown_key(param, SCHEDULE_PARAMS, f"a {kind}", noun="parameter")
            out.rows.append(Row(where, raw, "-", "refused", why))
            continue
        if raw == "auto" and param == "total_num_steps":
            why = "the Trainer's step count, which only a running Trainer knows; give the number"
            out.rows.append(Row(where, raw, "-", "refused", why))
            continue
        if raw == "auto" and param == "warmup_max_lr":  # the Trainer's lr: the optimizer's
            got[param] = None
            out.rows.append(
                Row(where, raw, "the optimizer's lr", "exact", "'auto': the Trainer's lr")
            )
            continue
        got[param], why = _auto(raw, _AUTO.get(param))
        out.rows.append(Row(where, raw, f"{kind}'s {param}={got[param]}", "exact", why))
    if any(r.verdict == "refused" and r.key.startswith(f"{key}.") for r in out.rows):
        return
    try:
        out.schedule = deepspeed_lr(kind, got)
    except KeyError as exc:
        out.rows.append(Row(f"{key}.params", params, "-", "refused", f"{kind} needs {exc}"))
        return
    except (TypeError, ValueError) as exc:
        out.rows.append(Row(f"{key}.params", params, "-", "refused", str(exc)))
        return
    out.rows.append(
        Row(
            f"{key}.type",
            kind,
            "Translation.build_scheduler(optimizer)",
            "exact",
            "a torch LambdaLR computing DeepSpeed's lr at every step",
        )
    )


_TOP: dict[str, Callable[[Translation, str, Any], None]] = {
    "train_micro_batch_size_per_gpu": _micro_batch,
    "gradient_accumulation_steps": _accumulation,
    "gradient_clipping": _clipping,
    "train_batch_size": _train_batch,
    "bf16": _precision,
    "bfloat16": _precision,
    "fp16": _precision,
    "communication_data_type": _comm_dtype,
    "zero_optimization": _zero,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
}
