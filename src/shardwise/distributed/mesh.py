"""The parallel degrees (pp × replicate × shard × cp × tp) and the named `DeviceMesh` of them.

Owns: turning (strategy, dp_shard, tp, pp, ep, cp, world size) into one validated
`MeshSpec`, and building torch's DeviceMesh from it: (pp, dp_replicate, dp_shard, cp, tp),
tp innermost so that a tensor-parallel group is adjacent ranks (one node's fast links), cp
next (its all-to-alls are the next busiest), pp outermost so that only activations cross
between the blocks of ranks that hold one stage each. Under cp, fully_shard shards over
dp_shard × cp flattened into one dimension: a 2-D (dp_shard, cp) mesh would be HSDP,
sharding over cp alone. Resolution is a pure
function, so every error can be raised (and tested) before a process group exists. A layout
that does not fit the job is refused with a ValueError marked `refused`: the user's setting,
not a bug, so a worker of `shardwise run` shows it in one line, as it does a ConfigError.

Must not: wrap models or read the environment.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.distributed.worker_errors import refused

REPLICATE_DIM = "dp_replicate"
SHARD_DIM = "dp_shard"
TP_DIM = "tp"
PP_DIM = "pp"
CP_DIM = "cp"
SHARD_CP_DIM = "dp_shard_cp"
"""dp_shard × cp flattened: the ranks fully_shard shards over under context parallel."""
REPLICATE_CP_DIM = "dp_replicate_cp"
"""dp_replicate × cp flattened: no_shard's replicas under context parallel."""
EP_DIM = "ep"
EXPERT_SHARD_DIM = "ep_shard"
"""The expert mesh's data-parallel dimension: dp_shard // ep ranks shard each expert."""

_HYBRID = ("hybrid_shard", "hybrid_shard_zero2")


def _refused(message: str) -> ValueError:
    """ParallelConfig's layout (strategy, dp_shard, tp, device_mesh) does not fit this job's
    world size, nodes or process groups; `message` names the field, the value and the fix."""
    return refused(ValueError(message))


@dataclass(frozen=True)
class MeshSpec:
    """How the world is split: `dp_replicate` groups, each sharding over `dp_shard` ranks."""

    strategy: str
    dp_replicate: int
    dp_shard: int
    reshard_after_forward: bool | int
    """For non-root FSDP units; irrelevant for ddp."""
    engine: str
    """'ddp' (DistributedDataParallel) or 'fsdp' (fully_shard)."""
    tp: int = 1
    """Tensor-parallel degree (the innermost mesh dimension); 1: none."""
    pp: int = 1
    """Pipeline stages (the outermost mesh dimension); 1: none."""
    ep: int = 1
    """Expert-parallel degree: each group of `ep` ranks of one dp_shard group holds the
    experts between them; 1: none."""
    cp: int = 1
    """Context-parallel degree: the ranks that share each sequence (between dp_shard and
    tp); 1: none."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own part of the batch (a tp group shares one)."""
        return self.dp_replicate * self.dp_shard

    @property
    def ep_borrows_tp(self) -> bool:
        """Whether each ep group takes whole tp groups (ep does not divide dp_shard): the
        tokens a tp group shares are then split over its ranks before they travel."""
        return self.ep > 1 and self.cp == 1 and self.dp_shard % self.ep != 0

    @property
    def ep_shard(self) -> int:
        """The ranks FSDP shards each expert over: what ep leaves of dp_shard. Under cp an
        ep group takes whole cp groups (ep // cp shard ranks with their cp ranks, which
        hold other tokens of the same rows), as torchtitan's does."""
        taken = self.ep // self.tp if self.ep_borrows_tp else self.ep
        return self.dp_shard // (taken // self.cp if self.cp > 1 else taken)

    @property
    def is_2d(self) -> bool:
        return self.strategy == "no_shard" or self.strategy in _HYBRID

    def __str__(self) -> str:
        tp = f" x cp {self.cp}" if self.cp > 1 else ""
        tp += f" x tp {self.tp}" if self.tp > 1 else ""
        pp = f"pp {self.pp} x " if self.pp > 1 else ""
        ep = ""
        if self.ep > 1:
            borrows = f" (whole tp groups; each tp rank sends 1/{self.tp} of the tokens)"
            ep = (
                f"; experts: ep {self.ep}{borrows if self.ep_borrows_tp else ''} x "
                f"{self.ep_shard} shard rank(s)"
            )
        return (
            f"{self.strategy}: {pp}{self.dp_replicate} replica group(s) x {self.dp_shard} shard "
            f"rank(s){tp} = world {self.world_size}, engine={self.engine}, "
            f"reshard_after_forward={self.reshard_after_forward}{ep}"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def build_experts(self, device_type: str) -> DeviceMesh:
        """The experts' mesh ([pp,] dp_replicate, ep_shard, ep[, tp]) over the same ranks
        as `build`'s: dp_shard is split into ep_shard × ep, ep innermost, so an ep group is
        `ep` consecutive ranks of one shard group of one stage (with tp, one per tp
        coordinate: the experts are whole on every rank of a tp group, which sees the same
        tokens). When ep borrows tp (`ep_borrows_tp`), an ep group is ep // tp shard ranks
        with their whole tp groups: (dp_shard, tp) is split into ep_shard × ep."""
        dims = [(PP_DIM, self.pp)] if self.pp > 1 else []
        dims += [
            (REPLICATE_DIM, self.dp_replicate),
            (EXPERT_SHARD_DIM, self.ep_shard),
            (EP_DIM, self.ep),
        ]
        # tp innermost in `build`'s order: whole tp groups are the ep dimension's inner part
        dims += [(TP_DIM, self.tp)] if self.tp > 1 and not self.ep_borrows_tp else []
        return init_device_mesh(
            device_type,
            tuple(size for _, size in dims),
            mesh_dim_names=tuple(name for name, _ in dims),
        )

    def build(self, device_type: str) -> DeviceMesh | None:
        """The DeviceMesh for fully_shard (None for ddp, which uses the default group)."""
        if self.engine == "ddp":
            return None
        if self.tp > 1 or self.pp > 1 or self.cp > 1:  # the whole grid; see dp_mesh
            dims = [(PP_DIM, self.pp)] if self.pp > 1 else []
            dims += [(REPLICATE_DIM, self.dp_replicate), (SHARD_DIM, self.dp_shard)]
            dims += [(CP_DIM, self.cp)] if self.cp > 1 else []
            dims += [(TP_DIM, self.tp)] if self.tp > 1 else []
            return init_device_mesh(
                device_type,
                tuple(size for _, size in dims),
                mesh_dim_names=tuple(name for name, _ in dims),
            )
        if self.is_2d:
            # FSDP2 treats a 2-D mesh as (replicate, shard): HSDP, or no_shard with shard size 1.
            return init_device_mesh(
                device_type,
                (self.dp_replicate, self.dp_shard),
                mesh_dim_names=(REPLICATE_DIM, SHARD_DIM),
            )
        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=(SHARD_DIM,))


def dp_mesh(spec: MeshSpec, mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of `mesh`, which fully_shard shards (or replicates) over;
    under cp its ranks too, flattened into the shard dimension (no_shard: the replicas)."""
    if spec.cp > 1:
        return _with_cp_ranks(spec, mesh)
    if spec.tp == 1 and spec.pp == 1:
        return mesh
    return mesh[(REPLICATE_DIM, SHARD_DIM)] if spec.is_2d else mesh[SHARD_DIM]


def experts_dp_mesh(spec: MeshSpec, experts_mesh: DeviceMesh) -> DeviceMesh:
    """The ranks fully_shard shards each experts module over: what ep leaves of dp_shard,
    and its replicas under a hybrid strategy (under cp an ep group holds whole cp groups,
    so the cp ranks are not among them)."""
    if spec.is_2d:
        return experts_mesh[(REPLICATE_DIM, EXPERT_SHARD_DIM)]
    return experts_mesh[EXPERT_SHARD_DIM]


def _with_cp_ranks(spec: MeshSpec, mesh: DeviceMesh) -> DeviceMesh:
    import warnings

    with warnings.catch_warnings():  # torch 2.13 warns that slicing a flattened dim from
        warnings.simplefilter("ignore")  # the root mesh will be deprecated; it works here
        if spec.strategy == "no_shard":  # every rank a replica: (dp_replicate x cp, 1)
            mesh[(REPLICATE_DIM, CP_DIM)]._flatten(REPLICATE_CP_DIM)
            return mesh[(REPLICATE_CP_DIM, SHARD_DIM)]
        mesh[(SHARD_DIM, CP_DIM)]._flatten(SHARD_CP_DIM)
        return mesh[(REPLICATE_DIM, SHARD_CP_DIM)] if spec.is_2d else mesh[SHARD_CP_DIM]


def strategy_reshards(strategy: str) -> bool:
    """Whether the strategy frees gathered parameters after forward (ZeRO-3) or keeps them."""
    return strategy in ("full_shard", "hybrid_shard")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _has_2d_split(world: int, dp_shard: int) -> bool:
    """Whether a hybrid strategy finds a (replicate > 1, shard > 1) split of `world`."""
    return dp_shard != 1 and any(1 < d < world for d in divisors(world))


def _hybrid_shard_degree(dp_shard: int, world: int, local_world: int, strategy: str) -> int:
    usable = [d for d in divisors(world) if 1 < d < world]
    if not usable:
        raise _refused(
            f"ParallelConfig.strategy={strategy!r} needs a 2-D mesh (at least 2 replica groups "
            f"of at least 2 ranks), but world size {world} has no such split. Use "
            "'full_shard' (or 'shard_grad_op') for this world size, or launch a world size "
            "with a divisor other than 1 and itself (e.g. 4 = 2x2)."
        )
    if dp_shard == -1:
        # Shard within a node (fast links), replicate across nodes, when that is 2-D.
        if local_world in usable:
            return local_world
        # One node: the most balanced split, the larger side sharding (less memory per
        # rank): the smallest usable divisor >= sqrt(world).
        return min(d for d in usable if d * d >= world)
    if world % dp_shard != 0:
        raise _refused(
            f"ParallelConfig.dp_shard={dp_shard} does not divide the world size {world}. "
            f"Choose a divisor of {world} ({', '.join(map(str, usable))}) or -1 to infer."
        )
    if dp_shard not in usable:
        raise _refused(
            f"ParallelConfig.dp_shard={dp_shard} with strategy={strategy!r} at world size "
            f"{world} gives a {world // dp_shard}x{dp_shard} mesh, which is not hybrid. Choose "
            f"dp_shard in {usable}, or use "
            f"{'full_shard' if dp_shard == world else 'no_shard or ddp'} instead."
        )
    return dp_shard


def resolve_mesh(
    strategy: str,
    dp_shard: int,
    world_size: int,
    *,
    local_world_size: int | None = None,
    reshard_after_forward: bool | int | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
) -> MeshSpec:
    """Validate the degrees against the world size and fix every -1. With `tp` > 1 the
    strategy applies to the world_size // tp data-parallel ranks; with `pp` > 1 each
    stage's world_size // pp ranks are laid out as without pp; `ep` borrows its ranks from
    dp_shard; `cp` takes world_size // cp ranks' worth of data-parallel layout, each
    position of it held by cp ranks."""
    if cp > 1:
        return _with_context(
            strategy,
            dp_shard,
            world_size,
            local_world_size,
            reshard_after_forward,
            cp,
            tp,
            pp,
            ep,
        )
    if ep > 1:
        spec = resolve_mesh(
            strategy, dp_shard, world_size, local_world_size=local_world_size,
            reshard_after_forward=reshard_after_forward, tp=tp, pp=pp,
        )  # fmt: skip
        return _with_experts(spec, ep)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    local_world = local_world_size or world_size
    if pp > 1:
        return _with_stages(
            strategy, dp_shard, world_size, local_world, reshard_after_forward, tp, pp
        )
    if tp > 1:
        if strategy == "ddp":
            raise _refused(
                f"ParallelConfig.tp={tp} with strategy='ddp': DistributedDataParallel cannot "
                "hold tensor-parallel (DTensor) parameters. Use strategy='no_shard' (it "
                "replicates as DDP does, over the data-parallel ranks) or a sharded strategy."
            )
        if world_size % tp != 0 or local_world % tp != 0:
            fits = [d for d in divisors(local_world) if world_size % d == 0 and d > 1]
            raise _refused(
                f"ParallelConfig.tp={tp} does not divide the {world_size} ranks "
                f"({local_world} per node): a tensor-parallel group is {tp} ranks of one "
                f"node. Choose tp in {fits or [1]}."
            )
        dp_world = world_size // tp
        if strategy in _HYBRID and dp_shard in (-1, 1) and not _has_2d_split(dp_world, dp_shard):
            # With tp, hybrid over (replicate N, shard 1) is a real layout: N replicas,
            # each split over its tp group (the "replicate 2 x tp 2").
            raf = (
                strategy_reshards(strategy)
                if reshard_after_forward is None
                else reshard_after_forward
            )
            return MeshSpec(strategy, dp_world, 1, raf, "fsdp", tp)
        spec = resolve_mesh(
            strategy,
            dp_shard,
            dp_world,
            local_world_size=local_world // tp,
            reshard_after_forward=reshard_after_forward,
        )
        return MeshSpec(
            spec.strategy, spec.dp_replicate, spec.dp_shard, spec.reshard_after_forward,
            spec.engine, tp,
        )  # fmt: skip
    if strategy == "ddp" or strategy == "no_shard":
        if dp_shard not in (-1, 1):
            raise _refused(
                f"ParallelConfig.dp_shard={dp_shard} with strategy={strategy!r}: this strategy "
                "replicates everything, so dp_shard must be -1 or 1. To shard, use "
                "'full_shard' or 'hybrid_shard'."
            )
        shard, replicate = 1, world_size
    elif strategy in ("full_shard", "shard_grad_op"):
        if dp_shard not in (-1, world_size):
            hint = (
                f"use strategy='hybrid_shard' with dp_shard={dp_shard}"
                if world_size % dp_shard == 0
                else "choose a divisor of the world size with a hybrid strategy"
            )
            raise _refused(
                f"ParallelConfig.dp_shard={dp_shard} with strategy={strategy!r}: this strategy "
                f"shards over all {world_size} ranks, so dp_shard must be -1 or {world_size}. "
                f"To shard within smaller groups, {hint}."
            )
        shard, replicate = world_size, 1
    elif strategy in _HYBRID:
        shard = _hybrid_shard_degree(dp_shard, world_size, local_world, strategy)
        replicate = world_size // shard
    else:
        raise ValueError(f"unknown strategy {strategy!r}")

    raf = strategy_reshards(strategy) if reshard_after_forward is None else reshard_after_forward
    engine = "ddp" if strategy == "ddp" else "fsdp"
    return MeshSpec(strategy, replicate, shard, raf, engine)


def _ep_fits(spec: MeshSpec) -> list[int]:
    """The ep degrees `spec` can hold: divisors of dp_shard, and tp times one."""
    fits = {d for d in divisors(spec.dp_shard) if d > 1}
    if spec.tp > 1:
        fits |= {spec.tp * d for d in divisors(spec.dp_shard)}
    return sorted(fits)


def _with_experts(spec: MeshSpec, ep: int) -> MeshSpec:
    """`spec` with its dp_shard ranks grouped `ep` at a time for the experts."""
    if spec.dp_shard % ep == 0:
        return MeshSpec(
            spec.strategy, spec.dp_replicate, spec.dp_shard, spec.reshard_after_forward,
            spec.engine, spec.tp, spec.pp, ep,
        )  # fmt: skip
    if spec.tp > 1 and ep % spec.tp == 0 and spec.dp_shard % (ep // spec.tp) == 0:
        # ep takes every rank of a tp group, and ep // tp shard ranks: each tp rank sends
        # its 1/tp of the tokens (experts.py), so no token reaches the experts twice.
        return MeshSpec(
            spec.strategy, spec.dp_replicate, spec.dp_shard, spec.reshard_after_forward,
            spec.engine, spec.tp, spec.pp, ep,
        )  # fmt: skip
    if (spec.dp_shard * spec.tp) % ep == 0:
        raise refused(
            NotImplementedError(
                f"ParallelConfig.ep={ep} takes some but not all ranks of each tp={spec.tp} "
                f"group as well as ranks of dp_shard={spec.dp_shard}: not built yet. ep takes "
                "either ranks of dp_shard alone (ep divides dp_shard) or whole tp groups (ep "
                "a multiple of tp, ep // tp dividing dp_shard). Choose ep in "
                f"{_ep_fits(spec)}."
            )
        )
    fits = _ep_fits(spec)
    why = (
        f"strategy={spec.strategy!r} shards over no ranks (dp_shard=1)"
        if spec.dp_shard == 1
        else f"each of the {spec.dp_shard} ranks of a shard group must hold the same share"
    )
    raise _refused(
        f"ParallelConfig.ep={ep} must divide dp_shard={spec.dp_shard}, the ranks experts are "
        f"spread over: {why}. Choose ep in {fits or [1]}"
        + ("; ep needs a sharded strategy (full_shard, hybrid_shard)." if not fits else ".")
    )


def _with_context(
    strategy: str,
    dp_shard: int,
    world_size: int,
    local_world_size: int | None,
    reshard_after_forward: bool | int | None,
    cp: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
) -> MeshSpec:
    """`cp` ranks for each data-parallel position of a world_size // cp layout (whose tp
    groups stay innermost)."""
    if world_size % cp != 0:
        fits = [d for d in divisors(world_size) if d > 1]
        raise _refused(
            f"ParallelConfig.cp={cp} does not divide the job's {world_size} rank(s): each "
            f"sequence is shared by cp ranks. Choose cp in {fits or [1]}, or launch a "
            f"multiple of {cp} ranks."
        )
    inner = world_size // cp
    local = local_world_size or world_size
    data = inner // (tp * pp) if inner % (tp * pp) == 0 else 0  # data-parallel ranks
    if (
        strategy in _HYBRID
        and data
        and (dp_shard == 1 or (dp_shard == -1 and not _has_2d_split(data, dp_shard)))
    ):
        # Each replica shards over its cp ranks alone: HSDP with shard groups of cp ranks.
        raf = (
            strategy_reshards(strategy) if reshard_after_forward is None else reshard_after_forward
        )
        spec = MeshSpec(strategy, data, 1, raf, "fsdp", tp, pp)
    else:
        spec = resolve_mesh(
            strategy,
            dp_shard,
            inner,
            local_world_size=max(1, local // cp) if local % cp == 0 else None,
            reshard_after_forward=reshard_after_forward,
            tp=tp,
            pp=pp,
        )
    if ep > 1 and (ep % cp or spec.dp_shard % (ep // cp) or tp > 1):
        fits = [cp * d for d in divisors(spec.dp_shard)]
        raise _refused(
            f"ParallelConfig.ep={ep} with cp={cp}: an ep group takes whole cp groups (their "
            f"ranks hold other tokens of the same rows), ep // cp ranks of dp_shard="
            f"{spec.dp_shard} with their cp ranks"
            + (", and not with tp yet" if tp > 1 else "")
            + f". Choose ep in {fits if tp == 1 else [1]}."
        )
    return MeshSpec(
        spec.strategy, spec.dp_replicate, spec.dp_shard, spec.reshard_after_forward,
        spec.engine, spec.tp, spec.pp, ep, cp=cp,
    )  # fmt: skip


def _with_stages(
    strategy: str,
    dp_shard: int,
    world_size: int,
    local_world: int,
    reshard_after_forward: bool | int | None,
    tp: int,
    pp: int,
) -> MeshSpec:
    """`pp` stages, each over world_size // pp ranks laid out as a job of that size."""
    if strategy == "ddp":
        raise _refused(
            f"ParallelConfig.pp={pp} with strategy='ddp' is not built yet: pipeline stages "
            "are replicated through fully_shard's mesh. Use strategy='no_shard' (it "
            "replicates as DDP does, over each stage's data-parallel ranks) or a sharded "
            "strategy."
        )
    if world_size % pp != 0:
        fits = [d for d in divisors(world_size) if d > 1]
        raise _refused(
            f"ParallelConfig.pp={pp} does not divide the job's {world_size} rank(s): each "
            f"stage is held by world_size // pp ranks. Choose pp in {fits or [1]}, or launch "
            f"a multiple of {pp} ranks."
        )
    inner = world_size // pp
    spec = resolve_mesh(
        strategy,
        dp_shard,
        inner,
        local_world_size=min(local_world, inner),
        reshard_after_forward=reshard_after_forward,
        tp=tp,
    )
    return MeshSpec(
        spec.strategy, spec.dp_replicate, spec.dp_shard, spec.reshard_after_forward,
        spec.engine, spec.tp, pp,
    )  # fmt: skip


def from_user_mesh(
    strategy: str,
    dp_shard: int,
    value: Any,
    device_type: str,
    reshard_after_forward: bool | int | None = None,
) -> tuple[MeshSpec, DeviceMesh]:
    """The MeshSpec and DeviceMesh for a user's own DeviceMesh or FSDP1-style process
    groups (`ParallelConfig.device_mesh`; its shape was checked with the config).

    One ProcessGroup becomes a 1-D mesh over its ranks; FSDP1's (shard group, replicate
    group) pair becomes the 2-D (replicate, shard) mesh whose rows are the shard groups,
    learned by gathering every rank's shard group (bounded by the process group timeout).
    The mesh must span the whole job: shardwise's batches and logs assume every rank is a
    data-parallel replica.
    """
    import torch.distributed as dist

    if isinstance(value, DeviceMesh):
        mesh = value
    elif isinstance(value, dist.ProcessGroup):
        mesh = DeviceMesh.from_group(value, device_type)
    else:
        mesh = _mesh_from_group_pair(value[0], value[1], device_type)
    world = dist.get_world_size()
    if mesh.size() != world:
        raise _refused(
            f"ParallelConfig.device_mesh spans {mesh.size()} rank(s) but the job has {world}. "
            "shardwise treats every rank as a data-parallel replica: give a mesh over all "
            "ranks (for model parallelism beside data parallelism, wrap with torch's "
            "fully_shard directly)."
        )
    shard = mesh.size(mesh.ndim - 1)
    if strategy == "ddp":
        shard = 1
    if dp_shard not in (-1, shard):
        raise _refused(
            f"ParallelConfig.dp_shard={dp_shard} contradicts the device_mesh, whose shard "
            f"dimension has {shard} rank(s). Leave dp_shard=-1 with a device_mesh."
        )
    if strategy == "no_shard" and shard != 1:
        raise _refused(
            f"strategy='no_shard' needs a device_mesh of shape (N, 1); its shard dimension "
            f"has {shard} ranks. Use 'hybrid_shard' to shard within rows."
        )
    raf = strategy_reshards(strategy) if reshard_after_forward is None else reshard_after_forward
    engine = "ddp" if strategy == "ddp" else "fsdp"
    return MeshSpec(strategy, world // shard, shard, raf, engine), mesh


def _mesh_from_group_pair(shard_group: Any, replicate_group: Any, device_type: str) -> DeviceMesh:
    import torch
    import torch.distributed as dist

    mine = dist.get_process_group_ranks(shard_group)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    rows = sorted({tuple(r) for r in gathered})
    layout = torch.tensor(rows)
    replicas = dist.get_process_group_ranks(replicate_group)
    column = layout[:, mine.index(dist.get_rank())].tolist()  # this rank's replicas
    if len({len(r) for r in rows}) != 1 or sorted(column) != sorted(replicas):
        raise _refused(
            "ParallelConfig.process_group=(shard group, replicate group) do not form a "
            f"(replicate, shard) grid: shard groups {rows}, and this rank's replicate group "
            f"{replicas} should be {column}. Each replicate group must hold the ranks at one "
            "position of every shard group, as FSDP1's HYBRID_SHARD required."
        )
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=layout,
        mesh_dim_names=(REPLICATE_DIM, SHARD_DIM),
    )
