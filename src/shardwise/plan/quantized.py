"""Quantized bases (bitsandbytes' 4-bit and 8-bit layers, as QLoRA uses them): what they
are, what they weigh, and which layouts they cannot take, read without importing
bitsandbytes.

A 4-bit layer (`Linear4bit`, and its `LinearNF4`/`LinearFP4` subclasses) holds its weight
as a `Params4bit`: the 4-bit codes packed two to a byte into one flat column,
`(out * in / 2, 1)` bytes, viewed in its storage dtype (`bnb_4bit_quant_storage`: uint8
by default, or a float dtype, which only changes how many elements the bytes make). What
is needed to read the codes back (one absmax per block of 64 values, the code book, the
logical shape) is a `QuantState` held beside the tensor, as `weight.quant_state` and as the
layer's own `quant_state`, not as a parameter or buffer. An 8-bit layer (`Linear8bitLt`)
holds an `Int8Params` weight, with its row scales (`SCB`) as an attribute of the tensor.

What FSDP2 (`fully_shard`) does with them, found by trying (CPU, gloo, bitsandbytes 0.50):
it replaces each weight by a DTensor over a plain tensor of the same dtype and numel, so
the quant_state survives only on the layer (bitsandbytes' `Linear4bit.forward` restores it
from there on every forward) and `Int8Params`' scales are lost; and under a mixed
precision it casts every *floating* parameter to `param_dtype` before computing, which for
packed codes stored as float converts the bit patterns as numbers. Integer storage
(uint8) is never cast, which is why wrap holds every 4-bit weight's codes as uint8.

Owns: recognising quantized parameters (`quantized_params` → `QuantizedParam`), their
bytes, also before they are quantized: the packed codes, which sharding divides
(`stored_bytes`), and the quant_state, which every rank holds whole
(`quant_state_bytes`); and the refusals, checked before any mesh exists, identically on every
rank (`check_quantized`).

Must not: import bitsandbytes, change the model (parallelize/quantized.py prepares it), or
plan units (planner.py does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.config.parallel import ParallelConfig

__all__ = [
    "QuantizedParam",
    "check_quantized",
    "quant_state_bytes",
    "quant_state_tensors",
    "quantized_layers",
    "quantized_params",
    "stored_bytes",
]

_4BIT = "Params4bit"
_8BIT = "Int8Params"
_NESTED_BLOCK = 256  # bitsandbytes quantizes the absmax of a nested state in blocks of 256


def _kind(p: torch.Tensor) -> int:
    """4 or 8 for bitsandbytes' quantized parameter classes (subclasses too), else 0."""
    names = {c.__name__ for c in type(p).__mro__}
    return 4 if _4BIT in names else 8 if _8BIT in names else 0


@dataclass(frozen=True)
class QuantizedParam:
    """One quantized weight, as the model holds it now."""

    name: str
    """Its path in the model ('...q_proj.base_layer.weight')."""
    module: str
    """The layer holding it ('...q_proj.base_layer')."""
    bits: int
    """4 (Params4bit) or 8 (Int8Params)."""
    storage: str
    """The dtype the codes are stored in ('uint8', 'bfloat16', ...; 'int8' for 8-bit)."""
    shape: tuple[int, ...]
    """The logical (dequantized) shape, (out, in) for a linear layer."""
    quantized: bool
    """False while bitsandbytes has not quantized it yet (it does on the first move to a
    device, or when from_pretrained loads it): the tensor is then still full precision."""
    cpu_packed: bool
    """bitsandbytes repacked it for its CPU inference kernel (an eval forward without
    gradients on a CPU with AVX512-BF16); training through it fails."""
    requires_grad: bool

    @property
    def floating_storage(self) -> bool:
        return bool(getattr(torch, self.storage).is_floating_point)


def _logical_shape(p: torch.Tensor) -> tuple[int, ...]:
    state = getattr(p, "quant_state", None)
    shape = getattr(state, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else tuple(p.shape)


def quantized_params(model: nn.Module) -> list[QuantizedParam]:
    """Every bitsandbytes-quantized parameter of `model` (4-bit and 8-bit), in model order;
    empty for any other model. Shared parameters are listed once."""
    out = []
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            bits = _kind(p)
            if not bits:
                continue
            state = getattr(p, "quant_state", None)
            quantized = bool(getattr(p, "bnb_quantized", True)) if bits == 4 else True
            stored = p.dtype if quantized else getattr(p, "quant_storage", torch.uint8)
            storage = str(stored).removeprefix("torch.")
            out.append(
                QuantizedParam(
                    name=f"{module_name}.{local}" if module_name else local,
                    module=module_name,
                    bits=bits,
                    storage=storage,
                    shape=_logical_shape(p) if quantized else tuple(p.shape),
                    quantized=quantized,
                    cpu_packed=bool(getattr(state, "packing_format_for_cpu", False)),
                    requires_grad=p.requires_grad,
                )
            )
    return out


_LAYERS = ("Linear4bit", "Linear8bitLt")


def quantized_layers(model: nn.Module) -> list[str]:
    """Paths of bitsandbytes' quantized layers, by class: found also after fully_shard,
    which swaps their weights for plain DTensor parameters."""
    return [
        fqn
        for fqn, m in model.named_modules()
        if any(c.__name__ in _LAYERS for c in type(m).__mro__)
    ]


def quant_state_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a 4-bit parameter's quant_state (absmax, code book, and a nested
    state's offset, absmax and code book); the row scales of an 8-bit one; else none."""
    state = getattr(p, "quant_state", None)
    if _kind(p) == 8:
        scb = getattr(p, "SCB", None)
        return [scb] if isinstance(scb, torch.Tensor) else []
    if state is None:
        return []
    found = [getattr(state, "absmax", None), getattr(state, "code", None)]
    if getattr(state, "nested", False):
        inner = getattr(state, "state2", None)
        found += [getattr(state, "offset", None), getattr(inner, "absmax", None)]
        found.append(getattr(inner, "code", None))
    return [t for t in found if isinstance(t, torch.Tensor)]


def _add(into: dict[str, int], dtype: torch.dtype | str, n: int) -> None:
    key = str(dtype).removeprefix("torch.")
    into[key] = into.get(key, 0) + n


def _unquantized(p: torch.Tensor) -> bool:
    return _kind(p) == 4 and not getattr(p, "bnb_quantized", True)


def stored_bytes(p: torch.Tensor) -> dict[str, int]:
    """Bytes of `p`'s own storage, by dtype name, which sharding divides. A 4-bit weight not
    quantized yet (built on the meta device, or not moved to a device, so still holding
    its full-precision values) is counted as it will be: its codes packed two to a byte,
    in its storage dtype."""
    out: dict[str, int] = {}
    if _unquantized(p):
        _add(out, getattr(p, "quant_storage", torch.uint8), math.ceil(p.numel() / 2))
    else:
        _add(out, p.dtype, p.numel() * p.element_size())
    return out


def quant_state_bytes(p: torch.Tensor) -> dict[str, int]:
    """Bytes of a quantized weight's quant_state (its 8-bit row scales), by dtype name; empty
    for any other parameter. Every rank holds them whole: they live on the layer, not in a
    parameter, so fully_shard does not shard them. A 4-bit weight not quantized yet is
    counted as it will be: one fp32 absmax per block of `blocksize` values (nested: one
    uint8 per block, an fp32 offset, an fp32 absmax per 256 blocks and their 256-entry
    code book), and the 16-entry code book."""
    out: dict[str, int] = {}
    if _unquantized(p):
        blocks = math.ceil(p.numel() / int(getattr(p, "blocksize", 64) or 64))
        _add(out, torch.float32, 16 * 4)
        if getattr(p, "compress_statistics", False):
            _add(out, torch.uint8, blocks)
            _add(out, torch.float32, 4 + 4 * math.ceil(blocks / _NESTED_BLOCK) + 256 * 4)
        else:
            _add(out, torch.float32, 4 * blocks)
        return out
    for t in quant_state_tensors(p):
        _add(out, t.dtype, t.numel() * t.element_size())
    return out


# --------------------------------------------------------------------------- refusals


TORCH_VERSION = torch.__version__
"""The torch release the refusals judge (a module value, so a test can name another)."""


def fsdp_holds_bytes(version: str | None = None) -> bool:
    """Whether fully_shard takes a frozen uint8 parameter: from torch 2.12 its shards keep
    the parameter's requires_grad; 2.11 made each shard require grad, which an integer
    tensor cannot (measured on an H200 with torch 2.11)."""
    release = (version or TORCH_VERSION).split("+")[0].split(".")[:2]
    return tuple(int("".join(c for c in x if c.isdigit()) or 0) for x in release) >= (2, 12)


def _where(found: list[QuantizedParam]) -> str:
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return f"{found[0].name} ({found[0].bits}-bit, stored as {found[0].storage}){more}"


def check_quantized(
    model: nn.Module, config: ParallelConfig, *, sharded: bool, on_meta: bool = False
) -> list[QuantizedParam]:
    """Refuse what cannot train a quantized base correctly, before any mesh or collective;
    return the quantized parameters (empty: nothing to check). `sharded`: the strategy
    will be applied (world size above 1, or force_wrap). Codes stored in any dtype are
    taken: wrap holds them as bytes (parallelize/quantized.py), which nothing casts."""
    found = quantized_params(model)
    if not found:
        return found
    trainable = [q for q in found if q.requires_grad]
    if trainable:
        raise ValueError(
            f"shardwise.wrap: quantized weight {_where(trainable)} requires grad. Its codes "
            "cannot train (bitsandbytes computes no gradient for them; an optimizer or FSDP "
            "would treat the packed bytes as numbers). Freeze the base: "
            "peft.prepare_model_for_kbit_training(model) or p.requires_grad_(False) for "
            "each, and train adapters on top."
        )
    packed = [q for q in found if q.cpu_packed]
    if packed:
        raise ValueError(
            f"shardwise.wrap: quantized weight {_where(packed)} was repacked by bitsandbytes "
            "for its CPU inference kernel (an eval-mode forward without gradients on a CPU "
            "with AVX512-BF16), a layout its training path cannot read (backward fails). "
            "Load the model again and wrap it before any eval forward: wrap turns that "
            "repacking off for the layers it wraps."
        )
    if on_meta:
        raise NotImplementedError(
            f"shardwise.wrap: {_where(found)} is quantized, on the meta device. "
            "bitsandbytes quantizes real values as they are loaded, which shardwise's "
            "materialisation (initialisers, or weights= of full-precision safetensors) "
            "does not do. Load the quantized model on the CPU or the rank's device "
            "(from_pretrained(..., quantization_config=BitsAndBytesConfig(...))) and wrap that."
        )
    if config.tp != 1:
        four = [q for q in found if q.bits == 4] or found
        raise NotImplementedError(
            f"ParallelConfig.tp={config.tp!r} over a quantized base ({_where(four)}): tp "
            "splits each weight by its rows or columns, but a 4-bit weight is stored as one "
            "flat column of packed codes with one scale per block of 64 values (an 8-bit "
            "one with one scale per row, which torch's styles do not split), so neither "
            "split exists without dequantizing. Use tp=1: full_shard or hybrid_shard shard "
            "the packed base instead, or tp over a base that is not quantized."
        )
    eight = [q for q in found if q.bits == 8]
    if sharded and eight and config.strategy != "ddp":
        raise NotImplementedError(
            f"ParallelConfig.strategy={config.strategy!r} over an 8-bit base "
            f"({_where(eight)}): fully_shard replaces each Int8Params by a plain parameter, "
            "which drops the row scales (SCB) that bitsandbytes' 8-bit matmul reads (the "
            "first forward fails: 'Parameter' object has no attribute 'CB'). Use "
            "strategy='ddp' (each rank holds the whole 8-bit base), or a 4-bit base "
            "(load_in_4bit=True), which every sharded strategy takes."
        )
    four = [q for q in found if q.bits == 4 and q.quantized]
    if sharded and four and (config.strategy != "ddp" or config.ep > 1) and not fsdp_holds_bytes():
        raise NotImplementedError(
            f"ParallelConfig.strategy={config.strategy!r} over a 4-bit base "
            f"({_where(four)}) needs torch >= 2.12: torch {TORCH_VERSION}'s fully_shard "
            "makes every shard a parameter that requires grad, which the codes (held as "
            "the bytes they are) cannot ('only Tensors of floating point dtype can require "
            "gradients'). Upgrade torch, or use strategy='ddp' (each rank holds the whole "
            "4-bit base)."
        )
    unquantized = [q for q in found if not q.quantized]
    if sharded and unquantized and config.strategy != "ddp":
        raise ValueError(
            f"shardwise.wrap: 4-bit weight {_where(unquantized)} is not quantized yet "
            "(bitsandbytes quantizes a Params4bit when it is first moved to a device), and "
            "sharding moves each shard's data itself, so the full-precision weight would "
            "be sharded and the layer would fail at its first forward. Quantize it before "
            "wrap: model.to(device), or load it with from_pretrained(..., "
            "quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))."
        )
    return found
