"""Old module paths, from before the package was laid out in subpackages, keep working.

Owns: the table of old paths (`shardwise.strategies`, `shardwise.models`, ...) and an import
hook that serves each as a small module forwarding attribute reads to its new home(s),
with one DeprecationWarning naming the new path. `shardwise.wrap.<anything>` is refused
with the new path: `shardwise.wrap` is the function `wrap`, and an alias module there
would replace it.

Forwarding, rather than handing back the new module under the old name, leaves the new
modules untouched and lets one old path serve names that now live in two places. Private
names and monkeypatching through an old path are not promised.

Must not: import any shardwise module before an old path is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

# Old module path -> the modules its public names live in now (searched in order).
MOVED: dict[str, tuple[str, ...]] = {
    "shardwise.activation": ("shardwise.parallelize.recompute",),
    "shardwise.activations": ("shardwise.memory.activations", "shardwise.memory.fake"),
    "shardwise.autoplan": ("shardwise.memory.auto",),
    "shardwise.dcp_safe": ("shardwise.checkpoint.trust",),
    "shardwise.demo": ("shardwise.cli.demo",),
    "shardwise.engine": ("shardwise.train.engine", "shardwise.train.nonfinite"),
    "shardwise.losses": ("shardwise.train.losses",),
    "shardwise.materialize": ("shardwise.parallelize.materialize",),
    "shardwise.mesh": ("shardwise.distributed.mesh",),
    "shardwise.metrics": ("shardwise.train.metrics",),
    "shardwise.models": ("shardwise.testing.models",),
    "shardwise.optim": ("shardwise.train.optim", "shardwise.parallelize.wrapped"),
    "shardwise.parity": ("shardwise.testing.parity",),
    "shardwise.plot": ("shardwise.train.plot",),
    "shardwise.precision": ("shardwise.config.precision", "shardwise.parallelize.autocast"),
    "shardwise.runner": (
        "shardwise.train.runner",
        "shardwise.train.resume",
        "shardwise.config.training",
    ),
    "shardwise.schema": ("shardwise.config.run_file",),
    "shardwise.simulate": ("shardwise.memory.simulate", "shardwise.memory.fake"),
    "shardwise.strategies": ("shardwise.parallelize",),
    "shardwise.vocabulary": ("shardwise.config.vocabulary",),
    "shardwise.watchdog": ("shardwise.distributed.watchdog",),
    "shardwise.weights": ("shardwise.parallelize.weights", "shardwise.checkpoint.export"),
}

WRAP_MOVED = (
    "{name} no longer exists: shardwise.wrap is the function wrap(model, config), and the "
    "planning package is shardwise.plan (from shardwise.plan import plan_wrap, WrapPlan, "
    "register_wrap_policy; detect, policies and units are shardwise.plan.detect, "
    "shardwise.plan.policies and shardwise.plan.units, plan is shardwise.plan.planner)."
)


class _Forward(types.ModuleType):
    """An old module path: each attribute read is answered by the first new module that has
    the name. Warns once, on first use."""

    def __init__(self, name: str, targets: Sequence[str]) -> None:
        super().__init__(name, f"Moved: {name} is now {', '.join(targets)}.")
        self._targets = tuple(targets)
        self._warned = False

    def _modules(self) -> list[types.ModuleType]:
        return [importlib.import_module(t) for t in self._targets]

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        for module in self._modules():
            if hasattr(module, attr):
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"{self.__name__} moved to {' and '.join(self._targets)}: import "
                        f"{attr} from {module.__name__}. The old path will be removed in a "
                        "later release.",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                return getattr(module, attr)
        raise AttributeError(
            f"module {self.__name__!r} (moved to {', '.join(self._targets)}) has no "
            f"attribute {attr!r}"
        )

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for module in self._modules():
            names.update(n for n in dir(module) if not n.startswith("_"))
        return sorted(names)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Forward(spec.name, MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "shardwise.wrap" or fullname.startswith("shardwise.wrap."):
            raise ImportError(WRAP_MOVED.format(name=fullname), name=fullname)
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), origin="alias")
        return None


def install() -> None:
    """Put the finder on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
