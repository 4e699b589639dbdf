"""Mixed precision: one `Precision` value, translated from every form users bring.

Owns: the presets (`fp32`, `bf16`, `fp16`), their names from other frameworks, and
translation of torch's FSDP2 `MixedPrecisionPolicy` and FSDP1's `MixedPrecision`. Applying
a precision where FSDP2 does not cast (autocast) is parallelize/autocast.py.

Must not: touch models or process groups, or decide strategies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

PrecisionName = Literal["fp32", "bf16", "fp16"]
"""The presets' names (other frameworks' names for them, such as Lightning's 'bf16-mixed',
are accepted too)."""

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Which dtypes a wrapped model computes, reduces gradients and returns outputs in.

    `None` means "leave as is" (the parameters' own dtype), which is full fp32 for an
    fp32 model. Parameters are always *stored* (and updated by the optimizer) in their
    original dtype; only the compute copy is cast.
    """

    param_dtype: torch.dtype | None = None
    """dtype of the parameters during forward/backward compute."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced (averaged across ranks) in; fp32 keeps the sum exact."""
    output_dtype: torch.dtype | None = None
    """dtype the model's floating-point outputs are cast to, if set."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs to `param_dtype`."""

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype is not None and self.param_dtype != torch.float32

    def to_fsdp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=self.output_dtype,
            cast_forward_inputs=self.cast_forward_inputs,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            k: _dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in asdict(self).items()
        }

    def __str__(self) -> str:
        if not self.is_mixed and self.reduce_dtype in (None, torch.float32):
            return "fp32"
        return (
            f"param={_dtype_name(self.param_dtype)} reduce={_dtype_name(self.reduce_dtype)} "
            f"output={_dtype_name(self.output_dtype)}"
        )


PRESETS: dict[PrecisionName, Precision] = {
    "fp32": Precision(),
    "bf16": Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": Precision(param_dtype=torch.float16, reduce_dtype=torch.float32),
}

PrecisionSetting = (
    PrecisionName | Mapping[str, str | torch.dtype | bool | None] | Precision | MixedPrecisionPolicy
)
"""What `ParallelConfig.mixed_precision` takes, typed: a preset's name, a mapping of
param/reduce/output dtypes (and cast_forward_inputs), a `Precision`, or torch's
`MixedPrecisionPolicy`. At run time `resolve_precision` also takes None (fp32), other
frameworks' preset names and FSDP1's `MixedPrecision`."""

# Names from the frameworks users come from (Lightning's `precision=` strings).
_PRESET_ALIASES: dict[str, PrecisionName] = {
    "fp32": "fp32",
    "float32": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
}

_FIELD = "ParallelConfig.mixed_precision"


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def parse_dtype(value: object, field: str) -> torch.dtype | None:
    """A dtype from a `torch.dtype`, a name such as `"bf16"`/`"bfloat16"`, or None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ValueError(
        f"{field}={value!r} is not a floating-point dtype. "
        f"Use one of {sorted(set(_DTYPE_NAMES))}, a torch.dtype, or None."
    )


def resolve_precision(value: object) -> Precision:
    """Translate any accepted `mixed_precision` value into a `Precision`."""
    if isinstance(value, Precision):
        return value
    if value is None:
        return PRESETS["fp32"]
    if isinstance(value, str):
        key = _PRESET_ALIASES.get(value.lower())
        if key is None:
            raise ValueError(
                f"{_FIELD}={value!r} is not a known precision. "
                f"Use one of {sorted(_PRESET_ALIASES)}, or a mapping with param_dtype/"
                "reduce_dtype/output_dtype, or torch's MixedPrecisionPolicy."
            )
        return PRESETS[key]
    if isinstance(value, MixedPrecisionPolicy):
        return Precision(
            param_dtype=value.param_dtype,
            reduce_dtype=value.reduce_dtype,
            output_dtype=value.output_dtype,
            cast_forward_inputs=value.cast_forward_inputs,
        )
    if isinstance(value, Mapping):
        return _precision_from_mapping(value)
    fsdp1 = _from_fsdp1(value)
    if fsdp1 is not None:
        return fsdp1
    raise TypeError(
        f"{_FIELD} got {type(value).__name__}; expected a preset name ('fp32', 'bf16', "
        "'fp16'), a mapping of dtypes, shardwise.Precision, torch's MixedPrecisionPolicy "
        "or FSDP1's MixedPrecision."
    )


def _check_buffer_dtype(value: object, where: str) -> None:
    """FSDP1 (and mmengine's dict) cast buffers to buffer_dtype; FSDP2 never casts them.
    None or float32 is what FSDP2 does to fp32 buffers; anything else would differ."""
    dtype = parse_dtype(value, where)
    if dtype not in (None, torch.float32):
        raise ValueError(
            f"{where}={dtype} has no FSDP2 equivalent: FSDP2 keeps buffers in their own dtype "
            "(FSDP1 cast them). Use buffer_dtype=None or float32, and cast buffers that must "
            "be low precision yourself before wrapping (module.to(dtype) on those modules)."
        )


def _precision_from_mapping(value: Mapping[str, Any]) -> Precision:
    allowed = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs", "buffer_dtype"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"{_FIELD} has unknown key(s) {unknown}. Allowed keys: {sorted(allowed)}.")
    _check_buffer_dtype(value.get("buffer_dtype"), f"{_FIELD}.buffer_dtype")
    return Precision(
        param_dtype=parse_dtype(value.get("param_dtype"), f"{_FIELD}.param_dtype"),
        reduce_dtype=parse_dtype(value.get("reduce_dtype"), f"{_FIELD}.reduce_dtype"),
        output_dtype=parse_dtype(value.get("output_dtype"), f"{_FIELD}.output_dtype"),
        cast_forward_inputs=bool(value.get("cast_forward_inputs", True)),
    )


def _from_fsdp1(value: object) -> Precision | None:
    try:
        from torch.distributed.fsdp import MixedPrecision
    except ImportError:  # pragma: no cover - FSDP1 removed from torch
        return None
    if not isinstance(value, MixedPrecision):
        return None
    _check_buffer_dtype(value.buffer_dtype, f"{_FIELD}: FSDP1 MixedPrecision.buffer_dtype")
    if value.keep_low_precision_grads:
        raise ValueError(
            f"{_FIELD}: FSDP1 MixedPrecision(keep_low_precision_grads=True) has no FSDP2 "
            "equivalent: FSDP2 keeps gradients in the parameters' storage dtype (fp32), which "
            "the optimizer steps. Remove keep_low_precision_grads."
        )
    return Precision(
        param_dtype=value.param_dtype,
        reduce_dtype=value.reduce_dtype,
        # FSDP1 always cast the root's inputs; FSDP2 casts per unit when asked.
        cast_forward_inputs=bool(value.cast_forward_inputs or value.cast_root_forward_inputs),
    )
