"""Tensor parallelism through an adapter model's nesting (PEFT's LoRA).

peft moves every name of the base model under a prefix (`base_model.model.`) and turns each
adapted linear into a wrapper holding the original as `base_layer` beside two small linears,
`lora_A.<adapter>` (rank x in) and `lora_B.<adapter>` (out x rank), whose product is added to
the base layer's output. A plan written for the base model therefore matches nothing in the
peft model, and applied to the wrapper it would split a module torch's styles do not know.

Owns: the plan of a peft model (`adapter_plan`): the base model's own plan moved under the
prefix, a module trained as a copy (`modules_to_save`) split like its original, and each
adapted layer's entry given to its base layer and its adapters so that the adapter's output
has the base layer's layout:

- a column-split base (output features split): `lora_B` is split the same way (its rows)
  and `lora_A` stays whole. lora_B's input is whole on every rank, so torch's column style
  sums the gradient flowing back into lora_A over tp, as it does for the base layer's input;
- a row-split base (input features split, outputs summed over tp): `lora_A` is split on its
  input features and its partial outputs are summed over tp (torch's row style), and
  `lora_B` stays whole.

Refused with the reason: adapters of another kind than LoRA's two linears (DoRA's magnitude
needs the norm of the whole weight row, IA³ scales split features), adapters on an
embedding or on experts, and sequence parallelism over an adapted layer.

Must not: write collectives (torch's styles do), or plan anything but adapted layers (the
rest of the plan is tensor.py's).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from shardwise.plan.adapters import AdapterModel, adapted_layers, saved_modules

__all__ = ["adapter_plan", "base_plan", "lora_a_style", "lora_b_style"]

_LORA_PARTS = ("base_layer", "lora_A", "lora_B", "lora_dropout")


def base_plan(found: AdapterModel) -> dict[str, object] | None:
    """The base model's own plan (`_tp_plan`) with every pattern moved under the prefix."""
    own = getattr(found.base, "_tp_plan", None)
    if not isinstance(own, Mapping) or not own:
        return None
    return {f"{found.prefix}{k}": v for k, v in own.items()}


def adapter_plan(
    model: nn.Module, per_module: dict[str, ParallelStyle], sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """`per_module` (one style per module name) with each adapted layer's entry replaced by
    entries for its base layer and its LoRA linears; unchanged for a model without adapters."""
    adapted, saved = adapted_layers(model), saved_modules(model)
    if not adapted and not saved:
        return per_module
    out: dict[str, ParallelStyle] = {}
    for name, style in per_module.items():
        if name in saved:  # the frozen original and each trained copy split alike
            out.update({f"{name}.{part}": style for part in saved[name]})
            continue
        if name not in adapted:
            out[name] = style
            continue
        wrapper = model.get_submodule(name)
        _check_adapted(name, wrapper, style, sequence_parallel)
        out[f"{name}.base_layer"] = style
        for adapter in wrapper.lora_A:  # type: ignore[union-attr]
            if isinstance(style, ColwiseParallel):
                out[f"{name}.lora_B.{adapter}"] = lora_b_style(style)
            else:
                assert isinstance(style, RowwiseParallel)
                out[f"{name}.lora_A.{adapter}"] = lora_a_style(style)
    return out


def lora_b_style(base: ColwiseParallel) -> ParallelStyle:
    """lora_B under a column-split base: its rows split as the base's output features, its
    input (lora_A's output) whole on every rank, its output laid out as the base's."""
    return ColwiseParallel(
        input_layouts=Replicate(),
        output_layouts=base.output_layouts[0],
        use_local_output=base.use_local_output,
    )


def lora_a_style(base: RowwiseParallel) -> ParallelStyle:
    """lora_A under a row-split base: its columns split as the base's input features, its
    partial products summed over tp (lora_B then sees the whole low-rank activation)."""
    return RowwiseParallel(
        input_layouts=base.input_layouts[0], output_layouts=Replicate(), use_local_output=True
    )


def _check_adapted(name: str, wrapper: nn.Module, style: ParallelStyle, sp: bool) -> None:
    parts = {n for n, _ in wrapper.named_children()}
    kind = type(wrapper).__name__
    lora = {"lora_A", "lora_B", "base_layer"} <= parts
    extra = sorted(
        n
        for n, m in wrapper.named_children()
        if n not in _LORA_PARTS and any(True for _ in m.parameters())
    )
    params = sorted(n for n, _ in wrapper.named_parameters(recurse=False))
    if not lora or extra or params:
        what = extra or params or sorted(parts)
        raise NotImplementedError(
            f"ParallelConfig.tp with adapters: {name} ({kind}) holds {what}, which shardwise "
            "cannot split with its base layer yet (it splits LoRA's two linears: lora_B with "
            "a column-split base, lora_A with a row-split one; DoRA's magnitude needs the "
            "norm of each whole weight row and IA³ scales split features). Use plain LoRA "
            "with tp, or tp=1 for this method."
        )
    if not isinstance(wrapper.base_layer, nn.Linear):
        raise NotImplementedError(
            f"ParallelConfig.tp with adapters: {name} adapts a "
            f"{type(wrapper.base_layer).__name__}; shardwise splits adapters on linear layers "
            "only. Leave it out of the adapter's target_modules, or use tp=1."
        )
    if not isinstance(style, ColwiseParallel | RowwiseParallel):
        raise NotImplementedError(
            f"ParallelConfig.tp with adapters: {name} is planned as {type(style).__name__}; "
            "shardwise splits an adapter only with a column or row split of its base layer. "
            "Leave it out of the adapter's target_modules, or out of the tp plan."
        )
    if sp:
        raise NotImplementedError(
            f"ParallelConfig.sequence_parallel with adapters: {name} is adapted, and its "
            "adapter's output would have to follow the sequence split of its base layer, "
            "which shardwise does not build yet. Use sequence_parallel=False (tp alone "
            "splits the adapted layers)."
        )
