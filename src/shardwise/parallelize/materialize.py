"""Models larger than one device: build on meta, shard, then materialise only local shards.

Owns: `init_empty()` (parameters on the meta device, buffers real, so buffers such as
rotary tables are computed as usual), and `materialize` (called by `wrap` after sharding):
allocate each rank's shards (`to_empty`), then fill them from weights on disk or through
the model's own initialisers, and refuse to go on if any parameter was left untouched.

Initialisers, in order: a user `param_init_fn(module)` for every module, or each module's
`reset_parameters()`; then the model's `init_weights()` (or Hugging Face-style
`_init_weights(module)` for every module). Guarantee: the same distribution as an eager
build, and identical values on every replica under HSDP. Values are not identical to an
eager build: on CPU each rank draws its own shards from a stream seeded by its position
on the shard dimension (DTensor's offset-based RNG exists only on CUDA, where it is used).

Must not: gather a full model on any rank.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from shardwise.distributed.mesh import TP_DIM
from shardwise.distributed.process_group import serves_cpu
from shardwise.parallelize.weights import load_weights


class InitializationError(ValueError):
    """Parameters of a meta-built model were not filled by any initialiser or weights file."""


@contextlib.contextmanager
def init_empty(include_buffers: bool = False) -> Iterator[None]:
    """Build a model without allocating its parameters: `with init_empty(): m = Model(cfg)`.

    Parameters land on the meta device as they are registered. Buffers stay real (they
    are small and often computed, like rotary tables) unless `include_buffers`, which puts
    everything on meta; then the model's init hook must recreate its buffers.
    """
    if include_buffers:
        with torch.device("meta"):
            yield
        return
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _seed_for_rank(mesh: DeviceMesh | None, seed: int) -> None:
    """Independent draws per shard (and per tensor-parallel part), the same draws on
    replicas of a shard."""
    shard_coordinate = 0
    if mesh is not None and dist.is_initialized():
        coords = mesh.get_coordinate() or [0]
        names = mesh.mesh_dim_names or ()
        if TP_DIM in names:  # (.., shard, tp): number the (shard, tp) positions
            tp = names.index(TP_DIM)
            shard = int(coords[tp - 1]) if tp > 0 else 0
            shard_coordinate = shard * mesh.size(tp) + int(coords[tp])
        else:
            shard_coordinate = int(coords[-1])
    torch.manual_seed(seed + 1_000_003 * shard_coordinate)


def _same_on_tp_ranks(model: nn.Module, mesh: DeviceMesh | None) -> None:
    """Initialised per tp rank, a parameter or buffer the plan leaves whole would differ
    between the ranks of a tp group, which then train different copies of one weight:
    each takes the first tp rank's values (a broadcast over the tp group)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if mesh is None or TP_DIM not in names or not dist.is_initialized():
        return
    group = mesh[TP_DIM].get_group()
    for t in [*model.parameters(), *model.buffers()]:
        if isinstance(t, DTensor):
            dims = t.device_mesh.mesh_dim_names or ()
            if TP_DIM in dims and not isinstance(t.placements[dims.index(TP_DIM)], Replicate):
                continue  # split over tp: each rank holds its own part
        local = _local(t)
        if local.is_floating_point() and local.numel():
            dist.broadcast(local.data, group=group, group_src=0)


def _forget_init_marks(model: nn.Module) -> None:
    """Hugging Face models mark modules and tensors `_is_hf_initialized` while they are
    built, and their `init_weights()` skips whatever is marked. Built on meta, nothing was
    really initialised, so the marks would leave those parameters empty."""
    for obj in (*model.modules(), *model.parameters(), *model.buffers()):
        if getattr(obj, "_is_hf_initialized", False):
            setattr(obj, "_is_hf_initialized", False)  # noqa: B010


@contextlib.contextmanager
def _original_class(model: nn.Module) -> Iterator[None]:
    """Show model code its own class while its initialiser runs.

    fully_shard swaps a module's class for a generated `FSDP<Name>` subclass defined in
    torch. Code that inspects its own class can then take another path: Hugging Face
    treats a class from outside `transformers.` as custom code and skips, for example,
    GPT-2's scaled initialisation of its residual projections.
    """
    cls: type[nn.Module] = type(model)
    bases = cls.__bases__
    if isinstance(model, FSDPModule) and len(bases) == 2 and bases[0] is FSDPModule:
        model.__class__ = bases[1]
        try:
            yield
        finally:
            model.__class__ = cls  # type: ignore[assignment]
    else:
        yield


def _run_initialisers(
    model: nn.Module, param_init_fn: Callable[[nn.Module], None] | None
) -> list[str]:
    used = []
    _forget_init_marks(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="DTensor random operators may not have complete support"
        )
        if param_init_fn is not None:
            for module in model.modules():
                param_init_fn(module)
            used.append("param_init_fn")
        else:
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset) and any(True for _ in module.parameters(recurse=False)):
                    reset()
            used.append("reset_parameters")
        with _original_class(model):
            hook = getattr(model, "init_weights", None)
            per_module = getattr(model, "_init_weights", None)
            if callable(hook):
                hook()
                used.append("init_weights")
            elif callable(per_module):
                for module in model.modules():
                    per_module(module)
                used.append("_init_weights")
    return used


def _untouched(model: nn.Module) -> list[str]:
    """Parameters (and buffers) still holding the NaN sentinel on any rank."""
    names, flags = [], []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = _local(t)
        names.append(name)
        flags.append(bool(local.is_floating_point() and local.numel() and torch.isnan(local).any()))
    found = torch.tensor(flags or [False], dtype=torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if not serves_cpu(dist.get_backend()):  # a nccl-only group
            found = found.cuda()
        dist.all_reduce(found)
    return [n for n, f in zip(names, found.cpu().tolist(), strict=False) if f]


def materialize(
    model: nn.Module,
    device: torch.device,
    *,
    mesh: DeviceMesh | None = None,
    weights: str | Path | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    seed: int = 0,
    broadcast_from_rank0: bool = False,
) -> list[str]:
    """Allocate the (sharded) meta model on `device` and fill it; returns what filled it.

    Every floating parameter and meta buffer starts as NaN, so anything no initialiser
    (or weights file) writes is found and reported instead of training on garbage.
    """
    real_buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in real_buffers:
                b.copy_(real_buffers[name])
            elif b.is_floating_point():
                b.fill_(float("nan"))
        for p in model.parameters():
            if p.is_floating_point():
                _local(p).fill_(float("nan"))
    if weights is not None:
        result = load_weights(
            model, weights, strict=False, broadcast_from_rank0=broadcast_from_rank0
        )
        if result["missing"]:
            raise InitializationError(
                f"weights in {weights} do not cover the meta-built model: missing "
                f"{result['missing'][:20]}. Use a complete weights file, or wrap without "
                "weights to initialise."
            )
        used = ["load_weights"]
    else:
        _seed_for_rank(mesh, seed)
        used = _run_initialisers(model, param_init_fn)
        _same_on_tp_ranks(model, mesh)
    untouched = _untouched(model)
    if untouched:
        raise InitializationError(
            f"after materialising the meta-built model ({' + '.join(used)}), these were never "
            f"initialised: {untouched[:20]}{' ...' if len(untouched) > 20 else ''}"
            f"{' (meta buffers: ' + str(meta_buffers[:5]) + ')' if meta_buffers else ''}. "
            "Give their module a reset_parameters(), the model an init_weights(), pass "
            "ParallelConfig.param_init_fn, or wrap with weights=PATH to load them."
        )
    return used
