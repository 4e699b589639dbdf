"""Words from the systems shardwise replaces: each means what it meant there, or is refused.

Owns: the keywords users bring from mmengine's MMDistributedDataParallel and
MMFullyShardedDataParallel, Lightning's fairscale `DDPFullyShardedStrategy`, torch FSDP1's
`FullyShardedDataParallel`, DDP, and the trainer mixin (`use_fsdp`/`sharding_strategy`),
translated into `ParallelConfig` fields before the config is built — or a refusal that
says what FSDP2/shardwise does instead. Also the mmengine dict form of wrap policies.

A word is accepted only where FSDP2 behaves exactly as the word said. Where it cannot
(flat parameters, buffers cast to another dtype, gradients kept in low precision, ...),
the word is refused with the reason and the nearest shardwise setting: a silently
different meaning would cost a training run before anyone noticed.

Must not: import config/parallel.py (it imports this; strategy names come from
config/names.py), touch torch.distributed, or read the environment.
Checks that need the running job (device indices) are left to `wrap`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from shardwise.config.names import normalize_strategy
from shardwise.config.precision import parse_dtype, resolve_precision

# Words accepted only with one value: FSDP2 always behaves that way (value -> why).
_ONLY_VALUE: dict[str, tuple[object, str]] = {
    "use_orig_params": (
        True,
        "FSDP2 has no FlatParameter: parameters keep their names and the optimizer always "
        "sees them one by one (FSDP1's use_orig_params=True). Remove use_orig_params.",
    ),
    "flatten_parameters": (
        False,
        "FSDP2 shards each parameter on its own (a DTensor split on dim 0) and never "
        "flattens them; communication is still batched per shard unit. Remove "
        "flatten_parameters.",
    ),
    "limit_all_gathers": (
        True,
        "FSDP2 always bounds the all-gathers in flight (the current and the prefetched "
        "unit), which is what limit_all_gathers=True asked FSDP1 to do. Remove it.",
    ),
    "dim": (
        0,
        "DDP scatters along dim 0 only when one process drives several devices, which "
        "shardwise never does (one rank, one device). Remove dim.",
    ),
    "check_reduction": (
        False,
        "DDP ignores check_reduction (deprecated); use "
        "find_unused_parameters=True for parameters without gradients.",
    ),
}

# Words with no FSDP2 meaning at all (word -> what to do instead).
_REFUSED: dict[str, str] = {
    "state_dict_to_cpu": (
        "FSDP2's state_dict() holds sharded DTensors on each rank's device; shardwise "
        "gathers onto CPU where it matters: shardwise.export_weights (consolidated "
        "safetensors) and shardwise.save_checkpoint (sharded, any world size). For a full "
        "CPU state dict use torch.distributed.checkpoint.state_dict.get_model_state_dict("
        "model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))."
    ),
    "ignored_states": (
        "Give modules as ParallelConfig.ignored_modules and parameter names as "
        "ParallelConfig.ignored_params."
    ),
    "detect_anomalous_params": (
        "It belongs to the training step, not to sharding: use "
        "TrainConfig.detect_anomalous_params=True (or the mmengine wrapper's own argument)."
    ),
}

# Same meaning, our name.
_RENAMED = {
    "ignored_parameters": "ignored_params",  # mmengine's MMFullyShardedDataParallel
}

# Placement words: accepted when they name this rank's own device, checked by wrap.
PLACEMENT_WORDS = ("device_ids", "output_device", "device_id")

_STRATEGY_WORDS = ("sharding_strategy", "use_fsdp")
_PRECISION_WORDS = ("compute_dtype", "fp32_reduce_scatter", "move_grads_to_cpu")

FOREIGN_WORDS = frozenset(
    [
        *_ONLY_VALUE,
        *_REFUSED,
        *_RENAMED,
        *PLACEMENT_WORDS,
        *_STRATEGY_WORDS,
        *_PRECISION_WORDS,
        "process_group",
    ]
)
"""Every keyword ParallelConfig accepts besides its fields (to accept or to refuse)."""


def translate(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ParallelConfig field values, placement words for wrap to check) from keywords that
    may use other systems' words; raises ValueError for words FSDP2 cannot honour."""
    out = dict(kwargs)
    for word, (value, why) in _ONLY_VALUE.items():
        if word in out:
            given = out.pop(word)
            if given != value:
                raise ValueError(f"ParallelConfig: {word}={given!r} is not supported. {why}")
    for word, instead in _REFUSED.items():
        if word in out:
            raise ValueError(
                f"ParallelConfig: {word}={out[word]!r} has no FSDP2/shardwise equivalent. {instead}"
            )
    for word, ours in _RENAMED.items():
        if word in out:
            _set_once(out, ours, out.pop(word), word)
    placement = {w: out.pop(w) for w in PLACEMENT_WORDS if w in out}
    if "process_group" in out:
        _set_once(out, "device_mesh", out.pop("process_group"), "process_group")
    _translate_strategy(out)
    _translate_fairscale_precision(out)
    return out, placement


def _set_once(out: dict[str, Any], field: str, value: Any, word: str) -> None:
    if field in out and out[field] != value:
        raise ValueError(
            f"ParallelConfig: {word}={value!r} and {field}={out[field]!r} both set the same "
            f"thing differently. Set only {field}."
        )
    out[field] = value


def _translate_strategy(out: dict[str, Any]) -> None:
    """`sharding_strategy` (FSDP1, mmengine) is `strategy`. The mixin's `use_fsdp=False`
    means DDP whatever its `sharding_strategy` says; `use_fsdp=True` means its
    `sharding_strategy`, which defaults to HYBRID_SHARD there."""
    if "use_fsdp" in out:
        use_fsdp = out.pop("use_fsdp")
        if not isinstance(use_fsdp, bool):
            raise ValueError(f"ParallelConfig: use_fsdp={use_fsdp!r} must be True or False.")
        mixin_strategy = out.pop("sharding_strategy", "HYBRID_SHARD")
        chosen = mixin_strategy if use_fsdp else "ddp"
        if "strategy" in out and (normalize_strategy(out["strategy"]) == "ddp") == use_fsdp:
            raise ValueError(
                f"ParallelConfig: use_fsdp={use_fsdp} contradicts strategy="
                f"{out['strategy']!r}. Set only strategy (use_fsdp=False is 'ddp')."
            )
        out.setdefault("strategy", chosen)
    if "sharding_strategy" in out:
        value = out.pop("sharding_strategy")
        if "strategy" in out and normalize_strategy(out["strategy"]) != normalize_strategy(value):
            raise ValueError(
                f"ParallelConfig: sharding_strategy={value!r} and strategy={out['strategy']!r} "
                "name different strategies. Set only strategy."
            )
        out["strategy"] = value


def _dtype(value: Any, word: str) -> torch.dtype:
    dtype = parse_dtype(value, f"ParallelConfig.{word}")
    if dtype is None:
        raise ValueError(f"ParallelConfig.{word}=None: give a dtype such as 'bf16'.")
    return dtype


def _translate_fairscale_precision(out: dict[str, Any]) -> None:
    """fairscale's compute_dtype/fp32_reduce_scatter are the compute and reduce dtypes;
    its move_grads_to_cpu is part of FSDP2's CPU offload, never apart from it."""
    if "move_grads_to_cpu" in out:
        moves = out.pop("move_grads_to_cpu")
        offload = out.get("cpu_offload", False)
        offloads = bool(offload) and getattr(offload, "offload_params", True) is not False
        if bool(moves) != offloads:
            raise ValueError(
                f"ParallelConfig: move_grads_to_cpu={moves!r} with cpu_offload={offload!r} is "
                "not possible under FSDP2: its CPU offload moves parameters, gradients and "
                "optimizer state together. Use cpu_offload=True for both, or neither."
            )
    if not any(w in out for w in ("compute_dtype", "fp32_reduce_scatter")):
        return
    if "compute_dtype" in out and "mixed_precision" in out:
        raise ValueError(
            f"ParallelConfig: compute_dtype={out['compute_dtype']!r} and mixed_precision="
            f"{out['mixed_precision']!r} both set the compute dtype. Set only mixed_precision."
        )
    base = resolve_precision(out.get("mixed_precision"))
    has_compute = "compute_dtype" in out
    param = _dtype(out.pop("compute_dtype"), "compute_dtype") if has_compute else base.param_dtype
    # fairscale reduced in the compute dtype unless fp32_reduce_scatter was set.
    reduce = param if has_compute else base.reduce_dtype
    if "fp32_reduce_scatter" in out:
        fp32 = out.pop("fp32_reduce_scatter")
        if not isinstance(fp32, bool):
            raise ValueError(f"ParallelConfig: fp32_reduce_scatter={fp32!r} must be a bool.")
        reduce = torch.float32 if fp32 else param
    out["mixed_precision"] = {
        "param_dtype": _name(param),
        "reduce_dtype": _name(reduce),
        "output_dtype": _name(base.output_dtype),
        "cast_forward_inputs": base.cast_forward_inputs,
    }


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


# --- wrap policies in mmengine's dict form ----------------------------------------------

_SIZE_POLICY_NAMES = (
    "size_based_auto_wrap_policy",
    "torch.distributed.fsdp.wrap.size_based_auto_wrap_policy",
)
_TRANSFORMER_POLICY_NAMES = (
    "transformer_auto_wrap_policy",
    "torch.distributed.fsdp.wrap.transformer_auto_wrap_policy",
)
_MODULE_POLICY_NAMES = ("ModuleWrapPolicy", "torch.distributed.fsdp.wrap.ModuleWrapPolicy")
FIELD = "ParallelConfig.auto_wrap_policy"


def policy_from_dict(value: Mapping[str, Any]) -> tuple[Any, int | None]:
    """(auto_wrap_policy, min_num_params) for mmengine's `dict(type=..., ...)` policies."""
    kind = value.get("type")
    rest = {k: v for k, v in value.items() if k != "type"}
    if kind in _SIZE_POLICY_NAMES:
        _only_keys(rest, {"min_num_params"}, kind)
        size = rest.get("min_num_params")
        where = f"{FIELD}.min_num_params"
        return "size", None if size is None else integral(size, where, text=True)
    if kind in (*_TRANSFORMER_POLICY_NAMES, *_MODULE_POLICY_NAMES):
        key = "transformer_layer_cls" if kind in _TRANSFORMER_POLICY_NAMES else "module_classes"
        _only_keys(rest, {key}, kind)
        classes = rest.get(key)
        if isinstance(classes, (str, type)):
            classes = (classes,)
        if not classes:
            raise ValueError(f"{FIELD}: {kind} needs {key}=[block classes or class names].")
        return tuple(classes), None
    known = [*_SIZE_POLICY_NAMES, *_TRANSFORMER_POLICY_NAMES, *_MODULE_POLICY_NAMES]
    raise ValueError(
        f"{FIELD}=dict(type={kind!r}, ...) is not a policy shardwise knows. Use one of "
        f"{known[::2]} (also as torch's dotted names), or shardwise's own forms: 'auto', "
        "'size', block classes or class names, 're:<regex>', a callable."
    )


def _only_keys(rest: Mapping[str, Any], allowed: set[str], kind: str) -> None:
    extra = sorted(set(rest) - allowed)
    if extra:
        raise ValueError(
            f"{FIELD}: {kind} has unknown argument(s) {extra}; it takes {sorted(allowed)}."
        )


def integral(value: Any, where: str, *, text: bool = False) -> int:
    """An int from an int, an integral float (1e7) or, with `text`, such a string (YAML 1.1
    reads 1e7 as text); anything else is an error naming `where`."""
    if isinstance(value, bool):
        raise TypeError(f"{where} must be an int, got {value!r}.")
    if isinstance(value, int):
        return value
    number = value
    if isinstance(value, str) and text:
        try:
            number = float(value)
        except ValueError:
            raise TypeError(f"{where} must be an int, got {value!r}.") from None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        return int(number)
    raise TypeError(f"{where} must be an int, got {value!r}.")
