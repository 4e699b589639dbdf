"""Adapter models (PEFT's LoRA and its other methods): which part is the base model and
which parameters are the adapters, read from the model without importing peft.

A peft model nests the user's model: `PeftModel.base_model` is a tuner (`LoraModel`, ...)
whose `.model` is the transformers model, so every name gains a prefix
(`base_model.model.`), and each adapted layer becomes a wrapper whose original module is
its `base_layer` (`q_proj` → `q_proj.base_layer`, beside `q_proj.lora_A.<adapter>` and
`q_proj.lora_B.<adapter>`). Planning, tensor parallelism, checkpoints and export all need to
see through that nesting; this module is where they read it.

Owns: recognising a peft model (`adapter_model` → `AdapterModel`: its base model and the
prefix to it, the method, the active adapters, the trainable parameters), an adapted
layer (`adapted_layers`: the wrapper's path and its base layer) and a module trained whole
as a copy (`saved_modules`: peft's `modules_to_save`).

Must not: import peft, change the model, or decide what to do with an adapter (the
planner, parallelize and checkpoint packages do).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["AdapterModel", "adapted_layers", "adapter_model", "saved_modules"]


@dataclass(frozen=True)
class AdapterModel:
    """What a peft model is made of, by name."""

    base: nn.Module
    """The model the adapters were added to (a transformers model, usually)."""
    prefix: str
    """The path of `base` inside the peft model, with a trailing dot ('base_model.model.')."""
    method: str
    """peft's name of the method of the active adapter ('LORA', 'IA3', ...)."""
    adapters: tuple[str, ...]
    """The active adapters' names ('default' unless the user named them)."""
    trainable: tuple[str, ...]
    """The peft model's parameters that train: adapters, and modules_to_save copies."""
    frozen: int
    """How many parameters (elements) stay frozen: the base."""

    def base_name(self, fqn: str) -> str | None:
        """`fqn` (a path in the peft model) as the base model names it, or None when it is
        not inside the base model. An adapted layer's `.base_layer` is the original module."""
        if not fqn.startswith(self.prefix):
            return None
        return fqn[len(self.prefix) :].replace(".base_layer", "")


def adapter_model(model: nn.Module) -> AdapterModel | None:
    """The `AdapterModel` of a peft model (`get_peft_model`, `PeftModel.from_pretrained`),
    or None for any other module. Recognised by peft's own attributes: a `peft_config`
    dict and `get_base_model()`."""
    configs = getattr(model, "peft_config", None)
    get_base = getattr(model, "get_base_model", None)
    if not isinstance(configs, dict) or not configs or not callable(get_base):
        return None
    base = get_base()
    if not isinstance(base, nn.Module) or base is model:
        return None
    prefix = next((f"{fqn}." for fqn, m in model.named_modules() if m is base and fqn), "")
    if not prefix:
        return None
    active = getattr(model, "active_adapters", None)
    names = tuple(active) if isinstance(active, (list, tuple)) else (next(iter(configs)),)
    first = configs.get(names[0]) if names else None
    method = getattr(getattr(first, "peft_type", None), "value", None) or str(
        getattr(first, "peft_type", "unknown")
    )
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return AdapterModel(base, prefix, str(method), names, trainable, frozen)


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Path of every adapted layer (a module holding the original as `base_layer`) → that
    base layer. Found by structure, so it also sees adapters injected into a plain model
    (`peft.inject_adapter_in_model`)."""
    out: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Module) and base is not module:
            out[fqn] = base
    return out


def saved_modules(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Path of every module peft trains as a copy (`modules_to_save`: a wrapper holding
    `original_module`, frozen, and `modules_to_save.<adapter>`, trained) → the paths of the
    original and of each copy, relative to the wrapper."""
    out: dict[str, tuple[str, ...]] = {}
    for fqn, module in model.named_modules():
        original = getattr(module, "original_module", None)
        copies = getattr(module, "modules_to_save", None)
        if isinstance(original, nn.Module) and isinstance(copies, nn.ModuleDict):
            out[fqn] = ("original_module", *(f"modules_to_save.{k}" for k in copies))
    return out
