"""Unit mechanics for the planner: the model index, ownership, tied and frozen handling.

Owns: walking the model once (every path, post-order), deciding which parameters each
unit owns (post-order: a unit owns what no unit below it owns), merging units that would
split a tied/shared parameter, and splitting units that mix frozen and trainable
parameters where the module structure allows.

Must not: resolve policies or call fully_shard. Everything here is pure bookkeeping on
module paths and parameter ids, so it runs on the meta device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn


def is_within(fqn: str, ancestor: str) -> bool:
    """`fqn` is `ancestor` or below it ('' is the root, above everything)."""
    return ancestor == "" or fqn == ancestor or fqn.startswith(ancestor + ".")


def common_ancestor(fqns: list[str]) -> str:
    parts = [f.split(".") if f else [] for f in fqns]
    prefix: list[str] = []
    for level in zip(*parts, strict=False):
        if any(p != level[0] for p in level):
            break
        prefix.append(level[0])
    return ".".join(prefix)


@dataclass
class ModelIndex:
    """Every module path in post-order, with each path's direct (unignored) parameters."""

    modules: dict[str, nn.Module]
    order: list[str]
    """Post-order: children before parents, the root ('') last."""
    direct: dict[str, list[int]]
    """Path -> ids of the parameters it holds directly (not ignored)."""
    params: dict[int, nn.Parameter]
    names: dict[int, str]
    """Parameter id -> its first FQN."""
    users: dict[int, list[str]] = field(default_factory=dict)
    """Parameter id -> every path holding it directly (more than one: tied/shared)."""
    start: dict[str, int] = field(default_factory=dict)
    """Path -> position of the first path of its subtree: in post-order a subtree is the
    contiguous range order[start[fqn] : position(fqn) + 1]."""
    _position: dict[str, int] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, model: nn.Module, ignored: set[int]) -> ModelIndex:
        modules: dict[str, nn.Module] = {}
        order: list[str] = []
        direct: dict[str, list[int]] = {}
        params: dict[int, nn.Parameter] = {}
        names: dict[int, str] = {}
        users: dict[int, list[str]] = {}
        start: dict[str, int] = {}
        for fqn, module, first in _post_order(model):
            modules[fqn] = module
            start[fqn] = first
            order.append(fqn)
            ids = []
            for pname, p in module._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                pid = id(p)
                params[pid] = p
                names.setdefault(pid, f"{fqn}.{pname}" if fqn else pname)
                users.setdefault(pid, []).append(fqn)
                if pid not in ids:
                    ids.append(pid)
            direct[fqn] = ids
        index = cls(modules, order, direct, params, names, users, start)
        index._position = {fqn: i for i, fqn in enumerate(order)}
        return index

    def position(self) -> dict[str, int]:
        return self._position

    def subtree(self, fqn: str) -> list[str]:
        """`fqn` and every path below it, in post-order."""
        return self.order[self.start[fqn] : self._position[fqn] + 1]


def _post_order(
    module: nn.Module, prefix: str = "", counter: list[int] | None = None
) -> Iterator[tuple[str, nn.Module, int]]:
    """(path, module, post-order position of the first path of its subtree)."""
    counter = [0] if counter is None else counter
    first = counter[0]
    # _modules, not named_children(): a module registered under two names is two paths.
    for name, child in module._modules.items():
        if child is not None:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name, counter)
    counter[0] += 1
    yield prefix, module, first


@dataclass
class Unit:
    members: tuple[str, ...]
    """Module paths handed to one fully_shard call (several: a merged unit)."""
    reason: str
    fp32: bool = False

    def contains(self, fqn: str) -> bool:
        return any(is_within(fqn, m) for m in self.members)


def sort_units(units: list[Unit], index: ModelIndex) -> list[Unit]:
    """Application order: by the post-order position of each unit's last member."""
    pos = index.position()
    return sorted(units, key=lambda u: max(pos[m] for m in u.members))


def assign(units: list[Unit], index: ModelIndex) -> list[list[int]]:
    """Parameter ids each unit owns, units in application order (root last)."""
    owned: set[int] = set()
    result: list[list[int]] = []
    for unit in units:
        mine: list[int] = []
        for member in unit.members:
            for fqn in index.subtree(member):
                for pid in index.direct[fqn]:
                    if pid not in owned:
                        owned.add(pid)
                        mine.append(pid)
        result.append(mine)
    return result


def merge_tied(
    units: list[Unit], index: ModelIndex
) -> tuple[list[Unit], list[list[str]], list[str]]:
    """Make each shared parameter's users land in one unit.

    A shared parameter is owned by the first unit (post-order) containing one of its
    users; another user outside that unit would then read a resharded parameter. Such
    units (and loose users) below the users' common ancestor are merged into one unit.
    Returns the new units, the tied groups (parameter FQNs) and notes.
    """
    groups: list[list[str]] = []
    notes: list[str] = []
    for pid, users in index.users.items():
        if len(users) < 2:
            continue
        groups.append([_param_path(index, pid, u) for u in users])
        top = common_ancestor(users)
        below = [
            u
            for u in units
            if u.members != (top,) and all(is_within(m, top) and m != top for m in u.members)
        ]
        conflicting = [u for u in below if any(u.contains(x) for x in users)]
        if not conflicting:
            continue
        outermost = [
            u
            for u in conflicting
            if not any(o is not u and all(o.contains(m) for m in u.members) for o in conflicting)
        ]
        loose = [x for x in users if not any(u.contains(x) for u in outermost)]
        members = tuple(dict.fromkeys(m for u in outermost for m in u.members).keys()) + tuple(
            loose
        )
        merged = Unit(members, "tied", fp32=any(u.fp32 for u in outermost))
        units = [u for u in units if u not in outermost] + [merged]
        notes.append(
            f"tied parameter {index.names[pid]} is used by {users}: merged "
            f"{[' + '.join(u.members) for u in outermost] + loose} into one unit"
        )
    return units, groups, notes


def _param_path(index: ModelIndex, pid: int, user: str) -> str:
    module = index.modules[user]
    for name, p in module._parameters.items():
        if p is not None and id(p) == pid:
            return f"{user}.{name}" if user else name
    return index.names[pid]


@dataclass
class Mixed:
    """A unit holding both frozen and trainable parameters."""

    unit: str
    frozen: list[str]
    trainable: list[str]


def mixed_units(units: list[Unit], owned: list[list[int]], index: ModelIndex) -> list[Mixed]:
    out = []
    for unit, pids in zip(units, owned, strict=True):
        frozen = [index.names[p] for p in pids if not index.params[p].requires_grad]
        trainable = [index.names[p] for p in pids if index.params[p].requires_grad]
        if frozen and trainable:
            out.append(Mixed(" + ".join(unit.members) or "<root>", frozen, trainable))
    return out


def split_frozen(units: list[Unit], index: ModelIndex) -> tuple[list[Unit], list[str]]:
    """Give frozen (or trainable) subtrees of mixed units units of their own.

    Works where a module's direct parameters agree; a module directly holding both
    frozen and trainable parameters cannot be split and is reported.
    """
    unsplittable: list[str] = []
    owned = assign(units, index)
    new: list[Unit] = []
    for unit, pids in zip(units, owned, strict=True):
        flags = {index.params[p].requires_grad for p in pids}
        if len(flags) < 2:
            continue
        if len(unit.members) > 1:
            unsplittable.append(" + ".join(unit.members))
            continue
        top = unit.members[0]
        keep = _direct_flag(top, index, units, pids)
        if keep is None:
            unsplittable.append(top or "<root>")
            continue
        _split_below(top, keep, set(pids), index, units, new, unsplittable)
    return units + new, unsplittable


def _direct_flag(fqn: str, index: ModelIndex, units: list[Unit], pool: list[int]) -> bool | None:
    direct = [p for p in index.direct[fqn] if p in pool]
    flags = {index.params[p].requires_grad for p in direct}
    if len(flags) == 1:
        return flags.pop()
    if flags:
        return None
    # No direct parameters: the larger share stays in this unit.
    trainable = sum(index.params[p].numel() for p in pool if index.params[p].requires_grad)
    frozen = sum(index.params[p].numel() for p in pool if not index.params[p].requires_grad)
    return trainable >= frozen


def _split_below(
    fqn: str,
    keep: bool,
    pool: set[int],
    index: ModelIndex,
    units: list[Unit],
    new: list[Unit],
    unsplittable: list[str],
) -> None:
    module = index.modules[fqn]
    for name in module._modules:
        child = f"{fqn}.{name}" if fqn else name
        if child not in index.modules or any(u.members == (child,) for u in units):
            continue
        sub = [p for f in index.subtree(child) for p in index.direct[f] if p in pool]
        flags = {index.params[p].requires_grad for p in sub}
        if not flags or flags == {keep}:
            continue
        if flags == {not keep}:
            new.append(Unit((child,), "trainable-split" if not keep else "frozen-split"))
            continue
        direct_flags = {index.params[p].requires_grad for p in index.direct[child] if p in pool}
        if len(direct_flags) > 1:
            unsplittable.append(child)
        elif direct_flags == {not keep}:
            # The child itself belongs to the other side: its own unit, split below it.
            new.append(Unit((child,), "trainable-split" if not keep else "frozen-split"))
            _split_below(child, not keep, pool, index, units, new, unsplittable)
        else:
            _split_below(child, keep, pool, index, units, new, unsplittable)
