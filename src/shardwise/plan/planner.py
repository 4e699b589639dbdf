"""The wrap plan: which submodules become FSDP2 shard units, as data you can print.

Owns: `WrapUnit`/`WrapPlan` and `plan_wrap`, which decides units bottom-up (post-order,
children before parents, root last), gives fp32-only modules units of their own under
mixed precision, keeps tied parameters in one unit, reports or splits units mixing
frozen and trainable parameters, and marks blocks for activation checkpointing. Planning
allocates nothing, so it works on a model built on the meta device.

Must not: call fully_shard or touch process groups; parallelize/apply.py applies a plan.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from shardwise.config.names import closest
from shardwise.config.parallel import ParallelConfig
from shardwise.config.precision import Precision
from shardwise.distributed.mesh import strategy_reshards
from shardwise.plan.detect import has_no_forward
from shardwise.plan.policies import (
    REGEX_PREFIX,
    Policy,
    module_classes,
    param_holding_classes,
    resolve_policy,
)
from shardwise.plan.quantized import quant_state_bytes, stored_bytes
from shardwise.plan.units import (
    ModelIndex,
    Unit,
    assign,
    merge_tied,
    mixed_units,
    owning_unit,
    sort_units,
    split_frozen,
)
from shardwise.plan.units import (
    shared_params as _shared,
)


class PlanNotice(UserWarning):
    """Something the plan decided that the user should know about (rank 0 only)."""


@dataclass(frozen=True)
class WrapUnit:
    """One shard unit: module(s) handed to one fully_shard call, owning its parameters."""

    fqn: str
    """Dotted path of the module ('' for the root; 'a + b' for a merged unit)."""
    modules: tuple[str, ...]
    """The module paths handed to fully_shard together."""
    module_class: str
    num_params: int
    """Parameters this unit owns (those not inside a unit below it)."""
    bytes_by_dtype: dict[str, int]
    trainable_params: int
    frozen_params: int
    compute_dtype: str
    """dtype the unit computes in ('native': the parameters' own dtype)."""
    reshard_after_forward: bool | int
    reason: str
    """Why it is a unit: policy, keep_fp32, tied, frozen-split, trainable-split, root."""
    activation_checkpointing: bool = False
    trainable_bytes: int = 0
    """Bytes of the trainable parameters (their gradients' size), in their own dtypes."""
    whole_bytes: int = 0
    """Bytes every rank holds whole, which sharding does not divide: a quantized weight's
    quant_state (plan/quantized.py)."""

    @property
    def is_root(self) -> bool:
        return self.fqn == ""


@dataclass(frozen=True)
class MixedUnit:
    """A unit holding both frozen and trainable parameters, with both FQN lists."""

    unit: str
    frozen: list[str]
    trainable: list[str]


@dataclass(frozen=True)
class WrapPlan:
    """Units in application order: post-order (children first), the root last."""

    units: list[WrapUnit]
    strategy: str
    precision: str
    policy: str = ""
    notes: list[str] = field(default_factory=list)
    mixed_units: list[MixedUnit] = field(default_factory=list)
    ignored_params: list[str] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)
    """Each shared parameter's names (one parameter reached by several module paths)."""
    tied_units: list[str] = field(default_factory=list)
    """The unit holding each `tied` group whole (same order)."""
    replicated_params: list[str] = field(default_factory=list)
    """0-dim parameters (CLIP's logit_scale): fully_shard cannot shard them, so they stay
    whole on every rank and wrap averages their gradients over all ranks."""

    def __iter__(self) -> Iterator[WrapUnit]:
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)

    @property
    def total_params(self) -> int:
        return sum(u.num_params for u in self.units)

    def unit(self, fqn: str) -> WrapUnit:
        for u in self.units:
            if u.fqn == fqn:
                return u
        raise KeyError(f"no unit {fqn!r} in the plan; units: {[u.fqn for u in self.units]}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_params"] = self.total_params
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        header = (
            f"{'unit':<36} {'class':<20} {'params':>12} {'frozen':>10} {'trainable':>10} "
            f"{'dtype':>9} {'reshard':>7} {'AC':>3}  reason"
        )
        lines = [
            f"WrapPlan: {len(self.units)} unit(s), {self.total_params:,} params, "
            f"strategy={self.strategy}, precision={self.precision}",
            f"policy: {self.policy}",
            header,
            "-" * len(header),
        ]
        for u in self.units:
            name = "<root>" if u.is_root else u.fqn
            lines.append(
                f"{name:<36} {u.module_class:<20} {u.num_params:>12,} {u.frozen_params:>10,} "
                f"{u.trainable_params:>10,} {u.compute_dtype:>9} {u.reshard_after_forward!s:>7} "
                f"{'yes' if u.activation_checkpointing else '':>3}  {u.reason}"
            )
        for names, unit in zip(self.tied, self.tied_units, strict=True):
            lines.append(f"tied: {' = '.join(names)} -> unit {unit or '<root>'}")
        lines.extend(f"note: {n}" for n in self.notes)
        if self.mixed_units:
            lines.append(mixed_line(self.mixed_units))
        if self.ignored_params:
            lines.append(f"ignored (unsharded, unmanaged): {self.ignored_params}")
        if self.replicated_params:
            lines.append(
                f"replicated (0-dim, which fully_shard cannot shard; whole on every rank, "
                f"gradients averaged over all ranks): {self.replicated_params}"
            )
        return "\n".join(lines)


def mixed_line(mixed: list[MixedUnit]) -> str:
    """One line for the units that hold frozen and trainable parameters together."""
    names = ", ".join(m.unit or "<root>" for m in mixed[:3])
    more = f" and {len(mixed) - 3} more" if len(mixed) > 3 else ""
    return (
        f"mixed: {len(mixed)} unit(s) hold frozen and trainable parameters ({names}{more}); "
        "free under FSDP2, which gathers both and reduces only the trainable ones' gradients"
    )


def _notice(message: str) -> None:
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, PlanNotice, stacklevel=4)


def _ignored(model: nn.Module, config: ParallelConfig) -> tuple[set[int], list[str]]:
    """Ids and names of the parameters config says to leave unmanaged."""
    mods = list(config.ignored_modules or ())
    instances = {id(m) for m in mods if isinstance(m, nn.Module)}  # FSDP1 took modules
    mods = [m for m in mods if not isinstance(m, nn.Module)]
    patterns = [
        re.compile(m[len(REGEX_PREFIX) :])
        for m in mods
        if isinstance(m, str) and m.startswith(REGEX_PREFIX)
    ]
    plain = [m for m in mods if not (isinstance(m, str) and m.startswith(REGEX_PREFIX))]
    classes = tuple(module_classes(plain, model, "ParallelConfig.ignored_modules"))
    ids: set[int] = set()
    present = {id(m) for m in model.modules()}
    strangers = [
        m for m in config.ignored_modules or () if isinstance(m, nn.Module) and id(m) not in present
    ]
    if strangers:
        raise ValueError(
            f"ParallelConfig.ignored_modules holds {len(strangers)} module instance(s) that are "
            f"not part of {type(model).__name__} (first: {type(strangers[0]).__name__}). Pass "
            "modules of the model being wrapped, or their class names."
        )
    for fqn, m in model.named_modules():
        if (
            id(m) in instances
            or (classes and isinstance(m, classes))
            or any(p.fullmatch(fqn) for p in patterns)
        ):
            ids.update(id(p) for p in m.parameters())
    named = dict(model.named_parameters(remove_duplicate=False))
    for name in config.ignored_params or ():
        if name not in named:
            raise ValueError(
                f"ParallelConfig.ignored_params names {name!r}, which is not a parameter of "
                f"{type(model).__name__}.{closest(name, named)}"
            )
        ids.add(id(named[name]))
    names = [n for n, p in model.named_parameters() if id(p) in ids]
    return ids, names


def _scalars(model: nn.Module, ignored: set[int]) -> list[str]:
    """Names of the 0-dim parameters no unit can take (fully_shard shards on dim 0)."""
    return [n for n, p in model.named_parameters() if p.dim() == 0 and id(p) not in ignored]


def _keep_fp32_classes(model: nn.Module, config: ParallelConfig) -> tuple[type, ...]:
    if config.keep_fp32 is None:
        return tuple(
            {type(m) for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats}
        )
    return tuple(module_classes(config.keep_fp32, model, "ParallelConfig.keep_fp32"))


def _choose_units(index: ModelIndex, policy: Policy, fp32_classes: tuple[type, ...]) -> list[Unit]:
    """Bottom-up: each module sees how many parameters below it are in no unit yet."""
    unowned: dict[str, set[int]] = {}
    units: list[Unit] = []
    for fqn in index.order:
        if fqn == "":
            break
        module = index.modules[fqn]
        ids = set(index.direct[fqn])
        for name in module._modules:
            ids |= unowned.get(f"{fqn}.{name}", set())
        unowned[fqn] = set()
        if not ids:
            continue
        if has_no_forward(module):
            # ModuleList/ModuleDict: hooks on them never fire, so fully_shard refuses them
            # (torch's FSDP1 size policy excluded them too). Their parameters go up.
            unowned[fqn] = ids
        elif fp32_classes and isinstance(module, fp32_classes):
            units.append(Unit((fqn,), "keep_fp32", fp32=True))
        elif policy(fqn, module, sum(index.params[p].numel() for p in ids)):
            units.append(Unit((fqn,), "policy"))
        else:
            unowned[fqn] = ids
    return units


def _nothing_matched(model: nn.Module, policy: Policy, config: ParallelConfig) -> ValueError:
    if policy.description.startswith("size"):
        sizes = sorted(
            (
                (sum(p.numel() for p in m.parameters()), fqn)
                for fqn, m in model.named_modules()
                if fqn and not has_no_forward(m)
            ),
            reverse=True,
        )[:5]
        largest = ", ".join(f"{fqn}: {n:,}" for n, fqn in sizes)
        return ValueError(
            f"ParallelConfig.auto_wrap_policy='size' with min_num_params="
            f"{config.min_num_params or 100_000_000:,} "
            f"made no unit below the root of {type(model).__name__}. Largest submodules: "
            f"{largest}. Lower min_num_params, or name the block classes."
        )
    containers = sorted(
        {
            type(m).__name__
            for f, m in model.named_modules()
            if has_no_forward(m) and policy(f, m, 0)
        }
    )
    why = (
        f" It matched only {', '.join(containers)}, which has no forward of its own (FSDP "
        "cannot shard a container): name the classes inside it."
        if containers
        else ""
    )
    return ValueError(
        f"ParallelConfig.auto_wrap_policy ({policy.description}) matches no submodule of "
        f"{type(model).__name__} that holds parameters.{why} Parameter-holding classes "
        f"present: {param_holding_classes(model)}."
    )


def _handle_frozen(
    units: list[Unit], index: ModelIndex, config: ParallelConfig, notes: list[str]
) -> tuple[list[Unit], list[MixedUnit]]:
    mixed = mixed_units(units, assign(units, index), index)
    if mixed and config.frozen_policy == "split":
        units, unsplittable = split_frozen(units, index)
        units = sort_units(units, index)
        before = len(mixed)
        mixed = mixed_units(units, assign(units, index), index)
        notes.append(f"frozen_policy=split: split {before - len(mixed)} of {before} mixed unit(s)")
        if unsplittable:
            notes.append(f"cannot split (a module directly holds both kinds): {unsplittable}")
    found = [MixedUnit(m.unit, m.frozen, m.trainable) for m in mixed]
    if found and config.frozen_policy == "error":
        listing = "; ".join(f"{m.unit}: frozen {m.frozen}, trainable {m.trainable}" for m in found)
        raise ValueError(
            f"ParallelConfig.frozen_policy='error': {len(found)} unit(s) mix frozen and "
            f"trainable parameters: {listing}. Use frozen_policy='split' to give frozen "
            "parts units of their own, or 'warn' to accept (FSDP2 keeps no gradients for "
            "frozen parameters either way)."
        )
    # Nothing is said under 'warn': FSDP2 gathers a unit's frozen and trainable parameters
    # in one all-gather and reduce-scatters only the gradients that exist, so a mixed unit
    # costs what two split units would (an adapter model mixes in every adapted layer). The
    # plan's table shows both counts per unit, and one `mixed:` line.
    return units, found


def plan_wrap(
    model: nn.Module,
    config: ParallelConfig | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    sharded: bool | None = None,
) -> WrapPlan:
    """Decide the shard units of `model` under `config`, without changing the model.

    `reshard_after_forward` is the choice for non-root units (default: the strategy's);
    the root never reshards after forward, since backward needs it at once. `sharded`
    (default: strategy != 'ddp') says whether FSDP2 applies the plan; without it there
    are no fp32 units (autocast keeps normalisation layers in fp32 itself) and no frozen
    checks (nothing groups parameters into units).
    """
    config = config or ParallelConfig()
    precision: Precision = config.precision
    sharded = config.strategy != "ddp" if sharded is None else sharded
    if reshard_after_forward is None:
        reshard_after_forward = (
            strategy_reshards(config.strategy)
            if config.reshard_after_forward is None
            else config.reshard_after_forward
        )
    ignored_ids, ignored_names = _ignored(model, config)
    replicated = _scalars(model, ignored_ids) if sharded else []
    named = dict(model.named_parameters())
    index = ModelIndex.build(model, ignored_ids | {id(named[n]) for n in replicated})
    policy = resolve_policy(config.auto_wrap_policy, model, config)
    fp32_classes = _keep_fp32_classes(model, config) if sharded and precision.is_mixed else ()

    units = _choose_units(index, policy, fp32_classes)
    if policy.strict and not any(u.reason == "policy" for u in units):
        raise _nothing_matched(model, policy, config)
    notes = list(policy.notes)
    units, tied, tied_notes = merge_tied(units, index)
    notes.extend(tied_notes)
    units = sort_units([*units, Unit(("",), "root")], index)
    mixed: list[MixedUnit] = []
    if sharded:  # only FSDP units hold parameters together; DDP and world 1 have none
        units, mixed = _handle_frozen(units, index, config, notes)

    tied_units = _tied_units(units, index, tied)

    fp32_units = [u for u in units if u.fp32]
    if fp32_units:
        names = ", ".join(" + ".join(u.members) for u in fp32_units)
        message = (
            f"shardwise: {len(fp32_units)} module(s) compute in float32 under "
            f"{precision.param_dtype}, each in its own unit: {names}"
        )
        notes.append(message.removeprefix("shardwise: "))
        _notice(message)
    return WrapPlan(
        units=_describe(units, index, precision, reshard_after_forward, config.checkpoint_every),
        strategy=config.strategy,
        precision=str(precision),
        policy=policy.description,
        notes=notes,
        mixed_units=mixed,
        ignored_params=ignored_names,
        replicated_params=replicated,
        tied=tied,
        tied_units=tied_units,
    )


def _tied_units(units: list[Unit], index: ModelIndex, tied: list[list[str]]) -> list[str]:
    """The unit holding each tied group; an error if a later step split one."""
    out = []
    for (_, users), names in zip(_shared(index), tied, strict=True):
        owners = {id(owning_unit(units, u)): owning_unit(units, u) for u in users}
        if len(owners) > 1:
            where = [" + ".join(o.members) if o else "<root>" for o in owners.values()]
            raise ValueError(
                f"shardwise: the plan splits tied parameter {' = '.join(names)} across units "
                f"{where} (frozen_policy='split' separated its users). FSDP2 cannot shard one "
                "parameter in two units: use frozen_policy='warn', or freeze all of its users."
            )
        owner = next(iter(owners.values()))
        out.append(" + ".join(owner.members) if owner else "")
    return out


def _describe(
    units: list[Unit], index: ModelIndex, precision: Precision, raf: bool | int, every: int
) -> list[WrapUnit]:
    native = str(precision.param_dtype).removeprefix("torch.") if precision.is_mixed else "native"
    blocks = [u for u in units if u.reason == "policy"]
    checkpointed = {id(u) for i, u in enumerate(blocks) if every and i % every == 0}
    out = []
    for unit, pids in zip(units, assign(units, index), strict=True):
        params = [index.params[p] for p in pids]
        by_dtype: dict[str, int] = {}
        trainable_bytes = whole = 0
        for p in params:
            for key, n in stored_bytes(p).items():  # a 4-bit weight: its packed codes
                by_dtype[key] = by_dtype.get(key, 0) + n
                trainable_bytes += n if p.requires_grad else 0
            whole += sum(quant_state_bytes(p).values())
        root = unit.members == ("",)
        out.append(
            WrapUnit(
                fqn=" + ".join(unit.members),
                modules=unit.members,
                module_class="+".join(
                    dict.fromkeys(type(index.modules[m]).__name__ for m in unit.members)
                ),
                num_params=sum(p.numel() for p in params),
                bytes_by_dtype=by_dtype,
                trainable_params=sum(p.numel() for p in params if p.requires_grad),
                frozen_params=sum(p.numel() for p in params if not p.requires_grad),
                compute_dtype="float32" if unit.fp32 else native,
                reshard_after_forward=False if root else raf,
                reason=unit.reason,
                activation_checkpointing=id(unit) in checkpointed,
                trainable_bytes=trainable_bytes,
                whole_bytes=whole,
            )
        )
    return out
