"""The run file's optimizer section: which optimizer, its hyperparameters, and what it builds.

Owns: `OptimizerConfig` (adamw, adam, sgd and muon) and `FallbackConfig` (muon's optimizer for
what is not a hidden matrix), which keys each optimizer reads and its defaults for those not
given, and the checks of the values. A key is None until given, so a key that belongs only
to another optimizer (betas for muon, ns_steps for adamw) is refused at load time, and
switching `optimizer.name` on the command line keeps no other optimizer's defaults.

Muon is shardwise.Muon, from the train package, which sits above config: it registers
itself in `MATRIX_OPTIMIZERS` when shardwise is imported (shardwise/__init__.py imports it).

Must not: read environment variables or start anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shardwise.config.errors import ConfigError, check_choice

OptimizerName = Literal["adamw", "adam", "sgd", "muon"]
FallbackName = Literal["adamw", "adam", "sgd"]
NsDtypeName = Literal["bfloat16", "float32", "float64", "float16"]
AdjustLrName = Literal["original", "match_rms_adamw"]

MATRIX_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {}
"""Optimizers the train package supplies, by name: shardwise.Muon registers itself as 'muon'."""

_SHARED = ("name", "lr", "weight_decay")
_MUON_KEYS = (
    "momentum",
    "nesterov",
    "eps",
    "ns_steps",
    "ns_coefficients",
    "adjust_lr_fn",
    "ns_dtype",
    "fallback",
    "fallback_names",
    "matrix_names",
    "split_fused",
)
KEYS: dict[str, tuple[str, ...]] = {
    "adamw": ("betas", "eps"),
    "adam": ("betas", "eps"),
    "sgd": ("momentum",),
    "muon": _MUON_KEYS,
}
"""The keys each optimizer reads besides name, lr and weight_decay."""

DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8},
    "adam": {"weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8},
    "sgd": {"weight_decay": 0.0, "momentum": 0.0},
    # torch.optim.Muon's (and shardwise.Muon's) defaults
    "muon": {
        "weight_decay": 0.1,
        "momentum": 0.95,
        "nesterov": True,
        "eps": 1e-7,
        "ns_steps": 5,
        "ns_coefficients": (3.4445, -4.7750, 2.0315),
        "adjust_lr_fn": None,
        "ns_dtype": "bfloat16",
        "split_fused": False,
    },
}
"""What a key not given means, per optimizer."""


def _where_else(key: str, name: str, section: str) -> str:
    """Where a key given to the wrong optimizer belongs, as a fix."""
    if name == "muon" and key in KEYS["adamw"]:
        return (
            f" To set it for the fallback, write it under {section}.fallback "
            f"(fallback: {{name: adamw, {key}: ...}})."
        )
    owners = [n for n, keys in KEYS.items() if key in keys and n != name]
    return f" It is {' and '.join(owners)}'s: set {section}.name to use it." if owners else ""


def _check(section: str, name: str, given: dict[str, Any]) -> None:
    """Refuse keys `name` does not read and values out of range, one line each."""
    for key, value in given.items():
        if key in _SHARED or value is None:
            continue
        if key not in KEYS[name]:
            if isinstance(value, FallbackConfig):  # the keys given, not the whole dataclass
                value = {k: v for k, v in vars(value).items() if v is not None}
            raise ConfigError(
                f"{section}.{key}={value!r} is given, but {section}.name={name!r} has no {key} "
                f"(it reads {[*_SHARED[1:], *KEYS[name]]}). Remove it."
                + _where_else(key, name, section)
            )
    for key in ("weight_decay", "eps", "momentum"):
        value = given.get(key)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{section}.{key}={value} must be a finite number >= 0.")
    if name == "muon" and given.get("momentum") is not None and given["momentum"] >= 1:
        raise ConfigError(
            f"{section}.momentum={given['momentum']} must be in [0, 1) for muon (the momentum "
            "buffer's decay; 1 never takes a gradient in). Use e.g. momentum: 0.95."
        )
    for i, beta in enumerate(given.get("betas") or ()):
        if not 0 <= beta < 1:
            raise ConfigError(
                f"{section}.betas[{i}]={beta} must be in [0, 1) (a moment decay rate; "
                "1 never forgets and divides by zero in the bias correction). Use e.g. "
                "betas: [0.9, 0.95]."
            )


def _elementwise(
    name: str, params: list[torch.nn.Parameter], lr: float, given: dict[str, Any]
) -> torch.optim.Optimizer:
    s = {**DEFAULTS[name], **{k: v for k, v in given.items() if v is not None}}
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=s["momentum"], weight_decay=s["weight_decay"]
        )
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=s["betas"], eps=s["eps"], weight_decay=s["weight_decay"])


@dataclass(kw_only=True)
class FallbackConfig:
    """Muon's optimizer for what is not a hidden matrix (embeddings, output heads, norms,
    biases, MoE routers). Its keys mean what the optimizer section's mean for that name."""

    name: FallbackName = "adamw"
    """Optimizer class: an elementwise one."""
    lr: float | None = None
    """Its learning rate (None: optimizer.lr, Muon's)."""
    weight_decay: float | None = None
    """None: 0."""
    betas: tuple[float, float] | None = None
    """adamw and adam (None: [0.9, 0.95])."""
    eps: float | None = None
    """adamw and adam (None: 1e-8)."""
    momentum: float | None = None
    """sgd (None: 0)."""

    def __post_init__(self) -> None:
        check_choice(self.name, FallbackName, "optimizer.fallback.name")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(
                f"optimizer.fallback.lr={self.lr} must be a finite number > 0, or null for "
                "optimizer.lr."
            )
        _check("optimizer.fallback", self.name, vars(self))

    def factory(self, lr: float) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        """Builds this optimizer over the parameters Muon passes it (`lr`: Muon's, unless
        this section sets its own)."""
        given = dict(vars(self))
        return lambda params: _elementwise(
            self.name, list(params), self.lr if self.lr is not None else lr, given
        )


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer built after wrapping (Engine gets `config.build`). A key an optimizer
    does not read is refused; one not given takes that optimizer's default."""

    name: OptimizerName = "adamw"
    """Optimizer class. 'muon': shardwise.Muon for hidden matrices (docs/optimizers.md),
    with the fallback for the rest."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float | None = None
    """Decoupled (adamw, muon) or L2 (adam, sgd) weight decay (None: 0; 0.1 for muon, as
    torch)."""
    betas: tuple[float, float] | None = None
    """adamw and adam: the moment decay rates (None: [0.9, 0.95])."""
    eps: float | None = None
    """adamw and adam: the term added to the denominator (None: 1e-8); muon: Newton–Schulz's
    floor on the norm (None: 1e-7)."""
    momentum: float | None = None
    """sgd: momentum (None: 0); muon: the momentum buffer's decay, in [0, 1) (None: 0.95)."""
    nesterov: bool | None = None
    """muon: Nesterov momentum (None: true)."""
    ns_steps: int | None = None
    """muon: Newton–Schulz iterations, 0 to 99 (None: 5)."""
    ns_coefficients: tuple[float, float, float] | None = None
    """muon: Newton–Schulz's quintic coefficients a, b, c (None: [3.4445, -4.775, 2.0315])."""
    adjust_lr_fn: AdjustLrName | None = None
    """muon: the learning rate per matrix shape, as torch names it (None: 'original')."""
    ns_dtype: NsDtypeName | None = None
    """muon: Newton–Schulz's dtype (None: bfloat16, as torch; float32 for parity checks)."""
    fallback: FallbackConfig | None = None
    """muon: the optimizer for what is not a hidden matrix, a section with keys name, lr,
    weight_decay, betas, eps, momentum (None: adamw with optimizer.lr and adamw's defaults
    above)."""
    fallback_names: list[str] | None = None
    """muon: regular expressions; a parameter whose name matches goes to the fallback
    (None: embeddings, output heads, norms, MoE routers)."""
    matrix_names: list[str] | None = None
    """muon: regular expressions keeping a matching 2-D parameter on Muon whatever its name."""
    split_fused: bool | None = None
    """muon: orthogonalise fused projections per block (qkv_proj as q, k, v; gate_up_proj as
    its halves), the split read from the model's config (None: false)."""

    def __post_init__(self) -> None:
        check_choice(self.name, OptimizerName, "optimizer.name")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(
                f"optimizer.lr={self.lr} must be a finite number > 0 (a peak learning rate "
                "such as 3e-4)."
            )
        _check("optimizer", self.name, vars(self))
        if self.ns_steps is not None and not 0 <= self.ns_steps < 100:
            raise ConfigError(
                f"optimizer.ns_steps={self.ns_steps} must be an int from 0 to 99 (torch: 5)."
            )
        if self.ns_coefficients is not None and not all(
            math.isfinite(c) for c in self.ns_coefficients
        ):
            raise ConfigError(
                f"optimizer.ns_coefficients={list(self.ns_coefficients)} must be three finite "
                "numbers a, b, c, e.g. [3.4445, -4.775, 2.0315]."
            )
        if self.adjust_lr_fn is not None:
            check_choice(self.adjust_lr_fn, AdjustLrName, "optimizer.adjust_lr_fn")
        if self.ns_dtype is not None:
            check_choice(self.ns_dtype, NsDtypeName, "optimizer.ns_dtype")
        for key in ("fallback_names", "matrix_names"):
            for i, pattern in enumerate(getattr(self, key) or ()):
                _check_pattern(pattern, f"optimizer.{key}[{i}]")

    def setting(self, key: str) -> Any:
        """`key` as given, or this optimizer's default for it."""
        value = getattr(self, key)
        return DEFAULTS[self.name].get(key) if value is None else value

    def muon_arguments(self) -> dict[str, Any]:
        """shardwise.Muon's keyword arguments for this section (name 'muon')."""
        out = {
            key: self.setting(key)
            for key in (
                "weight_decay",
                "momentum",
                "nesterov",
                "eps",
                "ns_steps",
                "adjust_lr_fn",
                "split_fused",
            )
        }
        out["ns_coefficients"] = tuple(self.setting("ns_coefficients"))
        out["ns_dtype"] = getattr(torch, self.setting("ns_dtype"))
        out["fallback"] = (self.fallback or FallbackConfig()).factory(self.lr)
        for key in ("fallback_names", "matrix_names"):
            if getattr(self, key) is not None:
                out[key] = tuple(getattr(self, key))
        return {"lr": self.lr, **out}

    def build(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The optimizer over `params` (muon also takes `model.named_parameters()`; through
        the Engine it reads the names itself)."""
        if self.name == "muon":
            build = MATRIX_OPTIMIZERS.get("muon")
            if build is None:  # only when shardwise.train was never imported
                raise ConfigError(
                    "optimizer.name='muon' needs shardwise.Muon: import shardwise first."
                )
            return build(params, **self.muon_arguments())
        given = {k: getattr(self, k) for k in ("weight_decay", *KEYS[self.name])}
        return _elementwise(self.name, list(params), self.lr, given)


def _check_pattern(pattern: object, where: str) -> None:
    if not isinstance(pattern, str):
        raise ConfigError(f"{where}={pattern!r} must be a regular expression (a string).")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ConfigError(
            f"{where}={pattern!r} is not a regular expression ({exc}); escape special "
            r"characters, e.g. 'lm_head\.weight'."
        ) from None
