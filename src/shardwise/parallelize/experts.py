"""Expert parallelism: whole experts spread over the ranks of an `ep` group, each token sent
to the ranks that hold its experts and back.

Owns: finding a model's experts modules (a Hugging Face mixture of experts stores each
layer's experts as 3-D parameters, experts first, in a module with `num_experts` whose
forward takes (hidden_states, top_k_index, top_k_weights)), the checks before any group
exists (a model with experts, num_experts divisible by ep), splitting each experts
parameter's first dimension over the mesh's ep dimension (Shard(0): every rank holds
num_experts / ep whole experts), and the dispatch and combine around the module's own
forward:

1. each token's k copies are sorted by expert, and so by the rank that holds it;
2. the counts, then the rows and their local expert ids, go to those ranks
   (all_to_all_single with uneven splits; the rows' all-to-all carries the gradient);
3. the module's own expert math runs there on the rows it received, with local ids;
4. the outputs travel back in the order they left and are weighted on the token's own
   rank by the router's weights, whose gradient therefore stays local, and summed per
   token in expert order, as the module itself sums them.

Each local expert joins the backward even when no token reached it, so FSDP's reduction
over the ranks that shard the experts never waits for a gradient one rank lacks.

A run without values (the memory simulation, on fake tensors) cannot count tokens: inside
`stated_routing(load)` the dispatcher takes the counts from a stated routing instead of
from the router (`StatedRouting`), and moves fake rows of those sizes.

Must not: write collectives of its own (torch's all_to_all_single and its autograd
version move the data), shard over the data-parallel ranks (fsdp.py does, over what ep
leaves), or split an expert's own matrices (that is tp, moe.py).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from shardwise.parallelize.moe import ExpertsParallel, local_parameters
from shardwise.parallelize.tensor import CheckedPlan

__all__ = [
    "apply_expert_parallel",
    "check_expert_load",
    "check_expert_parallel",
    "find_experts",
    "plan_without_experts",
    "stated_routing",
]

_ROUTED = ("hidden_states", "top_k_index", "top_k_weights")


def _is_experts(module: nn.Module) -> bool:
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if not isinstance(n, int) or n < 1 or not params:
        return False
    if any(p.dim() < 2 or p.shape[0] != n for p in params):
        return False
    names = list(inspect.signature(module.forward).parameters)[:3]
    return len(names) == 3 and names[1] in ("top_k_index", "router_indices", "topk_indices")


def _count(module: nn.Module) -> int:
    n = getattr(module, "num_experts", None)
    assert isinstance(n, int)  # _is_experts checked it
    return n


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Every experts module of `model`, by name (see the module docstring)."""
    return {name: m for name, m in model.named_modules() if _is_experts(m)}


def check_expert_parallel(model: nn.Module, ep: int) -> dict[str, nn.Module]:
    """The experts modules ep spreads, refusing a model it cannot spread, before any group
    exists (the same on every rank)."""
    found = find_experts(model)
    if not found:
        raise ValueError(
            f"ParallelConfig.ep={ep}: {type(model).__name__} has no experts module to "
            "spread over ranks (shardwise finds a mixture of experts' experts stored as 3-D "
            "parameters, experts first, in a module with num_experts whose forward takes "
            "(hidden_states, top_k_index, top_k_weights), as transformers' MoE families do). "
            "Use ep=1 for a dense model."
        )
    for name, module in found.items():
        n = _count(module)
        if n % ep:
            fits = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"ParallelConfig.ep={ep} does not divide {name}.num_experts={n}: every rank "
                f"of an ep group holds the same number of whole experts. Choose ep in {fits}."
            )
    return found


ExpertLoad = float | Literal["worst"]
"""How unevenly a stated routing loads the ranks: the rows the busiest rank receives over
the balanced count (>= 1), or "worst" (every copy that can reach one rank does)."""


@dataclass
class StatedRouting:
    """Token counts for a run that has no router values (see the module docstring).

    Each rank sends its n = tokens x k copies evenly over the ep ranks. The rank simulated
    is the busiest one: it receives `load` x n rows (n is what a rank receives on average),
    evenly from every sender, but never more than can reach it: each token sends at most
    min(k, local experts) copies to one rank (top-k picks distinct experts), so ep x tokens
    x min(k, local) in all. `seen` records each dispatch: (tokens, k, rows received).
    """

    load: ExpertLoad
    seen: list[tuple[int, int, int]] = field(default_factory=list)

    def splits(self, tokens: int, k: int, ep: int, local: int) -> tuple[list[int], list[int]]:
        bound = ep * tokens * min(k, local)
        rows = bound if self.load == "worst" else min(math.ceil(self.load * tokens * k), bound)
        self.seen.append((tokens, k, rows))
        return _even(tokens * k, ep), _even(rows, ep)


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


_STATED: list[StatedRouting] = []


EXPERT_LOAD_CHOICES = (
    "give the busiest rank's received rows over the balanced count, a number >= 1 "
    "(1: perfectly balanced), or 'worst'."
)


def check_expert_load(load: object) -> ExpertLoad:
    """`load` if it is one a stated routing takes; a ValueError naming the choices. An
    infinite load is no count of rows ('worst' is the most that can reach a rank)."""
    if load == "worst" or (isinstance(load, (int, float)) and math.isfinite(load) and load >= 1):
        return load
    raise ValueError(f"expert_load={load!r}: {EXPERT_LOAD_CHOICES}")


@contextlib.contextmanager
def stated_routing(load: ExpertLoad) -> Iterator[StatedRouting]:
    """While it is open, dispatchers take their counts from a `StatedRouting(load)`."""
    routing = StatedRouting(check_expert_load(load))
    _STATED.append(routing)
    try:
        yield routing
    finally:
        _STATED.remove(routing)


def apply_expert_parallel(
    modules: dict[str, nn.Module], ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None
) -> None:
    """Split each experts module's parameters over `ep_mesh` (Shard(0)), in place, and make
    its forward dispatch tokens to their experts' ranks and combine them back. With
    `tp_mesh` (ep takes whole tp groups), each tp rank sends only its 1/tp of the tokens
    its tp group shares, and the combined rows are gathered back over tp (`_over_tp`)."""
    ep = ep_mesh.size()
    group = ep_mesh.get_group()
    for module in modules.values():
        names = tuple(module._parameters)
        for name in names:
            param = module._parameters[name]
            assert param is not None  # _is_experts saw every one
            module._parameters[name] = nn.Parameter(
                distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                requires_grad=param.requires_grad,
            )
        local = _count(module) // ep
        own = type(module).forward.__get__(module)
        forward = _dispatcher(module, own, names, group, ep, local)
        module.forward = forward if tp_mesh is None else _over_tp(forward, tp_mesh)


def _over_tp(
    forward: Callable[..., torch.Tensor], tp_mesh: DeviceMesh
) -> Callable[..., torch.Tensor]:
    """`forward` on this tp rank's 1/tp of the tokens a tp group shares, gathered back.

    The rows are padded to a multiple of tp (padding goes to expert 0 with weight 0, and is
    cut off after the gather). Splitting and gathering go through DTensor, whose backward
    all-gathers the split's gradient (the router's and the hidden states' gradients come
    out whole on every tp rank, as without ep) and keeps each rank's own part of the
    gather's."""
    tp = tp_mesh.size()

    def shard(t: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
        return whole.redistribute(tp_mesh, [Shard(0)]).to_local()

    def split(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        pad = -rows % tp
        if pad:
            hidden = nn.functional.pad(hidden, (0, 0, 0, pad))
            index = nn.functional.pad(index, (0, 0, 0, pad))
            weights = nn.functional.pad(weights, (0, 0, 0, pad))
        mine = index.chunk(tp)[tp_mesh.get_local_rank()]
        out = forward(shard(hidden), mine, shard(weights))
        gathered = DTensor.from_local(out, tp_mesh, [Shard(0)], run_check=False)
        return gathered.redistribute(tp_mesh, [Replicate()]).to_local()[:rows]

    return split


def _dispatcher(
    module: nn.Module,
    own: Callable[..., torch.Tensor],
    names: tuple[str, ...],
    group: Any,
    ep: int,
    local: int,
) -> Callable[..., torch.Tensor]:
    whole = _count(module)

    def forward(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = index.shape[-1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, so by owning rank
        expert = flat[order]
        owner = torch.div(expert, local, rounding_mode="floor")
        if _STATED:  # no values to count: the stated routing's counts, ids of that many
            sent, got = _STATED[-1].splits(flat.numel() // k, k, ep, local)
            ids = torch.zeros(sum(got), dtype=expert.dtype, device=expert.device)
        else:
            send = _per_rank(owner, ep)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            # The splits must be on the host: one wait for the device per layer, for both.
            both = torch.cat([send, recv]).tolist()
            sent, got = both[:ep], both[ep:]
            ids = torch.empty(sum(got), dtype=expert.dtype, device=expert.device)
            dist.all_to_all_single(ids, expert - owner * local, got, sent, group=group)
        rows = torch.div(order, k, rounding_mode="floor")  # each copy's token
        received = all_to_all_single_autograd(hidden[rows], got, sent, group)
        ones = torch.ones(ids.shape[0], 1, dtype=weights.dtype, device=weights.device)
        with local_parameters(module, names):
            module.__dict__["num_experts"] = local  # the module's own one-hot counts these
            try:
                out = own(received, ids[:, None], ones)
                # The received rows and every local expert join the backward, reached by a
                # token or not. A forward that loops over the experts its tokens reach
                # (transformers' eager experts) computes nothing on a rank that received no
                # token: without the first term its backward would skip the all-to-all
                # the other ranks wait in (a hang), and without the others its experts
                # would have no gradient while another rank of their shard group has one.
                # One scalar holds every term: `out` is added to once.
                zero = received.sum() * 0
                for n in names:
                    param = module._parameters[n]
                    assert param is not None
                    zero = zero + param.sum() * 0
                out = out + zero
            finally:
                module.__dict__["num_experts"] = whole
        back = all_to_all_single_autograd(out, sent, got, group)
        weight = weights.reshape(-1)[order].to(back.dtype)
        combined = torch.zeros_like(hidden)
        return combined.index_add(0, rows, back * weight[:, None])

    return forward


def _per_rank(owner: torch.Tensor, ep: int) -> torch.Tensor:
    """How many of the sorted copies go to each of the ep ranks, on the device: bincount
    would wait for the device (on CUDA it reads the input's max to size its output)."""
    ranks = torch.arange(ep + 1, dtype=owner.dtype, device=owner.device)
    return torch.diff(torch.searchsorted(owner, ranks))


def plan_without_experts(plan: CheckedPlan, ep: int) -> CheckedPlan:
    """A tp plan with its experts entries left out: under ep the experts are whole on every
    rank of a tp group (attention and the dense layers stay under tp)."""
    if not isinstance(plan.apply, dict):
        raise NotImplementedError(
            f"ParallelConfig.ep={ep} with a callable tp_plan is not built yet: shardwise "
            "cannot tell whether the callable also splits the experts, which ep spreads "
            "instead. Give tp_plan as a dict (or 'auto')."
        )
    kept = {k: v for k, v in plan.apply.items() if not isinstance(v, ExpertsParallel)}
    said = {k: v for k, v in plan.described.items() if k in kept}
    return CheckedPlan(kept, said)
