"""The tensors of an adapter model's exports: peft's own format, and merged weights.

Owns: streaming the tensors of the two exports, one at a time, from a live (possibly
sharded) peft model or from a checkpoint directory:

- `kind="adapter"`: the trainable tensors under peft's names (adapters.py's `peft_key`),
  for adapter_model.safetensors beside adapter_config.json, which
  `PeftModel.from_pretrained(base, dir)` opens. peft reads one file, so the adapter is one
  file: rank 0 holds the whole adapter (the trainable tensors only) before writing it.
- `kind="merged"`: the base model's tensors in its own names, each LoRA layer's weight with
  its delta merged (W + scale * B @ A), which `from_pretrained` opens as a plain model. Its
  tensors stream like a full export's: one base weight (and its two LoRA factors) at a time.

From a live model every rank iterates in the same order (the gathers are collectives) and
only the writing rank (`keep`) keeps the tensors. export.py writes the files.

Must not: write files, or gather more than one base weight (with its LoRA factors) at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from shardwise.checkpoint.adapters import (
    ADAPTERS,
    MergeItem,
    export_adapter,
    merge_lora,
    merge_plan,
    peft_key,
    state_options,
)
from shardwise.checkpoint.reading import model_entries, read_groups
from shardwise.parallelize.weights import _model_state

Tensors = Iterator[tuple[str, torch.Tensor | None]]


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank must call)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def live_adapter_tensors(model: nn.Module, record: dict[str, Any], keep: bool) -> Tensors:
    """(peft name, full CPU tensor, or None off the writing rank) per trainable tensor.
    What cannot be exported is refused here, before any gather."""
    adapter = export_adapter(record, "export_weights(kind='adapter')")
    state = cast(
        dict[str, torch.Tensor], get_model_state_dict(model, options=state_options(ADAPTERS))
    )
    return _adapter_stream(state, record["trainable"], adapter, keep)


def _adapter_stream(
    state: dict[str, torch.Tensor], names: list[str], adapter: str, keep: bool
) -> Tensors:
    for name in names:
        value = _full(state[name])
        yield peft_key(name, adapter), value.detach().cpu() if keep else None
        del value


def live_merged_tensors(
    model: nn.Module,
    record: dict[str, Any],
    keep: bool,
    make_room: Callable[[torch.Tensor], None] | None = None,
) -> Tensors:
    """(base model's name, full CPU tensor with its LoRA delta merged, or None off the
    writing rank) per tensor of the base model. `make_room(weight)` runs before each gather
    on the writing rank, as for a full export. The plan (and any refusal) comes first."""
    state = _model_state(model)
    plan = merge_plan(record, {k: tuple(v.shape) for k, v in state.items()})
    return _merged_stream(state, plan, keep, make_room)


def _merged_stream(
    state: dict[str, torch.Tensor],
    plan: list[MergeItem],
    keep: bool,
    make_room: Callable[[torch.Tensor], None] | None,
) -> Tensors:
    for item in plan:
        if keep and make_room is not None:
            make_room(state[item.key])
        value = _full(state[item.key])
        if item.lora_a is not None and item.lora_b is not None:
            a, b = _full(state[item.lora_a]), _full(state[item.lora_b])
            if keep:
                value = merge_lora(value, a, b, item.scale, item.transpose)
            del a, b
        yield item.out, value.detach().cpu() if keep else None
        del value


def checkpoint_adapter_tensors(
    checkpoint: Path, record: dict[str, Any], max_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, tensor) per trainable tensor of a checkpoint of an adapter model."""
    adapter = export_adapter(record, "export_weights(kind='adapter')")
    groups = read_groups(checkpoint, [[n] for n in record["trainable"]], max_bytes)
    return ((peft_key(name, adapter), t) for group in groups for name, t in group.items())


def checkpoint_merged_tensors(
    checkpoint: Path, manifest: dict[str, Any], max_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(base model's name, tensor with its LoRA delta merged) from a full checkpoint of a
    LoRA model. An adapters-only checkpoint has no base to merge into: ValueError."""
    if manifest.get("contents") == ADAPTERS:
        raise ValueError(
            f"export_weights(kind='merged'): checkpoint {checkpoint} holds adapters only, no "
            "base weights to merge them into. Load it into the model "
            "(load_checkpoint) and call export_weights(model, out, kind='merged'), or export "
            "kind='adapter' and merge with peft (PeftModel.from_pretrained(base, dir)"
            ".merge_and_unload())."
        )
    shapes = {k: tuple(md.size) for k, md in model_entries(checkpoint).items()}
    plan = merge_plan(manifest["adapters"], shapes)
    groups = [[i.key] if i.lora_a is None else [i.key, i.lora_a, str(i.lora_b)] for i in plan]
    return _merged_groups(plan, read_groups(checkpoint, groups, max_bytes))


def _merged_groups(
    plan: list[MergeItem], groups: Iterator[dict[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for item, group in zip(plan, groups, strict=True):
        value = group[item.key]
        if item.lora_a is not None and item.lora_b is not None:
            value = merge_lora(
                value, group[item.lora_a], group[item.lora_b], item.scale, item.transpose
            )
        yield item.out, value
