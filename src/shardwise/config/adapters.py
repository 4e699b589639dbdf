"""The run file's `adapter` section: LoRA on a model, from a few keys.

`AdapterConfig` is what `adapter:` in a run file holds (rank, alpha, dropout, the layers to
adapt, the modules trained whole). `apply_adapter(model, config)` turns the model into a
peft model (`peft.get_peft_model`) before it is wrapped: the Engine calls it when given
`adapter=`, so one section in the YAML turns a full fine-tune into a LoRA one. Without the
section (None) the model is returned as it is.

peft is imported only here and only when a section is applied: `import shardwise` does not
need it, and applying one without it installed is an ImportError naming the extra
(`pip install shardwise[peft]`).

Owns: the section's fields and their checks, the translation into peft's `LoraConfig`, and
the checks peft itself does not make before it changes the model (a name in
`target_modules` that matches no layer, a model that already has adapters, a model on the
meta device).

Must not: import peft at module level, wrap, or import any other shardwise package.
"""

from __future__ import annotations

import importlib
import math
import types
from dataclasses import dataclass
from typing import ClassVar, Literal, cast, get_args

from torch import nn

from shardwise.config.names import closest

AdapterMethod = Literal["lora"]
"""The peft methods the section applies."""

PEFT_INSTALL = "pip install shardwise[peft]"
_ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Layers LoRA adapts, whose names `target_modules` suggests."""


@dataclass(kw_only=True)
class AdapterConfig:
    """LoRA adapters added to the model before wrapping (peft's `get_peft_model`)."""

    method: AdapterMethod = "lora"
    """peft's method: 'lora' (with use_dora for DoRA)."""
    r: int = 8
    """Rank of each adapter (peft's r)."""
    alpha: float = 16.0
    """Scale numerator (peft's lora_alpha): the adapter's output is multiplied by alpha / r
    (alpha / sqrt(r) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on each adapter's input (peft's lora_dropout), in [0, 1)."""
    target_modules: list[str] | str | None = None
    """Layers to adapt: names matched against the end of each module's path (['q_proj',
    'v_proj']), one regular expression matched against the whole path, or 'all-linear'.
    None: peft's default for the model's architecture (a transformers model's attention
    projections); a model peft does not know needs the names. A listed name that matches no
    layer is an error."""
    modules_to_save: list[str] | None = None
    """Modules trained whole beside the adapters (a classifier head: ['score']); peft keeps
    a trained copy of each."""
    use_dora: bool = False
    """DoRA: adapters that also learn each weight row's magnitude."""
    use_rslora: bool = False
    """Rank-stabilised scale alpha / sqrt(r) instead of alpha / r."""

    KNOWN_AS: ClassVar[dict[str, str]] = {
        "rank": "r",
        "lora_r": "r",
        "lora_alpha": "alpha",
        "lora_dropout": "dropout",
        "target_layers": "target_modules",
        "dora": "use_dora",
        "rslora": "use_rslora",
    }
    """peft's and other tools' names for these keys, for the run file's 'Did you mean'."""

    def __post_init__(self) -> None:
        if self.method not in get_args(AdapterMethod):
            raise ValueError(
                f"AdapterConfig.method={self.method!r} is not a method the adapter section "
                f"applies.{closest(str(self.method), get_args(AdapterMethod))} Choose one of "
                f"{list(get_args(AdapterMethod))} (use_dora=True for DoRA), or build the peft "
                "model yourself and pass it to the Engine without the section."
            )
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"AdapterConfig.r={self.r!r} must be an int >= 1 (e.g. 8 or 16).")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(
                f"AdapterConfig.alpha={self.alpha!r} must be a finite number > 0 (often 2 * r)."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"AdapterConfig.dropout={self.dropout!r} must be in [0, 1).")
        targets = self.target_modules
        if isinstance(targets, list) and (
            not targets or not all(isinstance(t, str) and t for t in targets)
        ):
            raise ValueError(
                f"AdapterConfig.target_modules={targets!r} must be a non-empty list of layer "
                "names (['q_proj', 'v_proj']), a regular expression, 'all-linear', or None."
            )
        if isinstance(targets, str) and not targets:
            raise ValueError("AdapterConfig.target_modules='' names no layer.")

    def peft_config(self) -> object:
        """peft's `LoraConfig` for this section (imports peft)."""
        peft = _import_peft()
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        return peft.LoraConfig(
            r=self.r,
            lora_alpha=alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            modules_to_save=self.modules_to_save,
            use_dora=self.use_dora,
            use_rslora=self.use_rslora,
        )


def _import_peft() -> types.ModuleType:
    try:
        return importlib.import_module("peft")
    except ImportError:
        raise ImportError(
            f"The run file's adapter section needs peft, which is not installed: "
            f"`{PEFT_INSTALL}` (or `pip install peft`). Or remove the section to train "
            "the whole model."
        ) from None


def _layer_names(model: nn.Module) -> list[str]:
    """The last part of each adaptable layer's path ('qkv', 'proj', ...), in model order."""
    names: dict[str, None] = {}
    for fqn, module in model.named_modules():
        if fqn and isinstance(module, _ADAPTABLE):
            names[fqn.rpartition(".")[2]] = None
    return list(names)


def _check_targets(model: nn.Module, targets: list[str] | str | None, key: str) -> None:
    """Every listed name matches some module (peft's rule: the whole path, or its end after
    a dot). peft refuses only a list that matches nothing; one name of three mistyped would
    silently leave its layers out."""
    if not isinstance(targets, list):
        return
    paths = [fqn for fqn, _ in model.named_modules() if fqn]
    layers = _layer_names(model)
    for name in targets:
        if not any(p == name or p.endswith(f".{name}") for p in paths):
            raise ValueError(
                f"AdapterConfig.{key}: {name!r} matches no module of this "
                f"{type(model).__name__}.{closest(name, layers)} Its adaptable layers are "
                f"named {layers[:20]}."
            )


def apply_adapter(model: nn.Module, config: AdapterConfig | None) -> nn.Module:
    """`model` with `config`'s adapters (peft's `get_peft_model`; its base frozen), or
    `model` itself when `config` is None. Call it before wrapping: the Engine does when
    given `adapter=`. The adapters' initial values are drawn from torch's RNG, so seed
    before calling it for the same adapters on every run."""
    if config is None:
        return model
    existing = getattr(model, "peft_config", None)
    if isinstance(existing, dict):
        raise ValueError(
            f"AdapterConfig: this {type(model).__name__} already has adapters "
            f"({sorted(existing)}): the adapter section would add a second set. Remove the "
            "section and pass the peft model as it is, or pass its base model."
        )
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"AdapterConfig: the {type(model).__name__} is on the meta device. peft "
            "initialises each adapter so that it starts as no change (lora_B = 0), which "
            "materialising the model after wrapping would not keep. Build the base with its "
            "weights first (e.g. shardwise.load_weights into an eagerly built model), then "
            "add the adapters."
        )
    _check_targets(model, config.target_modules, "target_modules")
    _check_targets(model, config.modules_to_save, "modules_to_save")
    peft = _import_peft()
    try:
        return cast(nn.Module, peft.get_peft_model(model, config.peft_config()))
    except ValueError as exc:
        if config.target_modules is None and "target_modules" in str(exc):
            raise ValueError(
                f"AdapterConfig.target_modules=None: peft has no default layers for a "
                f"{type(model).__name__} ({exc}). Name them, e.g. target_modules: "
                f"{_layer_names(model)[:3]}, or 'all-linear'."
            ) from None
        raise ValueError(f"AdapterConfig: peft refused the adapter section: {exc}") from None
