"""Adapter models in checkpoints and exports: what a checkpoint records about its adapters,
the adapters-only check on load, peft's own key names, and LoRA's merge.

A peft model (plan/adapters.py reads it) trains a few small tensors beside a frozen base. A
checkpoint of one records, in its manifest's `adapters` section (`adapter_record`):

- `method`, `names` (the active adapters), `prefix` (the base model's path in the peft
  model) and `configs` (each loaded adapter's peft config, as peft's `to_dict()` gives it:
  what `adapter_config.json` is written from);
- `trainable`: the trainable tensors' names (adapters, and modules_to_save copies);
- `lora_scaling`: each LoRA layer's scale per adapter, as peft computed it (alpha/r, or
  alpha/sqrt(r) with rslora, after rank and alpha patterns): what a merge multiplies by;
- `base`: the base model's class, `name_or_path`, and a fingerprint of its frozen
  parameters (SHA-256 of their names, in the base model's own names, and shapes).

An adapters-only checkpoint (`save_checkpoint(..., adapters_only=True)`, manifest
`contents: "adapters"`) holds the trainable tensors and their optimizer state, selected by
torch's `StateDictOptions(ignore_frozen_params=True)` and written by DCP like any other
checkpoint: every rank writes its own shards. Loading one checks the model first
(`check_adapter_checkpoint`): the same method, adapters, LoRA scales and base fingerprint,
or a CheckpointError that names the field, both values and the fix.

Owns: the `adapters` manifest section, the state-dict options of an adapters-only
checkpoint, peft's key names (`peft_key`), `adapter_config.json`'s contents, and the merge
plan and arithmetic of LoRA (`merge_plan`, `merge_lora`).

Must not: import peft (peft's objects are read duck-typed), read or write files, or issue
collectives.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from shardwise.checkpoint.trust import CheckpointError
from shardwise.parallelize.wrapped import unwrap
from shardwise.plan.adapters import AdapterModel, adapted_layers, adapter_model

FULL = "full"
ADAPTERS = "adapters"
CONTENTS = (FULL, ADAPTERS)
"""The manifest's `contents`: the whole training state, or the adapters and their state."""

# peft methods whose state is not a set of adapter layers (their keys are not renamed the
# way `peft_key` does, and their export is peft's own `save_pretrained`).
_PROMPT_LEARNING = frozenset(
    {"PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "CPT"}
)


def original_class(model: nn.Module) -> type:
    """The model's own class: fully_shard swaps in a generated `FSDP<Name>` subclass, and
    torch.compile wraps the model in `_orig_mod`."""
    from torch.distributed.fsdp import FSDPModule

    model = getattr(model, "_orig_mod", model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def state_options(contents: str) -> StateDictOptions:
    """torch's state-dict options for a checkpoint's `contents`: an adapters-only one holds
    the parameters that train (and their optimizer state), each rank its own shards, and
    loads into a model whose frozen base it leaves as it is (so not strictly: the base's
    keys are missing by design; `loaded_all_adapters` checks what was filled)."""
    adapters = contents == ADAPTERS
    return StateDictOptions(ignore_frozen_params=adapters, strict=not adapters)


def without_frozen(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a model state dict) without any frozen parameter. torch's
    `ignore_frozen_params` drops a frozen parameter under its first name only: a tied alias
    (a tied lm_head.weight beside a frozen embed_tokens.weight) stayed, and an adapters-only
    checkpoint held the whole embedding matrix."""
    frozen = {
        n for n, p in unwrap(model).named_parameters(remove_duplicate=False) if not p.requires_grad
    }
    return {k: v for k, v in state.items() if k not in frozen}


def loaded_all_adapters(model: nn.Module, missing: list[str], path: object) -> None:
    """After a non-strict load of an adapters-only checkpoint: every trainable tensor was
    filled (only the frozen base may be missing)."""
    trainable = {n for n, p in unwrap(model).named_parameters() if p.requires_grad}
    unfilled = sorted(k for k in missing if k in trainable)
    if unfilled:
        raise CheckpointError(
            f"checkpoint {path}: {len(unfilled)} trainable tensor(s) of the model were not "
            f"in it: {unfilled[:10]}. The model's adapters differ from the checkpoint's."
        )


def _jsonable(value: Any) -> Any:
    """peft's config dict as JSON (sets become sorted lists, enums their values)."""

    def default(v: Any) -> Any:
        if isinstance(v, (set, frozenset)):
            return sorted(v, key=str)
        if isinstance(v, tuple):
            return list(v)
        return getattr(v, "value", repr(v))

    return json.loads(json.dumps(value, default=default))


def _config_dict(config: Any) -> dict[str, Any]:
    to_dict = getattr(config, "to_dict", None)
    raw = to_dict() if callable(to_dict) else dict(vars(config))
    return dict(_jsonable(raw))


def _base_key(found: AdapterModel, fqn: str) -> str:
    """`fqn` in the base model's own names (an adapted layer's `base_layer` and a
    modules_to_save wrapper's `original_module` are the original module)."""
    name = found.base_name(fqn)
    return (name if name is not None else fqn).replace(".original_module", "")


def _base_record(found: AdapterModel, model: nn.Module) -> dict[str, Any]:
    frozen = sorted(
        (_base_key(found, n), list(p.shape)) for n, p in model.named_parameters()
        if not p.requires_grad
    )  # fmt: skip
    cls = original_class(found.base)
    name_or_path = getattr(found.base, "name_or_path", None)
    return {
        "class": cls.__name__,
        "module": cls.__module__,
        "name_or_path": name_or_path if isinstance(name_or_path, str) and name_or_path else None,
        "parameters": len(frozen),
        "elements": sum(math.prod(shape) for _, shape in frozen),
        "fingerprint": hashlib.sha256(json.dumps(frozen).encode()).hexdigest(),
    }


def adapter_record(model: nn.Module) -> dict[str, Any] | None:
    """The manifest's `adapters` section for `model` (wrapped or not), or None when it is
    not an adapter model. Reads names, shapes and peft's own attributes; gathers nothing."""
    inner = unwrap(model)
    found = adapter_model(inner)
    if found is None:
        return None
    configs: dict[str, Any] = getattr(inner, "peft_config", {})
    scaling: dict[str, dict[str, float]] = {}
    if found.method == "LORA":
        for path in adapted_layers(inner):
            scales = getattr(inner.get_submodule(path), "scaling", None)
            if isinstance(scales, dict):
                mine = {a: float(scales[a]) for a in found.adapters if a in scales}
                if mine:
                    scaling[path] = mine
    params = dict(inner.named_parameters())
    return {
        "method": found.method,
        "names": list(found.adapters),
        "prefix": found.prefix,
        "configs": {a: _config_dict(c) for a, c in configs.items()},
        "trainable": list(found.trainable),
        "trainable_elements": sum(params[n].numel() for n in found.trainable),
        "lora_scaling": scaling,
        "base": _base_record(found, inner),
    }


def refuse_adapters_only(model: nn.Module) -> dict[str, Any]:
    """The adapter record of a model saved with `adapters_only=True`; a ValueError when the
    model has no adapters or nothing frozen (the same on every rank: before any collective)."""
    record = adapter_record(model)
    if record is None:
        raise ValueError(
            f"save_checkpoint(adapters_only=True) got a {original_class(unwrap(model)).__name__}, "
            "which has no adapters (no peft_config / get_base_model: not a peft model). "
            "adapters_only saves the adapters of a peft model (get_peft_model(base, config)) "
            "without its frozen base. Save this model whole: adapters_only=False."
        )
    if record["base"]["parameters"] == 0:
        raise ValueError(
            "save_checkpoint(adapters_only=True): every parameter of this "
            f"{record['method']} model trains (none is frozen), so an adapters-only "
            "checkpoint would hold the whole model while claiming a base it does not have. "
            "Save it whole: adapters_only=False."
        )
    return record


def _describe(record: dict[str, Any]) -> str:
    base = record.get("base") or {}
    where = f" ({base['name_or_path']})" if base.get("name_or_path") else ""
    return (
        f"{record.get('method')} adapter(s) {record.get('names')} on a "
        f"{base.get('class')}{where} base"
    )


def check_adapter_checkpoint(manifest: dict[str, Any], model: nn.Module, path: object) -> None:
    """Refuse to load the adapters-only checkpoint at `path` into `model` unless the model
    has the same adapters on the same base. Raises CheckpointError naming the field."""
    saved = manifest.get("adapters")
    if not isinstance(saved, dict) or not isinstance(saved.get("base"), dict):
        raise CheckpointError(
            f"checkpoint {path}: manifest field contents is 'adapters' but field adapters is "
            f"{type(saved).__name__}, expected the adapters' record (method, names, base). "
            "The manifest is corrupted or was edited; the checkpoint was not used."
        )
    mine = adapter_record(model)
    fix = (
        "Build the model the adapters were trained in (the same base, then "
        "peft.get_peft_model(base, config) with the config in the manifest: "
        f"`shardwise checkpoint inspect {path}`) and load into it."
    )
    if mine is None:
        raise CheckpointError(
            f"checkpoint {path} holds adapters only ({_describe(saved)}), but the model given, "
            f"a {original_class(unwrap(model)).__name__}, has no adapters. {fix}"
        )
    for field in ("method", "names"):
        if saved.get(field) != mine[field]:
            raise CheckpointError(
                f"checkpoint {path}: manifest field adapters.{field} is {saved.get(field)!r}, "
                f"but the model's is {mine[field]!r}. {fix}"
            )
    base, have = saved["base"], mine["base"]
    if base.get("fingerprint") != have["fingerprint"]:
        where = base.get("name_or_path") or "its path is not recorded"
        raise CheckpointError(
            f"checkpoint {path} holds adapters trained on a different base: manifest field "
            f"adapters.base is a {base.get('class')} with {base.get('parameters')} frozen "
            f"parameters ({base.get('elements')} elements, fingerprint "
            f"{str(base.get('fingerprint'))[:12]}), the model's base a {have['class']} with "
            f"{have['parameters']} ({have['elements']} elements, fingerprint "
            f"{have['fingerprint'][:12]}). Adapters fit only the base they were trained on "
            f"(names and shapes): load that base ({where}), "
            "or use a full checkpoint."
        )
    for layer, scales in (saved.get("lora_scaling") or {}).items():
        if mine["lora_scaling"].get(layer) != scales:
            raise CheckpointError(
                f"checkpoint {path}: manifest field adapters.lora_scaling[{layer!r}] is "
                f"{scales}, the model's is {mine['lora_scaling'].get(layer)}: its LoraConfig "
                f"differs (lora_alpha, r, use_rslora or a pattern). {fix}"
            )


def peft_key(name: str, adapter: str) -> str:
    """`name` (a trainable tensor of the peft model) as peft's `save_pretrained` writes it in
    adapter_model.safetensors: without the adapter's name, a modules_to_save copy under the
    wrapped module's own name, and DoRA's magnitude without `.weight` (peft's
    `_remove_adapter_name_from_state_dict_key` and `ModulesToSaveWrapper.adapter_state_dict`)."""
    marker = f".modules_to_save.{adapter}."
    if marker in name:
        return name.replace(marker, ".", 1)
    if name.endswith(f".{adapter}"):
        return name.removesuffix(f".{adapter}")
    head, _, suffix = name.rpartition(".")
    key = f"{head.removesuffix(f'.{adapter}')}.{suffix}"
    if key.endswith(".lora_magnitude_vector.weight"):  # peft keeps DoRA's old key format
        key = key.removesuffix(".weight")
    return key


def export_adapter(record: dict[str, Any], what: str) -> str:
    """The one adapter an export writes; NotImplementedError for what peft's format of a
    shardwise export cannot hold."""
    if record["method"] in _PROMPT_LEARNING:
        raise NotImplementedError(
            f"{what}: exporting a {record['method']} model (prompt learning) is not "
            "supported; its state is not adapter layers. Use peft's save_pretrained on an "
            "unsharded model, or kind='full'."
        )
    if len(record["names"]) != 1:
        raise NotImplementedError(
            f"{what}: the model has {len(record['names'])} active adapters "
            f"{record['names']}; an export writes one. Activate one (set_adapter) and export it."
        )
    return str(record["names"][0])


def adapter_config(record: dict[str, Any]) -> str:
    """adapter_config.json as peft's `save_pretrained` writes it: the config's `to_dict()`,
    in inference mode, with the base model's path, and `auto_mapping` when no task type."""
    adapter = export_adapter(record, "export_weights(kind='adapter')")
    config = dict(record["configs"][adapter])
    base = record["base"]
    if config.get("base_model_name_or_path") is None:
        config["base_model_name_or_path"] = base.get("name_or_path")
    config["inference_mode"] = True
    if config.get("task_type") is None:
        config["auto_mapping"] = {
            "base_model_class": base["class"],
            "parent_library": base["module"],
        }
    return json.dumps(config, indent=2, sort_keys=True)


@dataclass(frozen=True)
class MergeItem:
    """One tensor of a merged export: `key` (in the peft model) written as `out` (in the
    base model's names), plus `delta` when it is a LoRA layer's base weight."""

    out: str
    key: str
    lora_a: str | None = None
    lora_b: str | None = None
    scale: float = 0.0
    transpose: bool = False


def merge_plan(record: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[MergeItem]:
    """The tensors of a merged export, from the peft model's state-dict names and shapes.

    Each LoRA layer's base weight becomes W + scale * (B @ A) (transposed for
    fan_in_fan_out); a modules_to_save copy replaces its original; everything else keeps its
    value, in the base model's own names. NotImplementedError, naming what, for anything
    that is not a plain LoRA of a Linear layer (another method, DoRA, a LoRA bias, an
    embedding or convolution LoRA, a quantized base): a merge of those here would be wrong.
    """
    what = "export_weights(kind='merged')"
    adapter = export_adapter(record, what)
    if record["method"] != "LORA":
        raise NotImplementedError(
            f"{what}: merging is implemented for LoRA; this model's method is "
            f"{record['method']}. Export the adapter (kind='adapter') and merge it with peft "
            "(PeftModel.from_pretrained(base, dir).merge_and_unload())."
        )
    config = record["configs"].get(adapter, {})
    for flag in ("use_dora", "lora_bias"):
        if config.get(flag):
            raise NotImplementedError(
                f"{what}: the LoRA config has {flag}=True, which this merge does not "
                "implement. Export the adapter (kind='adapter') and merge it with peft's "
                "merge_and_unload()."
            )
    prefix = str(record.get("prefix", ""))
    trainable = set(record["trainable"])
    used: set[str] = set()
    items: list[MergeItem] = []
    layers = {layer: s[adapter] for layer, s in record["lora_scaling"].items() if adapter in s}
    for key, shape in shapes.items():
        if ".original_module." in key or _other_adapter(key, adapter, record["configs"]):
            continue  # a modules_to_save original (its copy is written), or another adapter
        if ".lora_A." in key or ".lora_B." in key:
            continue  # merged into its base weight below
        out = key.replace(f".modules_to_save.{adapter}.", ".")
        out = out.removeprefix(prefix).replace(".base_layer.", ".")
        layer = key.removesuffix(".base_layer.weight")
        if layer in layers and key.endswith(".base_layer.weight"):
            a, b = f"{layer}.lora_A.{adapter}.weight", f"{layer}.lora_B.{adapter}.weight"
            _check_linear(what, layer, shape, shapes.get(a), shapes.get(b), config)
            transpose = bool(config.get("fan_in_fan_out"))
            items.append(MergeItem(out, key, a, b, layers[layer], transpose))
            used.update((a, b))
        else:
            items.append(MergeItem(out, key))
        used.add(key)
    left = sorted(trainable - used)
    if left:
        raise NotImplementedError(
            f"{what}: {len(left)} trainable tensor(s) have no place in the base model, e.g. "
            f"{left[:3]} (an embedding or convolution LoRA, or another kind of adapter "
            "tensor). Export the adapter (kind='adapter') and merge it with peft's "
            "merge_and_unload()."
        )
    return items


def _other_adapter(key: str, adapter: str, configs: dict[str, Any]) -> bool:
    parts = key.split(".")
    return any(name != adapter and name in parts for name in configs)


def _check_linear(
    what: str,
    layer: str,
    weight: tuple[int, ...],
    a: tuple[int, ...] | None,
    b: tuple[int, ...] | None,
    config: dict[str, Any],
) -> None:
    if a is None or b is None or len(a) != 2 or len(b) != 2 or len(weight) != 2:
        raise NotImplementedError(
            f"{what}: {layer} is not a LoRA of a Linear layer (base weight {weight}, lora_A "
            f"{a}, lora_B {b}): convolution and embedding LoRA, and quantized bases, are not "
            "merged here. Export the adapter (kind='adapter') and merge it with peft."
        )
    want = (b[0], a[1]) if not config.get("fan_in_fan_out") else (a[1], b[0])
    if tuple(weight) != want:
        raise NotImplementedError(
            f"{what}: {layer}'s base weight is {tuple(weight)} but its LoRA makes {want} "
            "(a quantized or packed base weight?). Merge it with peft on an unsharded model."
        )


def merge_lora(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, transpose: bool
) -> torch.Tensor:
    """W + scale * (B @ A), as peft's `merge_and_unload` computes it on the CPU: the delta
    in fp32, scaled, then held in the adapters' dtype (`get_delta_weight`), and added to the
    weight in place, which rounds once to the weight's dtype. bf16 adapters thus round
    twice, as peft's do; fp32 ones (peft's default, autocast_adapter_dtype) once."""
    delta = b.float() @ a.float()
    if transpose:
        delta = delta.T
    delta = (delta * scale).to(b.dtype)
    return (weight.float() + delta.float()).to(weight.dtype)
