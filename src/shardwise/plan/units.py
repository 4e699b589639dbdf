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


def shared_params(index: ModelIndex) -> list[tuple[int, list[str]]]:
    """(parameter id, every module path holding it) for parameters held by several paths."""
    return [(pid, users) for pid, users in index.users.items() if len(users) > 1]


def owning_unit(units: list[Unit], fqn: str) -> Unit | None:
    """The unit whose fully_shard call manages a parameter held directly by `fqn`: the
    innermost unit containing it (inner units are sharded first). None: the root."""
    best: tuple[int, Unit] | None = None
    for unit in units:
        for member in unit.members:
            if is_within(fqn, member):
                depth = len(member.split(".")) if member else 0
                if best is None or depth > best[0]:
                    best = (depth, unit)
    return None if best is None else best[1]


def _outermost_members(members: list[str]) -> tuple[str, ...]:
    """Members not inside another member (a module's subtree already comes with it)."""
    unique = list(dict.fromkeys(members))
    return tuple(m for m in unique if not any(o != m and is_within(m, o) for o in unique))


def merge_tied(
    units: list[Unit], index: ModelIndex
) -> tuple[list[Unit], list[list[str]], list[str]]:
    """Make every user of each shared parameter land in one unit.

    fully_shard manages a parameter in the first (innermost) unit whose modules hold it;
    a user in another unit would read a parameter that unit does not gather, and FSDP2
    refuses it ("shared with a parameter already managed by another FSDP group"). So the
    units managing the users of one parameter are merged, wherever they sit in the tree
    (a tie may join an embedding with a head far from it), together with the users that
    only the root manages. A user that is the root itself folds the units into the root.
    Merging can split another tie, so this repeats until every tie sits in one unit.
    Returns the new units, the tied groups (parameter FQNs) and notes.
    """
    shared = shared_params(index)
    groups = [[_param_path(index, pid, u) for u in users] for pid, users in shared]
    notes: list[str] = []
    changed = True
    while changed:
        changed = False
        for pid, users in shared:
            owners = [owning_unit(units, u) for u in users]
            distinct = list({id(o): o for o in owners if o is not None}.values())
            if len(distinct) + (None in owners) < 2:
                continue
            loose = [u for u, o in zip(users, owners, strict=True) if o is None]
            units = [u for u in units if all(u is not d for d in distinct)]
            before = [" + ".join(d.members) for d in distinct] + loose
            if "" in loose:  # the root holds it directly: the root is the only unit to join
                notes.append(
                    f"tied parameter {index.names[pid]} is used by {users}, one of them the "
                    f"root: {[' + '.join(d.members) for d in distinct]} fold into the root unit"
                )
            else:
                members = _outermost_members([m for d in distinct for m in d.members] + loose)
                units.append(Unit(members, "tied", fp32=any(d.fp32 for d in distinct)))
                notes.append(
                    f"tied parameter {index.names[pid]} is used by {users}: merged {before} "
                    "into one unit"
                )
            changed = True
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
