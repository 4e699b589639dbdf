"""Sequence parallelism: the tensor-parallel plan extended so that what runs between split
layers (norms, residual adds, dropout) sees 1/tp of the tokens on each rank.

Owns: rewriting a checked plan for `ParallelConfig.sequence_parallel` and the one small
ParallelStyle that moves a layer's hidden states between a split sequence and whole ones.

Where the split sequence lives: inside the decoder layers only. The first layer's input is
cut into tp parts along the sequence; the last layer's output is gathered whole. It cannot
start at the embedding output, as torchtitan's own models do, because a Hugging Face model
takes its positions and causal mask from that tensor's length. Inside each layer:
- a child the plan splits (attention, MLP) gathers the hidden states whole on entry, and its
  row-split projection returns them split again (a reduce-scatter instead of an all-reduce);
- a child with parameters the plan leaves whole (a norm) runs on its split tokens through
  torch's SequenceParallel, which sums its weight's gradient over tp.

An experts block (moe.py) gathers its tokens as a plain tensor and cuts its summed output
back to this rank's tokens (see `_block_style`).

Must not: write collectives (DTensor's redistribute moves the data), or change the layers
outside the decoder (the embedding, the final norm and the head see whole sequences).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from shardwise.parallelize.moe import ExpertsParallel

__all__ = ["HiddenStates", "add_sequence_parallel"]

SEQ = Shard(1)  # (batch, sequence, hidden): the sequence dimension


class HiddenStates(ParallelStyle):
    """Move a module's hidden states (its first positional argument, or the keyword
    `hidden_states` as Hugging Face attention takes it) from one layout to another on entry,
    and its output (or its output's first element) on exit. `None` leaves a side alone."""

    def __init__(
        self,
        given: Placement | None = None,
        wanted: Placement | None = None,
        *,
        out: tuple[Placement, Placement] | None = None,
        local_input: bool = True,
    ) -> None:
        super().__init__()
        self.given, self.wanted, self.out, self.local_input = given, wanted, out, local_input

    def _move(self, x: Any, mesh: DeviceMesh, given: Placement, wanted: Placement, local: bool,
              where: str) -> Any:  # fmt: skip
        if not isinstance(x, Tensor):
            return x
        if not isinstance(x, DTensor):
            if wanted == SEQ and x.shape[1] % mesh.size() != 0:
                raise ValueError(
                    f"ParallelConfig.sequence_parallel=True with tp={mesh.size()}: this "
                    f"batch's sequence length {x.shape[1]} ({where}) does not divide by "
                    f"{mesh.size()}. Pad every batch to a multiple of {mesh.size()} (a "
                    f"collator's pad_to_multiple_of={mesh.size()}), or leave "
                    "sequence_parallel off."
                )
            x = DTensor.from_local(x, mesh, (given,), run_check=False)
        x = x.redistribute(placements=(wanted,))
        return x.to_local() if local else x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(module).__name__
        if self.given is not None and self.wanted is not None:
            given, wanted, local = self.given, self.wanted, self.local_input

            def on_entry(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:  # type: ignore[type-arg]
                if args:
                    first = self._move(args[0], device_mesh, given, wanted, local, name)
                    return (first, *args[1:]), kwargs
                if "hidden_states" in kwargs:
                    moved = self._move(kwargs["hidden_states"], device_mesh, given, wanted,
                                       local, name)  # fmt: skip
                    return args, {**kwargs, "hidden_states": moved}
                raise TypeError(
                    f"ParallelConfig.sequence_parallel=True: {name} was called with neither "
                    "a positional input nor hidden_states=, so shardwise cannot find the "
                    "hidden states to split. Leave sequence_parallel off for this model."
                )

            module.register_forward_pre_hook(on_entry, with_kwargs=True)
        if self.out is not None:
            out_given, out_wanted = self.out

            def on_exit(_: nn.Module, args: tuple, output: Any) -> Any:  # type: ignore[type-arg]
                if isinstance(output, tuple):
                    first = self._move(output[0], device_mesh, out_given, out_wanted, True, name)
                    return (first, *output[1:])
                return self._move(output, device_mesh, out_given, out_wanted, True, name)

            module.register_forward_hook(on_exit)
        return module


def _layer_lists(model: nn.Module, planned: set[str]) -> list[str]:
    """The outermost ModuleLists whose elements hold planned modules (a decoder's layers)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(f"{f}.") for f in found):
            continue
        if any(p.startswith(f"{name}.") for p in planned):
            found.append(name)
    return found


def _split_seq_io(style: ParallelStyle, where: str) -> ParallelStyle:
    """A planned layer's style with the split sequence on its outer side."""
    if isinstance(style, ColwiseParallel):  # takes split tokens, gathers them itself
        return ColwiseParallel(input_layouts=SEQ, output_layouts=style.output_layouts[0],
                               use_local_output=style.use_local_output)  # fmt: skip
    if isinstance(style, RowwiseParallel):  # returns split tokens: a reduce-scatter
        return RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=SEQ,
                               use_local_output=style.use_local_output)  # fmt: skip
    raise NotImplementedError(
        f"ParallelConfig.sequence_parallel=True: {where} has the style "
        f"{type(style).__name__}, which shardwise cannot place on a split sequence yet. "
        "Leave sequence_parallel off, or give a callable tp_plan that applies your own "
        "sequence-parallel styles."
    )


def add_sequence_parallel(
    model: nn.Module, plan: dict[str, ParallelStyle], described: dict[str, str]
) -> dict[str, ParallelStyle]:
    """`plan` (one style per module name) with the decoder layers running on split
    sequences, as a new dict. Adds its entries to `described`."""
    modules = dict(model.named_modules())
    concrete = dict(plan)
    lists = _layer_lists(model, set(concrete))
    if not lists:
        raise ValueError(
            "ParallelConfig.sequence_parallel=True, but the plan splits no module inside a "
            "list of layers (an nn.ModuleList such as a decoder's layers), and the split "
            "sequence lives inside those. Leave sequence_parallel off for this model."
        )
    for list_name in lists:
        layers = modules[list_name]
        assert isinstance(layers, nn.ModuleList)
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            prefix = f"{list_name}.{i}"
            if prefix in concrete:
                raise NotImplementedError(
                    f"ParallelConfig.sequence_parallel=True: the plan gives the whole layer "
                    f"{prefix} a style; shardwise splits sequences only around the layers' "
                    "children. Leave sequence_parallel off, or use a callable tp_plan."
                )
            if i in (0, last):
                concrete[prefix] = HiddenStates(
                    Replicate() if i == 0 else None, SEQ if i == 0 else None,
                    out=(SEQ, Replicate()) if i == last else None,
                )  # fmt: skip
            for child, sub in layer.named_children():
                name = f"{prefix}.{child}"
                inside = [n for n in concrete if n.startswith(f"{name}.")]
                if name in concrete:
                    concrete[name] = _split_seq_io(concrete[name], name)
                elif inside:  # attention, MLP: whole tokens in, split tokens out
                    concrete[name] = _block_style(name, inside, concrete)
                    described.setdefault(_pattern(list_name, child), "gathers the sequence")
                    for n in inside:
                        if isinstance(concrete[n], RowwiseParallel):
                            concrete[n] = _split_seq_io(concrete[n], n)
                elif any(True for _ in sub.parameters()):  # a norm: on its own tokens
                    concrete[name] = SequenceParallel(use_local_output=True)
                    described.setdefault(_pattern(list_name, child), "sequence_parallel")
        described[f"{list_name}.*"] = "sequence split at the first, gathered after the last"
    for name, style in concrete.items():
        if isinstance(style, ExpertsParallel) and not isinstance(
            concrete.get(name.rpartition(".")[0]), HiddenStates
        ):
            raise NotImplementedError(
                f"ParallelConfig.sequence_parallel=True: the experts {name} do not sit "
                "directly inside a decoder layer's child (as layers.*.mlp.experts), so "
                "shardwise cannot gather and split their tokens. Leave sequence_parallel off."
            )
    return concrete


def _block_style(name: str, inside: list[str], concrete: dict[str, ParallelStyle]) -> HiddenStates:
    """A layer's child that holds split layers gathers the sequence on entry. One holding
    experts directly (the MoE MLP) differs: its router is whole (a plain weight that cannot
    meet a DTensor input) and its experts flatten batch and sequence into one token
    dimension, so their sum cannot come back split along the sequence as a row-split
    projection's does (a reduce-scatter). It takes the gathered tokens as a plain tensor,
    and its output, whole after the experts' sum, is cut back to this rank's tokens (a
    local slice; its backward gathers the gradient)."""
    if any(
        isinstance(concrete[n], ExpertsParallel) and n.rpartition(".")[0] == name for n in inside
    ):
        return HiddenStates(SEQ, Replicate(), out=(Replicate(), SEQ))
    return HiddenStates(SEQ, Replicate(), local_input=False)


def _pattern(list_name: str, child: str) -> str:
    return f"{list_name}.*.{child}"
