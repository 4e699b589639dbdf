"""The instant activation estimate: trace the forward once on fake tensors.

Owns: `trace_activations`, which runs the model's forward on a meta copy given fake CPU
storage (torch's `FakeTensorMode`: shapes and dtypes, no memory, no process group; plain
meta tensors cannot run models that branch on values, like Hugging Face's mask builders)
and records what autograd saves for backward, in total and per planned
block, and `ActivationTrace.activations(k)`, the bytes kept alive when every k-th block is
checkpointed. `shardwise.memory.estimate_peak` adds them to the model states.

Why a trace and not a formula: what a block saves depends on its code (attention kernel,
norm upcasts, dropout masks), which only running it reveals. Fake tensors run it for the
cost of the shapes. The full simulation (`shardwise.memory.simulate_step`) is the exact
answer; this is the one-second one, checked against it within 10%
(tests/unit/memory/test_autoplan.py).

Must not: allocate real tensors, or change the caller's model (the trace works on a meta
copy whose parameters it may cast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.memory.fake import (
    ExampleInput,
    call_model,
    default_input,
    fake_materialize,
    loss_of,
    meta_copy,
    shaped_grouped_mm,
    unpacked_rows,
)

__all__ = ["ActivationTrace", "BlockTrace", "trace_activations"]


@dataclass(frozen=True)
class BlockTrace:
    """One planned block's forward: bytes it saved for backward, and its inputs' bytes
    (what a checkpointed block keeps instead)."""

    fqn: str
    saved: int
    inputs: int


@dataclass(frozen=True)
class ActivationTrace:
    """What one forward saves for backward, in bytes, at one micro-batch.

    `saved` counts each storage once (views share storage) and leaves out parameters.
    `largest` is the largest saved tensor, usually the logits or their fp32 copy for the
    loss: backward starts by allocating gradients of that size.
    """

    batch: int
    seq_len: int | None
    dtype: str
    saved: int
    largest: int
    blocks: list[BlockTrace] = field(default_factory=list)

    def activations(self, every: int) -> int:
        """Bytes held at the start of backward when every `every`-th block (0: none) is
        checkpointed: a checkpointed block keeps only its inputs."""
        if every <= 0 or not self.blocks:
            return self.saved
        chosen = self.blocks[::every]
        return self.saved - sum(b.saved for b in chosen) + sum(b.inputs for b in chosen)

    def recompute(self, every: int) -> int:
        """The most one checkpointed block holds again while its backward runs."""
        if every <= 0 or not self.blocks:
            return 0
        return max(b.saved for b in self.blocks[::every])


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


def trace_activations(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int | None,
    blocks: Sequence[str] = (),
    compute_dtype: torch.dtype | None = None,
    keep_fp32: Sequence[str] = (),
    autocast: bool = False,
    example_input: ExampleInput | None = None,
) -> ActivationTrace:
    """Run one forward (and the loss) of a meta copy of `model` and record saved bytes.

    `blocks` are the planned blocks' module FQNs. `compute_dtype` casts the copy's
    floating parameters as FSDP2's mixed precision does (except modules in `keep_fp32`),
    or, with `autocast=True`, runs under autocast as DDP's mixed precision does.
    `example_input()` is called under fake tensors; without it the default integer tokens
    and labels of shape (batch, seq_len) are used.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if seq_len is None and example_input is None:
        raise ValueError(
            "trace_activations: seq_len=None and no example_input: give the sequence length "
            "of the default (batch, seq_len) token input, or example_input."
        )
    twin = meta_copy(model)
    if compute_dtype is not None and not autocast:
        fp32 = tuple(twin.get_submodule(f) for f in keep_fp32)
        kept = {id(p) for m in fp32 for p in m.parameters()}
        for p in twin.parameters():
            if p.is_floating_point() and id(p) not in kept:
                p.data = p.data.to(compute_dtype)
    fake_mode = FakeTensorMode()
    with fake_mode:
        fake_materialize(twin, torch.device("cpu"))
    own = {_storage_key(p)[0] for p in twin.parameters()}
    seen: dict[int, int] = {}
    largest = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        if not isinstance(t, nn.Parameter):
            key, nbytes = _storage_key(t)
            if key not in own and key not in seen:
                seen[key] = nbytes
                largest = max(largest, nbytes)
        return t

    per_block: list[BlockTrace] = []
    handles = []
    for fqn in blocks:
        module = twin.get_submodule(fqn)
        state: dict[str, int] = {}

        def pre(mod: nn.Module, args: Any, kwargs: Any, state: dict[str, int] = state) -> None:
            state["before"] = sum(seen.values())
            flat = [*args, *kwargs.values()]
            state["inputs"] = sum(
                t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor)
            )

        def post(
            mod: nn.Module,
            args: Any,
            kwargs: Any,
            out: Any,
            fqn: str = fqn,
            state: dict[str, int] = state,
        ) -> None:
            saved = sum(seen.values()) - state["before"]
            per_block.append(BlockTrace(fqn, saved, state["inputs"]))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        twin.train()
        cast = (
            torch.autocast("cpu", dtype=compute_dtype)
            if autocast and compute_dtype is not None
            else contextlib.nullcontext()
        )
        saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with fake_mode, cast, shaped_grouped_mm(), unpacked_rows(), saving:
            inputs = (
                example_input()
                if example_input is not None
                else default_input(twin, batch, int(seq_len or 0))
            )
            loss_of(call_model(twin, inputs))
    finally:
        for h in handles:
            h.remove()
    return ActivationTrace(
        batch=batch,
        seq_len=seq_len,
        dtype=str(compute_dtype or "native").removeprefix("torch."),
        saved=sum(seen.values()),
        largest=largest,
        blocks=per_block,
    )
