"""Mixed precision where FSDP2 does not cast: an unwrapped model at world size 1, or DDP.

Owns: running a model's forward under torch.autocast for a `Precision`, once per model,
casting its floating-point outputs to `output_dtype`, and the one-line advice when a CUDA
job trains in full fp32 with TF32 off (shardwise never changes torch's matmul precision:
that would change the numbers a user's parity checks see).

Must not: decide precisions (config/precision.py reads them) or touch process groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.config.precision import Precision

_AUTOCAST_ATTR = "_shardwise_autocast"


def apply_autocast(model: nn.Module, precision: Precision, device_type: str) -> nn.Module:
    """Run `model.forward` under autocast for `precision` (no-op for fp32).

    Used where FSDP2 does not cast (world size 1, DDP). Autocast keeps the stored
    parameters in fp32 and computes matmuls in low precision, with reductions such
    as LayerNorm and softmax in fp32 — close to, but not identical with, FSDP2's
    whole-parameter cast. The model keeps its class and state_dict keys.
    """
    if not precision.is_mixed:
        return model
    if getattr(model, _AUTOCAST_ATTR, False):
        return model
    original: Callable[..., Any] = model.forward
    dtype = precision.param_dtype
    output_dtype = precision.output_dtype

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = original(*args, **kwargs)
        if output_dtype is not None:
            out = _cast_floating(out, output_dtype)
        return out

    model.forward = forward
    setattr(model, _AUTOCAST_ATTR, True)
    return model


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        items = [_cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def tf32_advice(device_type: str, precision: Precision, matmul_precision: str) -> str | None:
    """What to say when a CUDA job computes in fp32 with TF32 off (torch's default,
    float32 matmul precision 'highest'): its matmuls then run without tensor cores."""
    if device_type != "cuda" or precision.is_mixed or matmul_precision != "highest":
        return None
    return (
        "shardwise: this CUDA job computes in fp32 with TF32 off (torch's default), so its "
        "matmuls run without tensor cores, several times slower on an H100. For TF32 call "
        "torch.set_float32_matmul_precision('high') before training (inputs rounded to a "
        "10-bit mantissa), or train in ParallelConfig(mixed_precision='bf16')."
    )
