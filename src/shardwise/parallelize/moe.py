"""Tensor parallelism for a mixture of experts stored as 3-D parameters (Hugging Face's
Mixtral, Qwen3-MoE: `experts.gate_up_proj` (experts, 2 x intermediate, hidden) with gate and
up packed along dim 1, and `experts.down_proj` (experts, hidden, intermediate)).

Owns: the one ParallelStyle for such an experts module (`ExpertsParallel`), turning the plan
words of its parameters ('packed_colwise', 'rowwise', under a 'moe_tp_experts' entry) into
tp placements, and the plan-time check that those words cover every parameter the module has.

How it splits: every tp rank keeps every expert and holds 1/tp of each expert's intermediate
columns. 'packed_colwise' is a strided split of dim 1 (each rank gets its part of gate AND its
part of up; a plain Shard(1) would give one rank every gate column and the other every up
column); 'rowwise' splits the last dim (the intermediate one) to match. The module's own
forward then runs on its local parts, so each rank's output is a partial sum of the experts'
output: it is made a Partial DTensor and redistributed to Replicate (the all-reduce), and the
floating inputs (hidden states, routing weights) get Partial gradients that DTensor sums over
tp in the backward. The router stays whole on every rank and sees whole tokens, so its
gradient is the same on the ranks of a tp group. The data-parallel dimensions (FSDP2's Shard(0),
the experts dimension) compose with these placements on dims 1 and 2.

Must not: write collectives (DTensor's redistribute moves the data), import from tensor.py or
sequence.py (they import this), or split the experts dimension (that is expert parallelism,
which this is not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["EXPERTS_WORD", "PARAM_WORDS", "ExpertsParallel", "local_parameters"]

EXPERTS_WORD = "moe_tp_experts"
"""The plan word of an experts module; its parameters have entries of their own."""
PARAM_WORDS = ("packed_colwise", "rowwise")
"""The words a parameter of an experts module may have (transformers' words)."""


def placement_for(word: str, ndim: int) -> Placement:
    """The tp placement of an experts parameter of `ndim` dims (experts, out, in)."""
    if word == "packed_colwise":  # [gate; up] along the output dim: each rank its part of both
        return _StridedShard(ndim - 2, split_factor=2)
    if word == "rowwise":  # the input dim, the intermediate one for down_proj
        return Shard(ndim - 1)
    raise NotImplementedError(
        f"tensor-parallel plan word {word!r} on a parameter of a 'moe_tp_experts' module is "
        f"not supported (shardwise knows {', '.join(PARAM_WORDS)} there). Give the experts "
        "module an ExpertsParallel with placements of your own in a tp_plan dict."
    )


class ExpertsParallel(ParallelStyle):
    """Split an experts module's 3-D parameters over tp and sum its output over tp.

    `splits` maps each of the module's parameter names to a plan word ('packed_colwise',
    'rowwise') or to a torch Placement on the tp dimension (as a test's wrong layout)."""

    def __init__(self, splits: Mapping[str, str | Placement]) -> None:
        super().__init__()
        for how in splits.values():
            if isinstance(how, str):
                placement_for(how, 3)  # an unknown word is refused at plan time
        self.splits = dict(splits)

    def __repr__(self) -> str:
        return f"ExpertsParallel({self.splits})"

    def check_covers(self, module: nn.Module, where: str) -> None:
        """Every parameter of the experts module needs a split: one left whole would be
        counted tp times when the partial outputs are summed (a bias, say)."""
        own = {n for n, _ in module.named_parameters(recurse=False)}
        inner = [n for n, _ in module.named_parameters() if n not in own]
        missing = sorted(own - set(self.splits))
        unknown = sorted(set(self.splits) - own)
        if missing or unknown or inner:
            raise ValueError(
                f"ParallelConfig.tp_plan: the 'moe_tp_experts' module {where} has the "
                f"parameters {sorted(own)}{f' and inner ones {inner[:3]}' if inner else ''}, "
                f"but the plan splits {sorted(self.splits)}: each of its own parameters, and "
                f"no other, needs a split (an entry '<experts>.<name>' with one of "
                f"{', '.join(PARAM_WORDS)}, or a key of ExpertsParallel's splits); one left "
                "whole would be summed tp times. Fix the plan, or leave the experts out of it."
            )
        if getattr(module, "is_transposed", False):
            raise NotImplementedError(
                f"ParallelConfig.tp_plan: the experts module {where} stores its weights "
                "transposed (is_transposed=True); shardwise splits (experts, out, in) "
                "weights only. Leave its entries out of tp_plan, or give it a style of yours."
            )

    def _placement(self, name: str, param: Tensor, tp: int, where: str) -> Placement:
        how = self.splits[name]
        placement = placement_for(how, param.ndim) if isinstance(how, str) else how
        if param.ndim != 3:
            raise ValueError(
                f"ParallelConfig.tp_plan: {where}.{name} has shape {tuple(param.shape)}; a "
                "'moe_tp_experts' module's parameters are 3-D (experts, out, in). Leave it "
                "out of tp_plan, or give its module a style of your own."
            )
        if isinstance(placement, Shard | _StridedShard):
            strided = placement.split_factor if isinstance(placement, _StridedShard) else 1
            parts = tp * int(strided)
            size = int(param.shape[placement.dim])
            if size % parts:
                raise ValueError(
                    f"ParallelConfig.tp={tp}: {where}.{name} has {size} rows on dim "
                    f"{placement.dim}, which do not split into {parts} equal parts. Choose a "
                    "tp that divides the experts' intermediate size."
                )
        return placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        where = type(module).__name__
        self.check_covers(module, where)
        for name, param in list(module.named_parameters(recurse=False)):
            placement = self._placement(name, param, device_mesh.size(), where)
            split = distribute_tensor(
                param, device_mesh, [placement], src_data_rank=self.src_data_rank
            )
            module.register_parameter(name, nn.Parameter(split, param.requires_grad))
        forward = _summed_over_tp(module, module.forward, device_mesh, tuple(self.splits))
        module.forward = forward
        return module


def _summed_over_tp(
    module: nn.Module, forward: Callable[..., Any], mesh: DeviceMesh, names: tuple[str, ...]
) -> Callable[..., Tensor]:
    """`forward` on this rank's parts of the experts, its output summed over tp."""

    def run(*args: Any, **kwargs: Any) -> Tensor:
        args = tuple(_partial_gradient(a, mesh) for a in args)
        kwargs = {k: _partial_gradient(v, mesh) for k, v in kwargs.items()}
        with local_parameters(module, names):
            out = forward(*args, **kwargs)
        if not isinstance(out, Tensor) or isinstance(out, DTensor):
            raise TypeError(
                f"ParallelConfig.tp_plan: {type(module).__name__} returned "
                f"{type(out).__name__}; a 'moe_tp_experts' module must return one tensor "
                "(the experts' output), which shardwise sums over tp."
            )
        # Each rank ran its part of every expert's intermediate columns: a partial sum.
        summed = DTensor.from_local(out, mesh, (Partial(),), run_check=False)
        return summed.redistribute(mesh, (Replicate(),)).to_local()

    return run


def _partial_gradient(x: Any, mesh: DeviceMesh) -> Any:
    """A floating input, the same on every tp rank: each rank's gradient of it is a part
    (it met only that rank's columns), so DTensor sums it over tp in the backward."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        return x  # the routing indices
    if isinstance(x, DTensor):
        x = x.redistribute(mesh, (Replicate(),)).to_local()
    whole = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    return whole.to_local(grad_placements=(Partial(),))


@contextmanager
def local_parameters(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """The module's forward sees plain local tensors (its own code indexes and chunks them,
    which DTensor cannot follow on a strided split); `to_local` keeps the gradient flowing to
    the DTensor parameters, which FSDP may have swapped in for its unsharded ones."""
    params = module._parameters
    saved = {n: params[n] for n in names}
    try:
        for n, p in saved.items():
            assert isinstance(p, DTensor), f"{n} was not split over a mesh (tp or ep)"
            params[n] = cast(nn.Parameter, p.to_local())  # a view for this forward only
        yield
    finally:
        params.update(saved)
