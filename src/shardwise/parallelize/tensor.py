"""Tensor parallelism: a model's plan applied with torch's `parallelize_module`, before sharding.

Owns: reading a plan (a Hugging Face model's own `_tp_plan`, a dict, or a callable), turning
plan words into torch's ParallelStyles (an experts module's entries into moe.py's one style),
the checks a plan needs before any forward (every pattern names a module, or a parameter of
a 'moe_tp_experts' module; attention heads, KV heads, the intermediate sizes and a split
vocabulary divide by tp; tied weights stay tied), the output head under loss_parallel,
applying the plan over the mesh's tp dimension, and the one check that needs a backward
(`check_whole_gradients`: no parameter the plan leaves whole sits between split layers).

Must not: write sharding or collectives (`parallelize_module` and DTensor do), or touch the
data-parallel dimensions (fsdp.py shards over those, after this).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.config.parallel import ParallelConfig
from shardwise.config.tensor_parallel import TP_STYLE_NAMES
from shardwise.distributed.mesh import EP_DIM, TP_DIM
from shardwise.parallelize.adapters import adapter_plan, base_plan
from shardwise.parallelize.moe import EXPERTS_WORD, ExpertsParallel
from shardwise.parallelize.sequence import add_sequence_parallel
from shardwise.parallelize.stages import is_shim
from shardwise.plan.adapters import adapted_layers, adapter_model, saved_modules

__all__ = [
    "CheckedPlan",
    "SplitGradientError",
    "apply_tensor_parallel",
    "check_split_ties",
    "check_tensor_parallel",
    "check_tp_gradients",
    "check_whole_gradients",
    "resolve_tp_plan",
    "split_parameters",
    "style_for",
]

_EXAMPLE = (
    "tp_plan={'layers.*.attn.qkv': 'colwise', 'layers.*.attn.out': 'rowwise', "
    "'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}"
)


def style_for(word: str) -> ParallelStyle:
    """torch's ParallelStyle for a plan word (transformers' words for the dense layers)."""
    if word == "colwise":
        return ColwiseParallel()
    if word == "rowwise":
        return RowwiseParallel()
    if word == "colwise_gather_output":  # e.g. lm_head: every rank gets the whole logits
        return ColwiseParallel(output_layouts=Replicate())
    if word in ("rowwise_split_input", "embedding_rowwise"):  # the input is whole on each rank
        return RowwiseParallel(input_layouts=Replicate())
    if word == "replicated_with_grad_allreduce":
        # A per-head norm after a column split: its weight is whole on every rank but each
        # rank sees only its heads, so the gradient must be summed over tp. torch's
        # SequenceParallel does exactly that (the weight is a Replicate DTensor whose
        # gradient is reduced), and the heads dimension stands in for the sequence one.
        return SequenceParallel(sequence_dim=1, use_local_output=True)
    raise NotImplementedError(
        f"tensor-parallel plan word {word!r} is not supported yet (shardwise knows "
        f"{', '.join(TP_STYLE_NAMES)}). Give that module a torch ParallelStyle in a "
        "tp_plan dict, or a callable tp_plan."
    )


def plan_matches(pattern: str, name: str) -> bool:
    """torch's plan matching: atom by atom, each atom an fnmatch pattern ('layers.*.q')."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(
        fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts, strict=True)
    )


def per_module(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan`'s patterns expanded to one style per module name."""
    names = [n for n, _ in model.named_modules() if n]
    return {n: style for key, style in plan.items() for n in names if plan_matches(key, n)}


def resolve_tp_plan(
    model: nn.Module, tp_plan: object
) -> dict[str, ParallelStyle] | Callable[..., object]:
    """The plan to apply: patterns and torch ParallelStyles, or the user's callable."""
    if callable(tp_plan) and not isinstance(tp_plan, Mapping):
        return tp_plan
    own = tp_plan == "auto"
    if own:
        tp_plan = own_plan(model)
        if not tp_plan:
            raise ValueError(
                f"ParallelConfig.tp_plan='auto' but {type(model).__name__} has no "
                "tensor-parallel plan of its own (only Hugging Face models that ship one do). "
                f"Give it one, e.g. {_EXAMPLE}, or a callable (model, tp_mesh). A model is "
                "never replicated silently under tp > 1."
            )
    if not isinstance(tp_plan, Mapping):
        raise TypeError(f"ParallelConfig.tp_plan={tp_plan!r}: a dict, 'auto' or a callable.")
    modules = {n: m for n, m in model.named_modules() if n}
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in _fold_experts({str(k): v for k, v in tp_plan.items()}).items():
        if not isinstance(style, ParallelStyle):
            style = style_for(str(style))  # a word not built yet is refused first
        matched = {n: m for n, m in modules.items() if plan_matches(pattern, n)}
        if not matched and own:
            # A model's own plan covers every variant of its architecture: Qwen3-MoE's names
            # a dense MLP (mlp.gate_proj) that a config with experts in every layer lacks.
            continue
        if not matched:
            raise ValueError(
                f"ParallelConfig.tp_plan names {pattern!r}, which matches no module of "
                f"{type(model).__name__} (e.g. {', '.join(list(modules)[:4])}, ...). Fix the "
                "name; '*' stands for one name part, as in 'layers.*.mlp.up'."
            )
        if isinstance(style, ExpertsParallel):
            for name, module in matched.items():
                style.check_covers(module, name)
        plan[pattern] = style
    if own and not plan:
        raise ValueError(
            f"ParallelConfig.tp_plan='auto': no entry of {type(model).__name__}'s own plan "
            f"matches one of its modules ({', '.join(list(tp_plan)[:3])}, ...), so nothing "
            f"would be split. Give a plan of your own, e.g. {_EXAMPLE}."
        )
    return plan


def own_plan(model: nn.Module) -> Mapping[str, object] | None:
    """A model's own plan: a Hugging Face model's `_tp_plan`; an adapter model's is its base
    model's, moved under the prefix peft adds to every name."""
    found = adapter_model(model)
    if found is not None:
        return base_plan(found)
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping):
        return own
    plan: dict[str, object] = {}
    for prefix, inner in planned_submodules(model):
        plan.update({f"{prefix}.{k}": v for k, v in getattr(inner, "_tp_plan").items()})  # noqa: B009
    return plan or None


def planned_submodules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules with a plan of their own, e.g. a Hugging Face model held
    by a LightningModule or a plain wrapper of one: a host's module is planned by them."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if isinstance(getattr(module, "_tp_plan", None), Mapping) and module._tp_plan:
            found.append((name, module))
    return found


def _fold_experts(entries: dict[str, object]) -> dict[str, object]:
    """A 'moe_tp_experts' entry and the entries naming its parameters ('...experts.gate_up_proj':
    'packed_colwise'), which are parameters, not modules, become one ExpertsParallel."""
    out = dict(entries)
    for key in [k for k, v in entries.items() if v == EXPERTS_WORD]:
        mine = [k for k in out if k.startswith(f"{key}.") and "." not in k[len(key) + 1 :]]
        words = {k[len(key) + 1 :]: str(out.pop(k)) for k in mine}
        out[key] = ExpertsParallel(words)
    return out


# (config field, what each rank must hold whole)
_DIVISIBLE = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("intermediate_size", "MLP columns"),
    ("moe_intermediate_size", "expert columns"),  # Qwen3-MoE's experts (Mixtral's: the above)
)


def check_sizes(model: nn.Module, tp: int, splits_vocab: bool) -> None:
    """A Hugging Face config's sizes against tp, at plan time: before this check, tp 4 on
    a model with 2 KV heads failed only in the first forward, in a reshape."""
    config = getattr(model, "config", None)
    if config is None:
        for _, inner in planned_submodules(model):
            check_sizes(inner, tp, splits_vocab)
        return
    fields = [*_DIVISIBLE, *((("vocab_size", "vocabulary rows"),) if splits_vocab else ())]
    sizes = {f: getattr(config, f) for f, _ in fields if isinstance(getattr(config, f, None), int)}
    for field, what in fields:
        value = sizes.get(field)
        if value is not None and value % tp != 0:
            fits = [d for d in range(2, 65) if all(v % d == 0 for v in sizes.values())]
            raise ValueError(
                f"ParallelConfig.tp={tp}: {type(model).__name__}'s config.{field}={value} "
                f"does not divide by {tp}, so each rank cannot hold whole {what}. tp values "
                f"that divide all of {', '.join(sizes)}: {fits[:8] or 'none above 1'}."
            )


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one Parameter object (tied input/output embeddings)."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [names for names in seen.values() if len(names) > 1]


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """`parallelize_module` replaces each module's parameters on its own, so a tied pair
    comes back as two parameters that train apart. Tie them again when the plan split
    them alike; refuse when it split them differently."""
    for names in groups:
        params = [model.get_parameter(n) for n in names]
        if all(p is params[0] for p in params):
            continue
        layouts = {
            n: tuple(p.placements) if isinstance(p, DTensor) else "whole"
            for n, p in zip(names, params, strict=True)
        }
        if len(set(layouts.values())) != 1 or len({p.shape for p in params}) != 1:
            raise ValueError(
                f"ParallelConfig.tp_plan splits the tied weights {names} differently "
                f"({layouts}): they would train untied. Give their modules matching styles "
                "(an embedding 'embedding_rowwise' with an output 'colwise_gather_output' "
                "both split the vocabulary), or leave both out of the plan."
            )
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, params[0])


def _weight_split(module: nn.Module, style: ParallelStyle | None) -> str:
    """How a style splits a module's weight over tp, in words (what a tie's two ends must
    share)."""
    if style is None:
        return "whole"
    rows = isinstance(style, RowwiseParallel)
    if isinstance(style, (RowwiseParallel, ColwiseParallel)):
        if isinstance(module, nn.Embedding):  # weight (vocabulary, dim): rowwise splits rows
            return "dim 0" if rows else "dim 1"
        if isinstance(module, nn.Linear):  # weight (out, in): colwise splits the outputs
            return "dim 1" if rows else "dim 0"
    return f"{type(style).__name__} on {type(module).__name__} (unknown)"


def check_split_ties(
    model: nn.Module, plan: CheckedPlan, ties: tuple[tuple[str, str], ...]
) -> None:
    """Tied weights that live on two pipeline stages (the first stage's embedding, the last
    stage's head) are two copies whose gradients are summed shard by shard: the plan must
    split both ends alike. Checked on the whole model, before any group exists."""
    if not ties:
        return
    if not isinstance(plan.apply, Mapping):
        raise NotImplementedError(
            "ParallelConfig.pp with tied embeddings and a callable tp_plan is not built yet: "
            "shardwise cannot read how the callable splits the tie's two ends, whose "
            "gradients are summed shard by shard between the first and last stage. Give "
            "tp_plan as a dict (or 'auto')."
        )
    styles = per_module(model, plan.apply)
    for first, last in ties:
        splits = {}
        for name in (first, last):
            owner = name.rpartition(".")[0]
            splits[name] = _weight_split(model.get_submodule(owner), styles.get(owner))
        if len(set(splits.values())) != 1 or "unknown" in splits[first]:
            raise ValueError(
                f"ParallelConfig.tp_plan splits the tied weights {first} and {last} "
                f"differently ({splits}): under pp they sit on two stages, and their "
                "gradients are summed shard by shard, so both ends must be split alike. Give "
                "their modules matching styles (an embedding 'embedding_rowwise' with an "
                "output 'colwise_gather_output' both split the vocabulary), or leave both out "
                "of the plan."
            )


@dataclass(frozen=True)
class CheckedPlan:
    """A checked plan: what to apply and how to describe it."""

    apply: dict[str, ParallelStyle] | Callable[..., object]
    described: dict[str, str]


def check_tensor_parallel(model: nn.Module, config: ParallelConfig) -> CheckedPlan:
    """Resolve and check `config.tp_plan` for `model`, before any mesh or group exists (the
    same on every rank, so a refusal never leaves the others waiting in group creation)."""
    plan = resolve_tp_plan(model, config.tp_plan)
    if callable(plan) and not isinstance(plan, Mapping):
        return CheckedPlan(plan, {"(callable)": getattr(plan, "__name__", repr(plan))})
    source: Any = own_plan(model) if config.tp_plan == "auto" else config.tp_plan
    words = {str(k): v if isinstance(v, str) else type(v).__name__ for k, v in source.items()}
    if config.loss_parallel:
        head = _split_logits_head(model, plan)
        words[head] = "colwise (loss_parallel: logits split over the vocabulary)"
    splits_vocab = bool({"embedding_rowwise", "colwise_gather_output"} & set(words.values()))
    check_sizes(model, config.tp_size, splits_vocab)
    if adapted_layers(model) or saved_modules(model):  # entries go to base layers and adapters
        plan = adapter_plan(model, per_module(model, plan), config.sequence_parallel)
    if config.sequence_parallel:
        plan = add_sequence_parallel(model, per_module(model, plan), words)
    return CheckedPlan(plan, words)


def _split_logits_head(model: nn.Module, plan: dict[str, ParallelStyle]) -> str:
    """Under loss_parallel the output head keeps its logits split (Shard(-1), as a DTensor)
    for torch's parallel cross-entropy. A Hugging Face model's head is found through
    `get_output_embeddings()` and its plan entry replaced; a model of your own gives that
    entry ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) itself."""
    from torch.distributed.tensor import Shard

    def splits_logits(style: ParallelStyle) -> bool:
        return (
            isinstance(style, ColwiseParallel)
            and not style.use_local_output
            and tuple(style.output_layouts) == (Shard(-1),)
        )

    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Module):
        name = next(n for n, m in model.named_modules() if m is head)
        keys = [k for k in plan if plan_matches(k, name)]
        if keys:
            for key in keys:
                plan[key] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            return keys[0]
    given = [k for k, style in plan.items() if splits_logits(style)]
    if given:
        return given[0]
    raise ValueError(
        "ParallelConfig.loss_parallel=True, but the plan has no output head that keeps its "
        "logits split: give the head's tp_plan entry "
        "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) (a Hugging Face "
        "model's own head is found by itself)."
    )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: CheckedPlan) -> None:
    """Split the planned layers over `tp_mesh` (torch's parallelize_module, or the user's
    callable), then tie again what the plan split alike and keep frozen what was."""
    ties = _tied_groups(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if isinstance(plan.apply, dict):
        # One entry per module: torch warns of a pattern that misses in some layers (Qwen3-MoE's
        # dense mlp.gate_proj in its layers with experts) as if a plan entry were skipped.
        # A pipeline stage's shims (what other stages hold) have nothing to split.
        styles = {
            n: st
            for n, st in per_module(model, plan.apply).items()
            if not is_shim(model.get_submodule(n))
        }
        parallelize_module(model, tp_mesh, styles)
    else:
        plan.apply(model, tp_mesh)
    _retie(model, ties)
    # torch's SequenceParallel (per-head norms, sequence-parallel norms) makes each weight
    # a new Parameter that requires a gradient: a frozen norm (an adapter model's base)
    # would train.
    for name, p in model.named_parameters():
        if name in frozen and p.requires_grad:
            p.requires_grad_(False)


def split_parameters(model: nn.Module, plan: CheckedPlan) -> set[int] | None:
    """The ids of the parameters `plan` splits over tp, read from its styles on the unsplit
    model (None for a callable plan, whose splits are unknown): a column split cuts a
    linear's weight and bias, a row split its weight (the bias stays whole), experts every
    parameter; norms under sequence parallel stay whole."""
    if not isinstance(plan.apply, dict):
        return None
    out: set[int] = set()
    for name, style in per_module(model, plan.apply).items():
        own = dict(model.get_submodule(name).named_parameters(recurse=False))
        if isinstance(style, ExpertsParallel | ColwiseParallel):
            out.update(id(p) for p in own.values())
        elif isinstance(style, RowwiseParallel) and "weight" in own:
            out.add(id(own["weight"]))
    return out


class SplitGradientError(RuntimeError):
    """A parameter the plan left whole got different gradients on the ranks of a tp group."""


def check_whole_gradients(model: nn.Module, tp_mesh: DeviceMesh, rtol: float = 1e-6) -> None:
    """After a backward: every parameter the plan leaves whole on the tp dimension must have
    the same gradient on each rank of a tp group (its inputs are the same there). One that
    differs sits between a column-split and a row-split layer (a per-head norm, a scale):
    each rank saw only its part of the activations, so it would train on part of its
    gradient. That is a silent wrong no loss shows, so it raises, naming the parameters.
    One small all-gather of two checksums per parameter over the tp group."""
    import torch
    import torch.distributed as dist

    names, sums = [], []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            dims = g.device_mesh.mesh_dim_names or ()
            if TP_DIM in dims and not isinstance(g.placements[dims.index(TP_DIM)], Replicate):
                continue  # split over tp: each rank holds its own part
            if EP_DIM in dims and TP_DIM not in dims:
                continue  # spread over an ep group of whole tp groups: its own experts
            g = g.to_local()
        local = g.detach().double()
        names.append(name)
        sums.extend([local.sum(), local.abs().sum()])
    if not names:
        return
    mine = torch.stack(sums)
    parts = [torch.empty_like(mine) for _ in range(tp_mesh.size())]
    dist.all_gather(parts, mine, group=tp_mesh.get_group())
    gathered = torch.stack(parts)
    spread = (gathered - gathered[0]).abs().amax(dim=0)
    scale = gathered.abs().amax(dim=0).clamp_min(1e-30)
    bad = sorted({names[i // 2] for i in torch.nonzero(spread > rtol * scale).flatten().tolist()})
    if bad:
        raise SplitGradientError(
            f"ParallelConfig.tp_plan leaves {bad[:5]} whole, but their gradients differ "
            "between the ranks of a tensor-parallel group: they sit between a column-split "
            "and a row-split layer, so each rank sees only its part of their activations and "
            "they would train on part of their gradient. Give their modules a style in "
            "tp_plan, or change the plan so they see whole activations (split the output "
            "with 'colwise_gather_output' before them)."
        )


def check_tp_gradients(model: nn.Module) -> None:
    """`check_whole_gradients` for a model `wrap` split with tp > 1 (nothing otherwise);
    the Engine runs it at its first update."""
    from shardwise.parallelize.wrapped import wrap_info

    info = wrap_info(model)
    if info is None or info.mesh_spec is None or info.mesh_spec.tp == 1:
        return
    assert info.device_mesh is not None
    check_whole_gradients(model, info.device_mesh[TP_DIM])
