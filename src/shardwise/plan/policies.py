"""Auto-wrap policies: turn `ParallelConfig.auto_wrap_policy` into a `Policy`.

Owns: every accepted form of a policy (module classes, class names, `size`, FQN regexes
written `re:<pattern>`, callables of both signatures, registered names, `auto`), the
registry of named policies, and the errors for policies that cannot apply to the model.
A `Policy` is asked once per non-root module, in post-order, with the number of
parameters below that module not yet in a unit.

Must not: build the plan (planner.py) or apply it (parallelize/). A string never imports
code: only registered names, class names present in the model and `re:` patterns resolve.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from shardwise.config.names import closest
from shardwise.config.parallel import ParallelConfig
from shardwise.plan.detect import detect_blocks

FIELD = "ParallelConfig.auto_wrap_policy"
REGEX_PREFIX = "re:"


@dataclass
class Policy:
    """A resolved policy: `decide(fqn, module, nonwrapped_numel) -> bool` plus its story."""

    decide: Callable[[str, nn.Module, int], bool]
    description: str
    strict: bool = True
    """If it makes no unit below the root, that is an error (False for `auto`/`none`)."""
    notes: list[str] = field(default_factory=list)

    def __call__(self, fqn: str, module: nn.Module, nonwrapped_numel: int) -> bool:
        return bool(self.decide(fqn, module, nonwrapped_numel))


PolicyFactory = Callable[[nn.Module, ParallelConfig], object]
"""`factory(model, config)` returning any accepted `auto_wrap_policy` form."""
_REGISTRY: dict[str, PolicyFactory] = {}


def register_wrap_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Register `factory(model, config) -> policy` under `name` for configs to refer to.

    The factory may return any accepted policy form (a set of classes, a callable, a
    `Policy`, ...). Example::

        @shardwise.register_wrap_policy("my_blocks")
        def my_blocks(model, config):
            return {MyBlock}
    """
    if not isinstance(name, str) or not name or name.startswith(REGEX_PREFIX):
        raise ValueError(
            f"register_wrap_policy(name={name!r}): use a non-empty name that does not "
            f"start with {REGEX_PREFIX!r}."
        )

    def decorator(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(
                f"register_wrap_policy: a policy named {name!r} is already registered "
                f"({_REGISTRY[name].__qualname__}). Choose another name."
            )
        _REGISTRY[name] = factory
        return factory

    return decorator


def registered_policies() -> list[str]:
    return sorted(_REGISTRY)


def param_holding_classes(model: nn.Module) -> list[str]:
    """Names of the module classes in `model` that hold parameters (directly or below)."""
    return sorted(
        {type(m).__name__ for _, m in model.named_modules() if any(True for _ in m.parameters())}
    )


def _resolve_names(names: list[str], model: nn.Module, field_name: str) -> set[type[nn.Module]]:
    present: dict[str, type[nn.Module]] = {}
    for _, m in model.named_modules():
        present.setdefault(type(m).__name__, type(m))
        present.setdefault(f"{type(m).__module__}.{type(m).__qualname__}", type(m))
    classes: set[type[nn.Module]] = set()
    for name in names:
        if name not in present:
            suggestions = closest(name, [*present, *_REGISTRY])
            raise ValueError(
                f"{field_name} names {name!r}, which is neither a module class in the model "
                f"nor a registered policy.{suggestions} Parameter-holding classes present: "
                f"{param_holding_classes(model)}. Registered policies: {registered_policies()}."
            )
        classes.add(present[name])
    return classes


def module_classes(items: Iterable[object], model: nn.Module, field_name: str) -> set[type]:
    """Classes from a mix of nn.Module subclasses and class names present in `model`."""
    items = list(items)
    classes = _resolve_names([i for i in items if isinstance(i, str)], model, field_name)
    for item in items:
        if isinstance(item, str):
            continue
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(
                f"{field_name} contains {item!r}, which is not an nn.Module subclass or a "
                "class name. Give module classes, e.g. {MyBlock}."
            )
        classes.add(item)
    return classes


def class_policy(items: Iterable[object], model: nn.Module) -> Policy:
    classes = module_classes(items, model, FIELD)
    if not classes:
        raise ValueError(
            f"{FIELD} is an empty collection. Use 'none' to shard the root only, or name "
            "the block classes to shard separately."
        )
    wanted = tuple(classes)
    names = sorted(c.__name__ for c in classes)
    return Policy(lambda fqn, m, n: isinstance(m, wanted), f"classes {names}")


def size_policy(min_num_params: int) -> Policy:
    return Policy(
        lambda fqn, m, n: n >= min_num_params,
        f"size: a module becomes a unit once {min_num_params:,} parameters below it are in "
        "no unit yet",
    )


def regex_policy(pattern: str | re.Pattern[str]) -> Policy:
    try:
        compiled = re.compile(pattern) if isinstance(pattern, str) else pattern
    except re.error as exc:
        raise ValueError(f"{FIELD}: {pattern!r} is not a valid regular expression: {exc}") from None
    return Policy(
        lambda fqn, m, n: compiled.fullmatch(fqn) is not None,
        f"FQNs fully matching {compiled.pattern!r}",
    )


def callable_policy(fn: Callable[..., bool]) -> Policy:
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    label = getattr(fn, "__qualname__", type(fn).__name__)
    if "recurse" in names or "nonwrapped_numel" in names or len(params) == 3:
        # FSDP1-style `(module, recurse, nonwrapped_numel)`: asked with recurse=False, as
        # FSDP1 did when deciding whether to wrap the module itself.
        return Policy(lambda fqn, m, n: fn(m, False, n), f"FSDP1-style callable {label}")
    return Policy(lambda fqn, m, n: fn(fqn, m), f"callable {label}")


def custom_policy(lambda_fn: Callable[[nn.Module], Any]) -> Policy:
    """torch FSDP1's CustomPolicy: wrap where `lambda_fn(module)` is truthy. Its per-unit
    keyword overrides (a dict return) have no shardwise meaning, so they are refused."""

    def decide(fqn: str, module: nn.Module, numel: int) -> bool:
        verdict = lambda_fn(module)
        if isinstance(verdict, dict) and verdict:
            raise ValueError(
                f"{FIELD}: CustomPolicy returned per-unit overrides {sorted(verdict)} for "
                f"{fqn!r}. shardwise applies one ParallelConfig to every unit (keep_fp32 "
                "covers fp32 modules): return True/False, or {} to wrap with the defaults."
            )
        return isinstance(verdict, dict) or bool(verdict)

    label = getattr(lambda_fn, "__qualname__", type(lambda_fn).__name__)
    return Policy(decide, f"FSDP1 CustomPolicy({label})")


def resolve_policy(value: object, model: nn.Module, config: ParallelConfig | None = None) -> Policy:
    """A `Policy` for any accepted `auto_wrap_policy` value (`value` may be anything: what
    is not one is a TypeError naming the forms); a named policy's factory gets `config`
    (None: the defaults)."""
    if isinstance(value, Policy):
        return value
    if type(value).__name__ == "CustomPolicy" and hasattr(value, "_lambda_fn"):
        return custom_policy(value._lambda_fn)
    if value is None:
        return Policy(lambda fqn, m, n: False, "none: the root is the only unit", strict=False)
    if isinstance(value, type) and issubclass(value, nn.Module):
        return class_policy([value], model)
    if isinstance(value, re.Pattern):
        return regex_policy(value)
    if isinstance(value, str):
        if value.startswith(REGEX_PREFIX):
            return regex_policy(value[len(REGEX_PREFIX) :])
        if value in _REGISTRY:
            config = config if config is not None else ParallelConfig()
            resolved = resolve_policy(_REGISTRY[value](model, config), model, config)
            if not resolved.description.startswith(value):
                resolved.description = f"{value}: {resolved.description}"
            return resolved
        return class_policy([value], model)
    if isinstance(value, (set, frozenset, list, tuple)):
        return class_policy(value, model)
    if callable(value):
        return callable_policy(value)
    raise TypeError(
        f"{FIELD} got {type(value).__name__} ({value!r}); expected 'auto', a registered "
        f"name {registered_policies()}, a module class or class name, a set of them, "
        f"'{REGEX_PREFIX}<pattern>', or a callable (fqn, module) -> bool."
    )


# --- built-in named policies --------------------------------------------------------------


@register_wrap_policy("none")
def _none(model: nn.Module, config: ParallelConfig) -> Policy:
    return Policy(lambda fqn, m, n: False, "none: the root is the only unit", strict=False)


@register_wrap_policy("size")
def _size(model: nn.Module, config: ParallelConfig) -> Policy:
    size = getattr(config, "min_num_params", None)
    return size_policy(100_000_000 if size is None else int(size))  # FSDP1's default


@register_wrap_policy("transformer_blocks")
def _transformer_blocks(model: nn.Module, config: ParallelConfig) -> Policy:
    found = detect_blocks(model)
    if not found.classes:
        raise ValueError(
            f"{FIELD}='transformer_blocks' found no repeated blocks in {type(model).__name__} "
            "(same-class children of a ModuleList/Sequential, or _no_split_modules). "
            f"Name the block classes instead; parameter-holding classes present: "
            f"{param_holding_classes(model)}."
        )
    wanted = tuple(found.classes)
    return Policy(lambda fqn, m, n: isinstance(m, wanted), found.describe())


@register_wrap_policy("auto")
def _auto(model: nn.Module, config: ParallelConfig) -> Policy:
    found = detect_blocks(model)
    if not found.classes:
        return Policy(
            lambda fqn, m, n: False,
            "auto: no repeated blocks found, so the root is the only unit (name block "
            "classes or use 'size' to shard finer)",
            strict=False,
        )
    wanted = tuple(found.classes)
    return Policy(lambda fqn, m, n: isinstance(m, wanted), found.describe(), strict=False)
