"""The wrap step for statistics of the batch: what is made whole-batch, and what is said.

Under data parallelism each rank sees its own rows. A loss that is a mean over rows comes
out equal to one process; one formed from statistics of the batch does not, unless the
statistics are summed over the ranks first (`global_batch_sum`). After the layout is built,
`wrap` calls `prepare`, which makes the data-parallel groups current in the model's training
forwards (global_batch.py), puts transformers' load-balancing loss on whole-batch
statistics (router_loss.py), and says once, on rank 0, what stays per rank:

- a mixture of experts whose first training step summed nothing over the batch: if its
  code forms an auxiliary loss from routing statistics, that loss is each rank's own;
- BatchNorm layers normalising in training mode: each rank normalises by its own rows
  (torch's SyncBatchNorm is the whole-batch layer; shardwise does not convert to it).

Owns: `prepare`, `BatchStatisticNotice` and the text of both statements.

Must not: change the model's numbers (the statements only report), or speak on a rank
other than 0 or more than once per wrapped model.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm

from shardwise.parallelize.global_batch import BatchGroups, attach
from shardwise.parallelize.router_loss import FUNCTION, install

__all__ = ["BatchStatisticNotice", "moe_module", "prepare"]

_MOE_CLASS = re.compile(r"moe|expert|router", re.IGNORECASE)


class BatchStatisticNotice(UserWarning):
    """Something computed from statistics of each rank's rows that shardwise does not make
    whole-batch, so the layout trains another model than one process would (rank 0, once)."""


def user_class(module: nn.Module) -> type:
    """The module's own class: fully_shard swaps a module's class for `FSDP<Class>`."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def moe_module(model: nn.Module) -> str | None:
    """The first submodule that looks like a mixture of experts (a class named for MoE,
    experts or a router, or a child named `experts`), the model itself last, or None."""
    named = list(model.named_modules())
    for fqn, module in named[1:] + named[:1]:
        if _MOE_CLASS.search(user_class(module).__name__) or fqn.rsplit(".", 1)[-1] == "experts":
            return fqn or user_class(module).__name__
    return None


def prepare(wrapped: nn.Module, model: nn.Module, batch: BatchGroups) -> None:
    """After the layout is built: whole-batch statistics in `wrapped`'s training forwards
    and transformers' load-balancing loss on them; the statements, at the first and second
    training forwards (`model` is the user's module inside `wrapped`)."""
    if batch.size == 1:
        return
    attach(wrapped, batch)
    replaced, differ = install(model)
    moe = moe_module(model)
    unseen_moe = moe is not None and not (replaced and not differ)
    forwards = 0

    def check(module: nn.Module, args: Any, kwargs: Any) -> None:
        nonlocal forwards
        if not module.training:
            return
        forwards += 1
        if forwards == 1:
            norms = _normalising(model)
            if norms and dist.get_rank() == 0:
                warnings.warn(_norm_statement(model, norms, batch.size), BatchStatisticNotice, 2)
        # The second forward: the first step's loss may be formed after its forward, from
        # what the forward returned.
        if forwards == 2:
            handle.remove()
            if unseen_moe and batch.used == 0 and dist.get_rank() == 0:
                assert moe is not None
                message = _moe_statement(model, moe, batch.size, differ)
                warnings.warn(message, BatchStatisticNotice, 2)

    handle = wrapped.register_forward_pre_hook(check, with_kwargs=True)


def _normalising(model: nn.Module) -> list[str]:
    """BatchNorm layers that normalise by the batch's own statistics now (training mode;
    SyncBatchNorm normalises by the whole batch's)."""
    return [
        fqn
        for fqn, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, SyncBatchNorm) and m.training
    ]


def _silence() -> str:
    return "warnings.filterwarnings('ignore', category=shardwise.BatchStatisticNotice)"


def _moe_statement(model: nn.Module, where: str, dp: int, differ: list[str]) -> str:
    own = (
        f" Its family's {FUNCTION} ({', '.join(differ)}) is not the Switch-style loss "
        "shardwise computes on whole-batch statistics, so it is left as it is."
        if differ
        else ""
    )
    return (
        f"shardwise: {user_class(model).__name__} has a mixture of experts ({where}), and "
        "nothing in its first training step summed a statistic over the global batch "
        f"(shardwise.global_batch_sum).{own} If it computes an auxiliary (load-balancing) "
        f"loss from routing statistics of the batch, each of the {dp} data-parallel ranks "
        "computes it from its own rows, and the router's gradient differs from one "
        "process (by 0.17-0.35 relative at world 4 in the measured cases; see docs/parity.md). Sum "
        "the statistics with shardwise.global_batch_sum(...) before forming the loss, and "
        "this layout trains what one process would. A model without such a loss is "
        f"unaffected: {_silence()} silences this."
    )


def _norm_statement(model: nn.Module, norms: list[str], dp: int) -> str:
    shown = ", ".join(norms[:3]) + (f" and {len(norms) - 3} more" if len(norms) > 3 else "")
    return (
        f"shardwise: {user_class(model).__name__} has BatchNorm layers in training mode "
        f"({shown}): each of the {dp} data-parallel ranks normalises its own rows by their "
        "own mean and variance, so training differs from one process on the whole batch "
        "(see docs/parity.md for the measured gap). For whole-batch statistics, convert them "
        "before wrap on GPUs: model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model). "
        f"If per-rank statistics are what you want, {_silence()} silences this."
    )
