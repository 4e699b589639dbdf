"""Whole matrices for Muon: where each matrix lies over the ranks, who orthogonalises it, and
the collectives that take its pieces to that owner and the result back.

Owns: `MatrixLayout` (a parameter's pieces over its mesh: the mesh dimensions that split it,
and those that replicate it), the choice of one owner rank per matrix (balanced by size over
the ranks of the matrix's mesh), and `orthogonalise_whole` (one step's traffic, bucketed by
owner, in phases so that every owner runs Newton–Schulz at the same time). The wire is
float32 whatever the parameters' dtype: gloo does not check dtypes across ranks, so a bf16
piece sent into a float32 buffer would be read as garbage.

The choice, per matrix and step:
  1. The ranks that split it (FSDP's shard dimension, tp, both) send their pieces of the
     momentum-updated gradient to the owner with one `gather` per owner (bucketed: all the
     matrices one owner holds travel in one message), padded to the largest piece.
  2. The owner places each piece by its global indices (uneven and strided shards
     included), runs Newton–Schulz on the whole matrix, and sends each rank its part back
     with one `scatter`.
  3. Ranks that hold a replica of those pieces (HSDP's other replicas, the data-parallel
     replicas beside tp, every DDP rank) get them from their counterpart in the owner's
     replica by one `broadcast`. So Newton–Schulz runs once per matrix in the job.

Must not: know Muon's arithmetic (muon.py passes the function to run on the whole
matrix), or read the model: the layout comes from the parameter (a DTensor's mesh and
placements) or from the process group its replicas live in (ddp).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.distributed.mesh import PP_DIM

WIRE_DTYPE = torch.float32
"""Every piece crosses the wire in this dtype, on every rank (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """How one parameter lies over ranks. `ranks` is its mesh as global ranks (shape
    `mesh_shape`); `split_dims` cut it into pieces, `replica_dims` copy those pieces.
    A parameter whole on one process has `ranks` of one element and no dims."""

    ranks: torch.Tensor
    placements: tuple[object, ...]
    split_dims: tuple[int, ...]
    replica_dims: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    """Plain tensors replicated over a process group (ddp): that group."""

    @property
    def key(self) -> tuple[object, ...]:
        """Equal for layouts whose matrices can share a message (the same ranks and dims)."""
        flat = tuple(int(r) for r in self.ranks.flatten().tolist())
        return (tuple(self.ranks.shape), flat, self.split_dims, self.replica_dims)

    @property
    def candidates(self) -> list[int]:
        return [int(r) for r in self.ranks.flatten().tolist()]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        found = (self.ranks == rank).nonzero()
        return tuple(int(i) for i in found[0].tolist())

    def rank_at(self, coordinate: Sequence[int]) -> int:
        return int(self.ranks[tuple(coordinate)].item())

    def slice_ranks(self, rank: int, dims: tuple[int, ...]) -> list[int]:
        """The ranks that share `rank`'s coordinate on every dim but `dims`, in mesh order."""
        coord = list(self.coordinate(rank))
        out = []
        for values in itertools.product(*(range(self.ranks.shape[d]) for d in dims)):
            for d, v in zip(dims, values, strict=True):
                coord[d] = v
            out.append(self.rank_at(coord))
        return out


def layout_of(param: torch.Tensor, group: dist.ProcessGroup | None, name: str) -> MatrixLayout:
    """The layout of one parameter: a DTensor's mesh and placements, or plain tensors
    replicated over `group` (ddp), or whole on this process."""
    if isinstance(param, DTensor):
        ranks, placements = _on_root_mesh(param, name)
        split, replica = [], []
        for d, placement in enumerate(placements):
            if isinstance(placement, (Shard, _StridedShard)):
                split.append(d)
            elif isinstance(placement, Replicate):
                replica.append(d)
            else:  # a Partial parameter has no whole value to orthogonalise
                kind = "Partial" if isinstance(placement, Partial) else type(placement).__name__
                raise NotImplementedError(
                    f"shardwise.Muon: {name} is a DTensor with a {kind} placement on mesh "
                    f"dim {d}; only Shard and Replicate parameters have a whole matrix to "
                    "orthogonalise. Send it to the fallback with fallback_names."
                )
        return MatrixLayout(ranks, tuple(placements), tuple(split), tuple(replica))
    if group is not None and dist.get_world_size(group) > 1:
        ranks = torch.tensor(dist.get_process_group_ranks(group))
        return MatrixLayout(ranks, (Replicate(),), (), (0,), group)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return MatrixLayout(torch.tensor([rank]), (), (), ())


def _on_root_mesh(param: DTensor, name: str) -> tuple[torch.Tensor, list[object]]:
    """The parameter's placements over the whole mesh its own was cut from. Beside tp, a
    parameter sharded over data-parallel ranks only lives on a sub-mesh that differs from
    one tp rank to the next; each tp rank holds a copy (Replicate over tp). Read over the
    root mesh, its layout (and so its owner) is the same on every rank, and Newton–Schulz
    runs once, not once per tp rank."""
    mesh = param.device_mesh
    root = mesh._get_root_mesh()
    if root is mesh or root.mesh.shape == mesh.mesh.shape:
        return mesh.mesh.clone(), list(param.placements)
    names, root_names = mesh.mesh_dim_names or (), tuple(root.mesh_dim_names or ())
    if not names or any(n not in root_names for n in names):
        raise NotImplementedError(
            f"shardwise.Muon: {name} lies on mesh dims {names}, which are not dims of its "
            f"root mesh {root_names} (a flattened mesh); its replicas cannot be found."
        )
    ranks = root.mesh.clone()
    if PP_DIM in root_names and PP_DIM not in names:
        # Another pipeline stage holds other matrices, not copies: keep this stage's ranks.
        at = root_names.index(PP_DIM)
        coordinate = root.get_coordinate()
        assert coordinate is not None  # this rank is in the mesh its parameter lives on
        ranks = ranks.select(at, coordinate[at])
        root_names = root_names[:at] + root_names[at + 1 :]
    by_name = dict(zip(names, param.placements, strict=True))
    return ranks, [by_name.get(n, Replicate()) for n in root_names]


def choose_owners(layouts: Sequence[MatrixLayout], sizes: Sequence[int]) -> list[int]:
    """One owner rank per matrix: largest first, each to the least-loaded rank of its mesh
    (ties to the lowest rank). The same on every rank: it reads only shapes and meshes."""
    load: dict[int, int] = {}
    owners = [0] * len(layouts)
    for i in sorted(range(len(layouts)), key=lambda i: (-sizes[i], i)):
        owner = min(layouts[i].candidates, key=lambda r: (load.get(r, 0), r))
        load[owner] = load.get(owner, 0) + sizes[i]
        owners[i] = owner
    return owners


def piece_index(
    shape: Sequence[int], layout: MatrixLayout, coordinate: Sequence[int]
) -> list[torch.Tensor]:
    """The global indices, per tensor dimension, of the piece at mesh `coordinate`, by
    torch's own rule for (strided) shards."""
    offsets: dict[int, torch.Tensor] = {}
    local = list(shape)
    for d in layout.split_dims:
        placement = layout.placements[d]
        assert isinstance(placement, (Shard, _StridedShard))  # split_dims hold only these
        dim = placement.dim
        size, idx = _get_shard_size_and_offsets(
            local[dim],
            int(layout.ranks.shape[d]),
            coordinate[d],
            placement,
            offsets.get(dim),
            shape[dim],
            False,
        )
        local[dim] = size
        offsets[dim] = idx if size > 0 and idx is not None else torch.zeros(0, dtype=torch.long)
    return [offsets.get(i, torch.arange(n)) for i, n in enumerate(shape)]


class Groups:
    """The process groups one rank's matrices travel in, made at construction (`prepare`)
    in parameter order, so the ranks of each slice make theirs together."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def prepare(self, layout: MatrixLayout, rank: int) -> None:
        if layout.ranks.numel() > 1:
            self.pieces(layout, rank)
            self.replicas(layout, rank)

    def pieces(self, layout: MatrixLayout, rank: int) -> dist.ProcessGroup | None:
        """The ranks that hold the other pieces of `rank`'s matrices."""
        return self._over(layout.slice_ranks(rank, layout.split_dims))

    def replicas(self, layout: MatrixLayout, rank: int) -> dist.ProcessGroup | None:
        """The ranks that hold copies of `rank`'s pieces."""
        if layout.group is not None:
            return layout.group
        return self._over(layout.slice_ranks(rank, layout.replica_dims))

    def _over(self, ranks: list[int]) -> dist.ProcessGroup | None:
        if len(ranks) == 1:
            return None
        key = tuple(ranks)
        if key not in self._made:
            # Only this slice's ranks take part (local synchronisation).
            self._made[key] = dist.new_group(list(ranks), use_local_synchronization=True)
        return self._made[key]


@dataclasses.dataclass
class Item:
    """One matrix of one step: its local update and what orthogonalises it."""

    shape: tuple[int, ...]
    local: torch.Tensor
    layout: MatrixLayout
    owner: int
    orthogonalise: Callable[[torch.Tensor], torch.Tensor]


def orthogonalise_whole(items: Sequence[Item], groups: Groups) -> list[torch.Tensor]:
    """Each item's local part of the orthogonalised whole matrix, Newton–Schulz run once per
    matrix in the job (on its owner); float32, shaped like the item's local update.

    In phases, each over every bucket in the same order on every rank: all the gathers,
    then each owner's Newton–Schulz on its own matrices (every owner at once), then all the
    scatters, then the replicas' broadcasts. Bucket by bucket, each owner's Newton–Schulz
    would wait for the one before it, and the step would take the sum of the owners'
    work, not the largest."""
    out: list[torch.Tensor | None] = [None] * len(items)
    buckets: dict[tuple[object, ...], list[int]] = {}
    for i, it in enumerate(items):
        buckets.setdefault((*it.layout.key, it.owner), []).append(i)
    me = dist.get_rank() if dist.is_initialized() else 0
    # The same order on every rank: keys are ranks and dims.
    runs = [_Bucket([items[i] for i in buckets[key]], me, groups) for key in sorted(buckets)]
    for run in runs:
        run.gather()
    for run in runs:
        run.compute()
    for run in runs:
        run.scatter()
    for run in runs:
        run.broadcast()
    for run, key in zip(runs, sorted(buckets), strict=True):
        for i, part in zip(buckets[key], run.parts(), strict=True):
            out[i] = part
    return [o for o in out if o is not None]


class _Bucket:
    """The matrices of one owner and layout in one step, through the phases of
    `orthogonalise_whole`. `mine` ends as this rank's parts, flat and padded like the
    message."""

    def __init__(self, bucket: list[Item], me: int, groups: Groups) -> None:
        self.bucket, self.me, self.groups = bucket, me, groups
        self.layout, self.owner = bucket[0].layout, bucket[0].owner
        self.device = bucket[0].local.device
        self.mine: torch.Tensor | None = None
        self.whole: list[torch.Tensor] | None = None
        self.send: torch.Tensor | None = None
        self.received: list[torch.Tensor] | None = None
        self.scattered: list[torch.Tensor] = []
        self.group: dist.ProcessGroup | None = None
        self.in_owner_replica = False
        self.coords: list[tuple[int, ...]] = []
        self.pads: list[int] = []
        if self.layout.ranks.numel() == 1:  # whole on this process
            return
        owner_coord = self.layout.coordinate(self.owner)
        self.my_coord = self.layout.coordinate(me)
        self.owner_coord = owner_coord
        # The owner's replica: the ranks whose replica coordinates are the owner's.
        self.in_owner_replica = all(
            self.my_coord[d] == owner_coord[d] for d in self.layout.replica_dims
        )
        self.coords = _split_coordinates(self.layout, owner_coord)
        self.pads = [_largest_piece(it, self.coords) for it in bucket]
        self.members = [self.layout.rank_at(c) for c in self.coords]
        if self.in_owner_replica:
            self.send = torch.cat(
                [_flat_padded(it.local, pad) for it, pad in zip(bucket, self.pads, strict=True)]
            )
            if self.layout.split_dims:
                self.group = groups.pieces(self.layout, me)

    def gather(self) -> None:
        """Within the owner's replica: every piece to the owner."""
        if not (self.in_owner_replica and self.layout.split_dims):
            return
        assert self.send is not None  # made for every rank of the owner's replica
        if self.group is None:  # split over mesh dims of one rank: the piece is the whole
            self.received = [self.send]
            return
        if self.me == self.owner:
            self.received = [torch.empty_like(self.send) for _ in self.members]
        dist.gather(self.send, self.received, dst=self.owner, group=self.group)

    def compute(self) -> None:
        """On the owner: Newton–Schulz on each whole matrix; elsewhere nothing."""
        if self.layout.ranks.numel() == 1:  # each result as it is: no flat copy
            self.whole = [it.orthogonalise(it.local.to(WIRE_DTYPE)) for it in self.bucket]
            return
        if not self.in_owner_replica or self.me != self.owner:
            return
        if not self.layout.split_dims:  # whole on every rank: the owner computes
            parts = [it.orthogonalise(it.local.to(WIRE_DTYPE)) for it in self.bucket]
            self.mine = torch.cat(
                [_flat_padded(p, pad) for p, pad in zip(parts, self.pads, strict=True)]
            )
            return
        assert self.received is not None
        self.scattered = _place_compute_cut(
            self.bucket, self.received, self.coords, self.pads, self.device
        )

    def scatter(self) -> None:
        """Within the owner's replica: each rank's part of the results back."""
        if not self.in_owner_replica or self.layout.ranks.numel() == 1:
            return
        if not self.layout.split_dims:  # replicas receive by the broadcast
            if self.me != self.owner:
                self.mine = self.send
            return
        if self.group is None:
            self.mine = self.scattered[0]
            return
        assert self.send is not None
        self.mine = torch.empty_like(self.send)
        scattered = self.scattered if self.me == self.owner else None
        dist.scatter(self.mine, scattered, src=self.owner, group=self.group)

    def broadcast(self) -> None:
        """Ranks that hold copies of the pieces: from their counterpart in the owner's
        replica."""
        if not self.layout.replica_dims or self.layout.ranks.numel() == 1:
            return
        if self.mine is None:
            self.mine = torch.empty(sum(self.pads), dtype=WIRE_DTYPE, device=self.device)
        src_coord = list(self.my_coord)
        for d in self.layout.replica_dims:
            src_coord[d] = self.owner_coord[d]
        replicas = self.groups.replicas(self.layout, self.me)
        if replicas is not None:  # a mesh dim of one rank replicates nothing
            dist.broadcast(self.mine, src=self.layout.rank_at(src_coord), group=replicas)

    def parts(self) -> list[torch.Tensor]:
        if self.whole is not None:
            return self.whole
        assert self.mine is not None
        out, offset = [], 0
        for it, pad in zip(self.bucket, self.pads, strict=True):
            out.append(self.mine[offset : offset + it.local.numel()].view(it.local.shape))
            offset += pad
        return out


def _split_coordinates(layout: MatrixLayout, base: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate of `base`'s slice over the split dims, in mesh order (the order of
    the slice's group ranks)."""
    out = []
    for values in itertools.product(*(range(layout.ranks.shape[d]) for d in layout.split_dims)):
        coord = list(base)
        for d, v in zip(layout.split_dims, values, strict=True):
            coord[d] = v
        out.append(tuple(coord))
    return out


def _numel(index: list[torch.Tensor]) -> int:
    n = 1
    for i in index:
        n *= len(i)
    return n


def _largest_piece(it: Item, coords: list[tuple[int, ...]]) -> int:
    return max(_numel(piece_index(it.shape, it.layout, c)) for c in coords)


def _flat_padded(t: torch.Tensor, pad: int) -> torch.Tensor:
    flat = t.detach().reshape(-1).to(WIRE_DTYPE)
    return torch.nn.functional.pad(flat, (0, pad - flat.numel()))


def _place_compute_cut(
    bucket: list[Item],
    received: list[torch.Tensor],
    coords: list[tuple[int, ...]],
    pads: list[int],
    device: torch.device,
) -> list[torch.Tensor]:
    """On the owner: each piece placed by its global indices, Newton–Schulz on each whole
    matrix, and the result cut into each rank's message (flat and padded like the ones
    received)."""
    scattered = [torch.empty_like(received[0]) for _ in coords]
    offset = 0
    for it, pad in zip(bucket, pads, strict=True):
        whole = torch.zeros(it.shape, dtype=WIRE_DTYPE, device=device)
        indices = [piece_index(it.shape, it.layout, c) for c in coords]
        for msg, idx in zip(received, indices, strict=True):
            n = _numel(idx)
            grid = torch.meshgrid(*idx, indexing="ij")
            whole[grid] = msg[offset : offset + n].view(*(len(i) for i in idx))
        result = it.orthogonalise(whole).to(WIRE_DTYPE)
        for buf, idx in zip(scattered, indices, strict=True):
            n = _numel(idx)
            buf[offset : offset + n] = result[torch.meshgrid(*idx, indexing="ij")].reshape(-1)
        offset += pad
    return scattered
