"""An Accelerate config (the YAML `accelerate config` writes), read as it is: every key
becomes what it means in shardwise, or is refused with the reason.

Owns: `translate_accelerate`, which reads the YAML (a path, or its dict) into a
`Translation` (config/translation.py): `distributed_type` FSDP with its `fsdp_config`
keys (FSDP1's and FSDP2's), MULTI_GPU/MULTI_CPU (DDP), NO (one process), and DEEPSPEED
(its `deepspeed_config`, inline keys or a `deepspeed_config_file`, read by
config/deepspeed.py); `mixed_precision`; `parallelism_config` (dp_replicate × dp_shard ×
tp); and the launch keys, which say where processes run and change no training value.

Must not: import accelerate, or read the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardwise.config.deepspeed import translate_deepspeed
from shardwise.config.foreign_checks import check_kind, check_suffix, unknown_key
from shardwise.config.names import normalize_strategy
from shardwise.config.run_file import ConfigError, read_yaml
from shardwise.config.translation import Row, Translation, Verdict

__all__ = ["translate_accelerate"]

_LAUNCH = {
    "compute_environment", "debug", "machine_rank", "main_process_ip", "main_process_port",
    "main_training_function", "rdzv_backend", "same_network", "gpu_ids", "num_machines",
    "num_processes", "enable_cpu_affinity", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "use_cpu", "downcast_bf16", "deepspeed_multinode_launcher", "ipex_config", "mpirun_config",
}  # fmt: skip
_STRATEGIES = {"1": "full_shard", "2": "shard_grad_op", "3": "no_shard", "4": "hybrid_shard",
               "5": "hybrid_shard_zero2"}  # fmt: skip
_PREFETCH = {"BACKWARD_PRE": "pre", "BACKWARD_POST": "post", "NO_PREFETCH": None}
_TRUE = ("y", "yes", "t", "true", "on", "1")  # accelerate.utils.environment.str_to_bool's
_FALSE = ("n", "no", "f", "false", "off", "0")
_TOP = ("distributed_type", "fsdp_config", "deepspeed_config", "mixed_precision",
        "parallelism_config", "dynamo_config")  # fmt: skip
_FSDP = ("fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward",
         "fsdp_offload_params", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
         "fsdp_min_num_params", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
         "fsdp_sync_module_states", "fsdp_activation_checkpointing", "fsdp_use_orig_params",
         "fsdp_cpu_ram_efficient_loading", "fsdp_state_dict_type")  # fmt: skip
_SIZES = ("dp_shard_size", "dp_replicate_size", "tp_size", "cp_size", "sp_size", "cp_backend",
          "cp_comm_strategy", "sp_backend")  # fmt: skip


def translate_accelerate(source: str | Path | Mapping[str, object]) -> Translation:
    """Read an Accelerate config (see the module docstring)."""
    data, base = _load(source)
    label = "the config given" if isinstance(source, Mapping) else str(source)
    check_kind(data, "Accelerate", label)
    out = Translation(source="Accelerate")
    kind = str(data.get("distributed_type", "NO"))
    for key, value in data.items():
        if key == "distributed_type":
            _distributed(out, kind)
        elif key == "fsdp_config":
            _fsdp(out, value, kind)
        elif key == "deepspeed_config":
            _deepspeed(out, value, kind, base, data)
        elif key == "mixed_precision":
            _precision(out, value, kind)
        elif key == "parallelism_config":
            _parallelism(out, value)
        elif key == "dynamo_config":
            _dynamo(out, value)
        elif key in _LAUNCH:
            out.rows.append(
                Row(key, value, "-", "no effect",
                    "a launch setting: give it to shardwise run / torchrun")
            )  # fmt: skip
        else:
            why = unknown_key(key, [*_TOP, *_LAUNCH], "an Accelerate")
            out.rows.append(Row(key, value, "-", "refused", why))
    if "distributed_type" not in data:
        _distributed(out, kind)
    return out


def _load(source: str | Path | Mapping[str, object]) -> tuple[dict[str, Any], Path | None]:
    if isinstance(source, Mapping):
        return dict(source), None
    path = Path(source)
    check_suffix(path, "Accelerate")
    try:
        data = read_yaml(path.read_text(), path)
    except OSError as exc:
        raise ConfigError(f"cannot read the Accelerate config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an Accelerate config is a YAML mapping")
    return data, path.parent


def _distributed(out: Translation, kind: str) -> None:
    if kind in ("MULTI_GPU", "MULTI_CPU", "NO"):
        out.parallel.setdefault("strategy", "ddp")
        note = "one process (shardwise does not wrap at world size 1)" if kind == "NO" else ""
        out.rows.append(Row("distributed_type", kind, "parallel.strategy='ddp'", "exact", note))
    elif kind == "FSDP":
        out.parallel.setdefault("strategy", "full_shard")
        out.rows.append(Row("distributed_type", kind, "FSDP2 (fully_shard)", "exact",
                            "fsdp_config sets the layout"))  # fmt: skip
    elif kind == "DEEPSPEED":
        out.rows.append(Row("distributed_type", kind, "deepspeed_config, read as DeepSpeed's",
                            "exact"))  # fmt: skip
    else:
        out.rows.append(Row("distributed_type", kind, "-", "refused",
                            "shardwise runs FSDP2 and DDP on GPUs and CPUs (no XLA, "
                            "Megatron-LM or other backends)"))  # fmt: skip


def _fsdp(out: Translation, block: object, kind: str) -> None:
    if kind != "FSDP" or not isinstance(block, Mapping):
        why = "fsdp_config without distributed_type FSDP: Accelerate ignores it"
        out.rows.append(Row("fsdp_config", block, "-", "no effect", why))
        return
    version = int(block.get("fsdp_version", 1))
    for sub, value in block.items():
        key = f"fsdp_config.{sub}"
        if sub == "fsdp_version":
            note = "FSDP1 keys mean what FSDP2 does the same way" if version == 1 else ""
            out.rows.append(Row(key, value, "FSDP2", "exact", note))
        elif sub == "fsdp_sharding_strategy":
            name = _STRATEGIES.get(str(value), str(value))
            try:
                strategy = normalize_strategy(name)
            except ValueError as exc:
                out.rows.append(Row(key, value, "-", "refused", str(exc)))
                continue
            out.parallel["strategy"] = strategy
            out.rows.append(Row(key, value, f"parallel.strategy='{strategy}'", "exact"))
        elif sub == "fsdp_reshard_after_forward":
            # Accelerate: under FSDP1 the key is a sharding strategy (a name or its number,
            # as fsdp_sharding_strategy); under FSDP2 a truth value (its str_to_bool).
            if isinstance(value, bool) or version != 1:
                truth = str(value).lower()
                if truth not in _TRUE + _FALSE:
                    why = "true or false under FSDP2 (a sharding strategy's name is FSDP1's)"
                    out.rows.append(Row(key, value, "-", "refused", why))
                    continue
                strategy = "full_shard" if truth in _TRUE else "shard_grad_op"
            else:
                try:
                    strategy = normalize_strategy(_STRATEGIES.get(str(value), str(value).upper()))
                except ValueError as exc:
                    out.rows.append(Row(key, value, "-", "refused", str(exc)))
                    continue
            out.parallel["strategy"] = strategy
            out.rows.append(Row(key, value, f"parallel.strategy='{strategy}'", "exact"))
        elif sub == "fsdp_offload_params":
            out.parallel["cpu_offload"] = bool(value)
            out.rows.append(Row(key, value, f"parallel.cpu_offload={bool(value)}", "exact"))
        elif sub in ("fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
                     "fsdp_min_num_params"):  # fmt: skip
            _wrap(out, key, sub, value, block)
        elif sub == "fsdp_backward_prefetch":
            if str(value) not in _PREFETCH:
                out.rows.append(Row(key, value, "-", "refused", f"one of {list(_PREFETCH)}"))
                continue
            out.parallel["backward_prefetch"] = _PREFETCH[str(value)]
            post = str(value) == "BACKWARD_POST"
            why = "FSDP2 has no post-gradient prefetch; it prefetches before (depth 1)"
            out.rows.append(Row(key, value, f"parallel.backward_prefetch="
                                f"{_PREFETCH[str(value)]!r}", "differs" if post else "exact",
                                why if post else ""))  # fmt: skip
        elif sub == "fsdp_forward_prefetch":
            out.parallel["forward_prefetch"] = bool(value)
            out.rows.append(Row(key, value, f"parallel.forward_prefetch={bool(value)}", "exact"))
        elif sub == "fsdp_sync_module_states":
            out.parallel["sync_module_states"] = bool(value)
            out.rows.append(Row(key, value, f"parallel.sync_module_states={bool(value)}", "exact"))
        elif sub == "fsdp_activation_checkpointing":
            ac = "full" if value else "none"
            out.parallel["activation_checkpointing"] = ac
            out.rows.append(Row(key, value, f"parallel.activation_checkpointing='{ac}'", "exact"))
        elif sub == "fsdp_use_orig_params":
            verdict: Verdict = "no effect" if value else "refused"
            why = "FSDP2 has no flat parameters: the optimizer always sees the originals"
            out.rows.append(Row(key, value, "-", verdict, why))
        elif sub in ("fsdp_cpu_ram_efficient_loading", "fsdp_state_dict_type"):
            why = (
                "build the model under shardwise.init_empty(): each rank fills only its shards"
                if sub == "fsdp_cpu_ram_efficient_loading"
                else "shardwise saves sharded (DCP) checkpoints; export_weights writes whole ones"
            )
            out.rows.append(Row(key, value, "-", "no effect", why))
        else:
            why = unknown_key(sub, _FSDP, "an fsdp_config")
            out.rows.append(Row(key, value, "-", "refused", why))


def _wrap(out: Translation, key: str, sub: str, value: object, block: Mapping[str, Any]) -> None:
    if sub == "fsdp_auto_wrap_policy":
        policy = str(value)
        if policy == "TRANSFORMER_BASED_WRAP":
            classes = block.get("fsdp_transformer_layer_cls_to_wrap")
            if classes:
                names = [c.strip() for c in str(classes).split(",")]
                out.parallel["auto_wrap_policy"] = names
                became = f"parallel.auto_wrap_policy={names}"
            else:
                became = "parallel.auto_wrap_policy='auto' (the model's _no_split_modules)"
            out.rows.append(Row(key, value, became, "exact"))
        elif policy == "SIZE_BASED_WRAP":
            out.parallel["auto_wrap_policy"] = "size"
            size = block.get("fsdp_min_num_params")
            if size is not None:
                out.parallel["min_num_params"] = int(size)
            out.rows.append(Row(key, value, f"parallel.auto_wrap_policy='size' (min {size})",
                                "exact"))  # fmt: skip
        elif policy == "NO_WRAP":
            out.parallel["auto_wrap_policy"] = "none"
            out.rows.append(Row(key, value, "parallel.auto_wrap_policy='none'", "exact"))
        else:
            out.rows.append(Row(key, value, "-", "refused", "TRANSFORMER_BASED_WRAP, "
                                "SIZE_BASED_WRAP or NO_WRAP"))  # fmt: skip
    else:
        out.rows.append(Row(key, value, "read with fsdp_auto_wrap_policy", "exact"))


def _precision(out: Translation, value: object, kind: str) -> None:
    key = "mixed_precision"
    if value in ("no", None):
        out.rows.append(Row(key, value, "parallel.mixed_precision='fp32'", "exact"))
        return
    if value not in ("bf16", "fp16"):
        out.rows.append(Row(key, value, "-", "refused", f"{value} is not built (bf16, fp16)"))
        return
    if kind == "DEEPSPEED":  # the DeepSpeed block's precision decides
        out.rows.append(Row(key, value, "read with deepspeed_config", "exact"))
        return
    out.parallel["mixed_precision"] = value
    note = (
        "compute in the low precision from fp32 parameters, as Accelerate; shardwise "
        "reduces gradients in fp32 where Accelerate's FSDP reduces in the compute dtype "
        "(more exact, twice the reduce-scatter bytes)"
    )
    if value == "fp16":
        note += "; dynamic loss scaling, as Accelerate"
    out.rows.append(Row(key, value, f"parallel.mixed_precision='{value}'", "differs", note))


def _deepspeed(
    out: Translation, block: object, kind: str, base: Path | None, data: Mapping[str, Any]
) -> None:
    if kind != "DEEPSPEED" or not isinstance(block, Mapping):
        why = "deepspeed_config without distributed_type DEEPSPEED: Accelerate ignores it"
        out.rows.append(Row("deepspeed_config", block, "-", "no effect", why))
        return
    file = block.get("deepspeed_config_file")
    given = file not in (None, "none")
    for sub, value in block.items():
        out.rows.append(_inline_row(sub, value, given))
    if given:
        path = Path(str(file))
        inner = translate_deepspeed(path if path.is_absolute() or base is None else base / path)
    else:
        inner = translate_deepspeed(_inline(block, data.get("mixed_precision")))
    for row in inner.rows:
        out.rows.append(Row(f"deepspeed_config: {row.key}", row.value, row.became, row.verdict,
                            row.note))  # fmt: skip
    for name in ("parallel", "train", "runner", "optimizer"):
        getattr(out, name).update(getattr(inner, name))
    out.schedule = inner.schedule


_INLINE = {  # Accelerate's inline key: the DeepSpeed key it stands for
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer",
    "offload_param_device": "zero_optimization.offload_param",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}
_INLINE_NO_EFFECT = {
    "zero3_init_flag": "build the model under shardwise.init_empty(): each rank fills only its "
    "shards",
    "zero3_save_16bit_model": "shardwise.export_weights writes whole weights from any checkpoint",
    "offload_optimizer_nvme_path": "read with offload_optimizer_device (NVMe is not built)",
    "offload_param_nvme_path": "read with offload_param_device (NVMe is not built)",
    "deepspeed_moe_layer_cls_names": "ZeRO-3 leaf modules of DeepSpeed MoE; parallel.ep "
    "places a transformers MoE's experts",
    "deepspeed_multinode_launcher": "a launch setting: give it to shardwise run / torchrun",
    "deepspeed_hostfile": "a launch setting: give it to shardwise run / torchrun",
    "deepspeed_inclusion_filter": "a launch setting: give it to shardwise run / torchrun",
    "deepspeed_exclusion_filter": "a launch setting: give it to shardwise run / torchrun",
}


def _inline_row(sub: str, value: object, file_given: bool) -> Row:
    """The row of one key of Accelerate's deepspeed_config block."""
    key = f"deepspeed_config.{sub}"
    if sub == "deepspeed_config_file":
        if not file_given:
            return Row(key, value, "-", "exact", "none: the inline keys are read")
        return Row(key, value, "read as DeepSpeed's (its rows below)", "exact")
    if sub in _INLINE and file_given:
        why = "beside deepspeed_config_file, which decides (Accelerate refuses both)"
        return Row(key, value, "-", "refused", why)
    if sub in _INLINE:
        return Row(key, value, f"read as {_INLINE[sub]} (its row below)", "exact")
    if sub in _INLINE_NO_EFFECT:
        return Row(key, value, "-", "no effect", _INLINE_NO_EFFECT[sub])
    known = ["deepspeed_config_file", *_INLINE, *_INLINE_NO_EFFECT]
    return Row(key, value, "-", "refused", unknown_key(sub, known, "a deepspeed_config"))


def _inline(block: Mapping[str, Any], precision: object) -> dict[str, Any]:
    """Accelerate's inline DeepSpeed keys as the DeepSpeed JSON they stand for."""
    zero: dict[str, Any] = {"stage": int(block.get("zero_stage", 2))}
    for side in ("optimizer", "param"):
        device = block.get(f"offload_{side}_device")
        if device not in (None, "none"):
            zero[f"offload_{side}"] = {"device": device}
    ds: dict[str, Any] = {"zero_optimization": zero}
    for name in ("gradient_accumulation_steps", "gradient_clipping"):
        if name in block:
            ds[name] = block[name]
    if precision in ("bf16", "fp16"):
        ds[str(precision)] = {"enabled": True}
    return ds


def _parallelism(out: Translation, block: object) -> None:
    sizes = dict(block) if isinstance(block, Mapping) else {}
    for key, value in sizes.items():
        name = key.removeprefix("parallelism_config_")
        where = f"parallelism_config.{key}"
        if name == "dp_shard_size":
            out.parallel["dp_shard"] = int(value)
            out.rows.append(Row(where, value, f"parallel.dp_shard={value}", "exact"))
        elif name == "dp_replicate_size":
            if int(value) > 1:
                out.parallel["strategy"] = "hybrid_shard"
            out.rows.append(Row(where, value, "replicas of each shard group (hybrid_shard "
                                "when > 1)", "exact"))  # fmt: skip
        elif name == "tp_size":
            out.parallel["tp"] = int(value)
            out.rows.append(Row(where, value, f"parallel.tp={value}", "exact"))
        elif name in ("cp_size", "sp_size"):
            _sequence_split(out, where, name, int(value), sizes)
        elif name in ("cp_backend", "cp_comm_strategy", "sp_backend"):
            out.rows.append(Row(where, value, "-", "no effect", "a communication choice; "
                                "shardwise's Ulysses computes the same attention"))  # fmt: skip
        else:
            prefix = "parallelism_config_" if key.startswith("parallelism_config_") else ""
            known = [prefix + size for size in _SIZES]
            why = unknown_key(key, known, "a parallelism_config")
            out.rows.append(Row(where, value, "-", "refused", why))


def _sequence_split(out: Translation, where: str, name: str, value: int, sizes: dict) -> None:  # type: ignore[type-arg]
    """cp_size (torch's ring context parallel) and sp_size (DeepSpeed's Ulysses, ALST)."""
    if value == 1:
        out.rows.append(Row(where, value, "no sequence split", "exact"))
        return
    other = "sp_size" if name == "cp_size" else "cp_size"
    if int(sizes.get(f"parallelism_config_{other}", sizes.get(other, 1)) or 1) > 1:
        why = "cp_size and sp_size both above 1: shardwise splits the sequence over one "
        out.rows.append(Row(where, value, "-", "refused", why + "dimension, parallel.cp"))
        return
    out.parallel["cp"] = value
    if name == "sp_size":
        out.rows.append(Row(where, value, f"parallel.cp={value}", "exact",
                            "Ulysses, as DeepSpeed's; the model's own masks are kept"))  # fmt: skip
    else:
        out.rows.append(Row(where, value, f"parallel.cp={value}", "differs",
                            "Ulysses (an all-to-all of heads) in place of torch's ring: the "
                            "same attention; the heads must divide by cp"))  # fmt: skip


_DYNAMO_NO_EFFECT = ("dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
                     "dynamo_use_regional_compilation")  # fmt: skip


def _dynamo(out: Translation, block: object) -> None:
    subs = dict(block) if isinstance(block, Mapping) else {}
    backend = subs.get("dynamo_backend", "NO")
    key = "dynamo_config.dynamo_backend"
    if str(backend).upper() == "NO":
        out.rows.append(Row(key, backend, "parallel.compile=False", "exact"))
    else:
        out.parallel["compile"] = str(backend).lower()
        out.rows.append(Row(key, backend, f"parallel.compile='{str(backend).lower()}'",
                            "exact", "torch.compile on each planned block"))  # fmt: skip
    for sub, value in subs.items():
        if sub in _DYNAMO_NO_EFFECT:
            why = "shardwise compiles each planned block with torch.compile's defaults"
            out.rows.append(Row(f"dynamo_config.{sub}", value, "-", "no effect", why))
        elif sub != "dynamo_backend":
            why = unknown_key(sub, ["dynamo_backend", *_DYNAMO_NO_EFFECT], "a dynamo_config")
            out.rows.append(Row(f"dynamo_config.{sub}", value, "-", "refused", why))
