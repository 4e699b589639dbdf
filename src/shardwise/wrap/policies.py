"""Auto-wrap policies: turn `ParallelConfig.auto_wrap_policy` into a predicate.

Owns: every accepted form of a policy and the errors for ones that cannot apply to the
model. A resolved policy is a function `(fqn, module) -> bool` asked once per non-root
module, in post-order.

Must not: build the plan (plan.py) or apply it (strategies.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

from torch import nn

from shardwise.config import closest

Predicate = Callable[[str, nn.Module], bool]


def _never(fqn: str, module: nn.Module) -> bool:
    return False


def param_holding_classes(model: nn.Module) -> list[str]:
    """Names of the module classes in `model` that hold parameters (directly or below)."""
    return sorted(
        {type(m).__name__ for _, m in model.named_modules() if any(True for _ in m.parameters())}
    )


def _resolve_names(names: list[str], model: nn.Module) -> set[type[nn.Module]]:
    present: dict[str, type[nn.Module]] = {}
    for _, m in model.named_modules():
        present.setdefault(type(m).__name__, type(m))
        present.setdefault(f"{type(m).__module__}.{type(m).__qualname__}", type(m))
    classes: set[type[nn.Module]] = set()
    for name in names:
        if name not in present:
            raise ValueError(
                f"ParallelConfig.auto_wrap_policy names class {name!r}, which is not in the "
                f"model.{closest(name, present)} Parameter-holding classes present: "
                f"{param_holding_classes(model)}."
            )
        classes.add(present[name])
    return classes


def _class_policy(items: Iterable[object], model: nn.Module) -> Predicate:
    items = list(items)
    names = [i for i in items if isinstance(i, str)]
    classes: set[type[nn.Module]] = _resolve_names(names, model)
    for item in items:
        if isinstance(item, str):
            continue
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(
                f"ParallelConfig.auto_wrap_policy contains {item!r}, which is not an nn.Module "
                "subclass or a class name. Give module classes, e.g. {MyBlock}."
            )
        classes.add(item)
    if not classes:
        raise ValueError(
            "ParallelConfig.auto_wrap_policy is an empty collection. Use None to shard the "
            "root only, or name the block classes to shard separately."
        )
    found = {type(m) for fqn, m in model.named_modules() if fqn and isinstance(m, tuple(classes))}
    if not found:
        raise ValueError(
            f"ParallelConfig.auto_wrap_policy={sorted(c.__name__ for c in classes)} matches no "
            f"submodule of {type(model).__name__}. Parameter-holding classes present: "
            f"{param_holding_classes(model)}."
        )
    wanted = tuple(classes)
    return lambda fqn, module: isinstance(module, wanted)


def _callable_policy(fn: Callable[..., bool]) -> Predicate:
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    if "recurse" in names or "nonwrapped_numel" in names or len(params) == 3:
        # FSDP1-style `(module, recurse, nonwrapped_numel)`: ask with recurse=False, as
        # FSDP1 did when deciding whether to wrap the module itself.
        def fsdp1(fqn: str, module: nn.Module) -> bool:
            numel = sum(p.numel() for p in module.parameters())
            return bool(fn(module, False, numel))

        return fsdp1
    return lambda fqn, module: bool(fn(fqn, module))


def resolve_policy(value: object, model: nn.Module) -> Predicate:
    """A `(fqn, module) -> bool` predicate for any accepted `auto_wrap_policy` value."""
    if value is None:
        return _never
    if isinstance(value, type) and issubclass(value, nn.Module):
        return _class_policy([value], model)
    if isinstance(value, str):
        return _class_policy([value], model)
    if isinstance(value, (set, frozenset, list, tuple)):
        return _class_policy(value, model)
    if callable(value):
        return _callable_policy(value)
    raise TypeError(
        f"ParallelConfig.auto_wrap_policy got {type(value).__name__} ({value!r}); expected "
        "None, a module class, a set of module classes or class names, or a callable "
        "(fqn, module) -> bool."
    )
