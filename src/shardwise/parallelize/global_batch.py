"""Statistics of the whole global batch: the hook a loss built from batch-level statistics
calls so that every layout computes what one process would.

A loss that is a mean over rows (cross-entropy over equal slices) comes out equal under data
parallelism: each rank's mean, averaged with the gradients, is the whole batch's mean. A
loss that is a product or ratio of batch-level statistics does not: a mixture of experts'
load-balancing loss multiplies the fraction of tokens routed to each expert by the mean
router probability, and the mean over ranks of per-rank products is not the product over
the batch. `global_batch_sum(t)` sums such a statistic over the ranks that hold different
rows of the global batch, differentiably, so the product is formed from whole-batch
statistics on every rank.

Owns: the public hook `global_batch_sum`, which ranks it sums over (`BatchGroups`: the
data-parallel dimensions of the mesh `wrap` built; a tp group shares its rows, and under
sequence parallel a layer's MLP or experts block gathers the sequence before its router
sees it, so tp is never summed over), making those
groups current while a wrapped model's training forward runs (`attach`), and the record of
whether the hook was used (`BatchNotice`'s decision reads it).

Why the gradient is right. The sum's backward is a sum of the gradients over the same ranks
(torch's autograd-aware functional all_reduce), so each rank's local statistic receives the
gradient of every rank's loss: W times the one-process gradient, which the data-parallel
mean over W ranks brings back to exactly it.

Must not: decide what a statistic is (the model's code and router_loss.py do), or reduce in
eval mode: generation on rank 0 alone is a common pattern, and a collective there would
wait for ranks that never arrive.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["BatchGroups", "attach", "global_batch_sum", "groups_of"]


@dataclass(eq=False)
class BatchGroups:
    """The process groups whose ranks hold different rows of the global batch, one per
    data-parallel mesh dimension of size above 1 (their product is the dp size)."""

    groups: tuple[dist.ProcessGroup, ...]
    size: int
    used: int = field(default=0)
    """How many times `global_batch_sum` reduced over these groups."""


_ACTIVE: contextvars.ContextVar[BatchGroups | None] = contextvars.ContextVar(
    "shardwise_batch_groups", default=None
)
# The groups of the last training forward, in the process, not in a context variable:
# activation checkpointing recomputes a block inside backward, after the forward hooks have
# run, and the recomputed statistic must be reduced exactly as in the forward (every rank
# recomputes in the same order). On CUDA, autograd runs that recompute on its device
# thread, which does not see the caller's context variables (pytorch#186583): a ContextVar
# read there is empty, and the statistic would come back each rank's own, with no error.
_LAST: list[BatchGroups | None] = [None]
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, BatchGroups] = weakref.WeakKeyDictionary()


def groups_of(mesh: DeviceMesh | None, group: dist.ProcessGroup | None = None) -> BatchGroups:
    """The data-parallel groups of a mesh (every dimension of a data-parallel mesh, as
    `dp_mesh` returns it), or DDP's one process group."""
    if mesh is not None:
        picked = [mesh.get_group(i) for i in range(mesh.ndim) if mesh.size(i) > 1]
        size = 1
        for g in picked:
            size *= dist.get_world_size(g)
        return BatchGroups(tuple(picked), size)
    whole = group if group is not None else dist.group.WORLD
    assert isinstance(whole, dist.ProcessGroup)  # a process group exists whenever wrap shards
    size = dist.get_world_size(whole)
    return BatchGroups((whole,) if size > 1 else (), size)


def attach(model: nn.Module, batch: BatchGroups) -> None:
    """Make `batch` current while `model`'s training forward runs (the hooks are the
    model's own: a nested wrapped model makes its groups current inside it)."""
    if batch.size == 1:
        return
    _ATTACHED[model] = batch
    tokens: list[contextvars.Token[BatchGroups | None]] = []

    def enter(module: nn.Module, args: Any, kwargs: Any) -> None:
        current = batch if module.training else None
        if current is not None:
            _LAST[0] = current
        tokens.append(_ACTIVE.set(current))

    def leave(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if tokens:
            _ACTIVE.reset(tokens.pop())

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def attached(model: nn.Module) -> BatchGroups | None:
    """The groups `attach` gave `model` (None when it holds the whole batch)."""
    return _ATTACHED.get(model)


def current() -> BatchGroups | None:
    """The groups of the wrapped model whose training forward is running (or whose blocks
    autograd is recomputing), None outside one."""
    active = _ACTIVE.get()
    if active is None and torch._C._current_graph_task_id() != -1:
        return _LAST[0]  # inside backward: a checkpointed block recomputing
    return active


def global_batch_sum(tensor: torch.Tensor, *, model: nn.Module | None = None) -> torch.Tensor:
    """`tensor` summed over the ranks that hold other rows of the global batch, with a
    gradient that makes data-parallel training equal one process.

    Call it on a per-batch statistic before forming a loss from it, e.g. a mixture of
    experts' tokens per expert and summed router probabilities, or a masked loss's sum and
    token count: `global_batch_sum(loss_sum) / global_batch_sum(count)` is the whole
    batch's mean on every rank. Inside a model `shardwise.wrap` returned, in training mode,
    it sums over that model's data-parallel ranks (a tensor-parallel group shares its rows,
    so it is not summed over). Outside a forward, pass `model=` (the wrapped model). In one
    process, in eval mode, or outside any wrapped model, it returns `tensor` unchanged.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"shardwise.global_batch_sum expects a tensor, got {type(tensor).__name__}. "
            "Pass the per-batch statistic as a tensor (torch.as_tensor(x) for a number)."
        )
    if model is not None:
        batch = attached(model)
        if batch is not None and not model.training:
            batch = None
    else:
        batch = current()
    if batch is None:
        return tensor
    batch.used += 1
    return _sum_over(tensor, batch.groups)


def _sum_over(tensor: torch.Tensor, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    out = tensor
    for group in groups:
        # funcol's all_reduce has an autograd formula (its backward sums the gradients over
        # the same group); c10d's in-place all_reduce would cut the graph.
        summed = funcol.wait_tensor(funcol.all_reduce(out.contiguous(), "sum", group))
        if out.requires_grad and not summed.requires_grad:
            summed = _sum_with_autograd(out, group)  # a torch without that formula
        out = summed
    return out


def _sum_with_autograd(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """torch.distributed.nn's all_reduce (the same backward), for torch releases whose
    functional all_reduce has no autograd formula yet; newer ones deprecate it."""
    import warnings

    from torch.distributed.nn import functional as dist_nn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist_nn.all_reduce(tensor, group=group)  # type: ignore[no-any-return]
