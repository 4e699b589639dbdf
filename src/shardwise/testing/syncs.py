"""Counting the calls that make the host wait for a GPU, on a machine without one.

Owns: `count_host_syncs` and the list of calls it counts (`HOST_SYNCS`). The counter patches
those calls on torch's Tensor class and module for the length of the block, so it sees them
wherever Python makes them: in the forward, and in the backward too (a checkpointed block's
recompute, a hook), where torch does not carry a function mode, and on any thread, as CUDA's
autograd device thread.

Must not: count anything outside the block, or change what a call returns.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["HOST_SYNCS", "HostSyncs", "count_host_syncs"]

HOST_SYNCS = (
    "item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__format__",
    "bincount", "nonzero",
)  # fmt: skip
"""Tensor calls that make the host wait for the device when the tensor lives on a GPU: those
that bring values to the host, and those whose output's size depends on the values
(bincount reads the input's max, nonzero counts)."""
_FUNCTIONS = ("bincount", "nonzero")
"""Of those, the ones also called as torch.<name>."""
_MISSING = object()


class HostSyncs(Counter[str]):
    """Counts of host-syncing tensor calls (see `count_host_syncs`); `paused` stops counting
    (e.g. inside optimizer.step, whose own syncs are the optimizer's)."""

    paused = False


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A blocking copy from an accelerator to the host (`.to(device)` of a tensor already
    on the host, or with non_blocking=True, does not wait)."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    source = getattr(args[0], "device", None) if args else None
    blocking = not kwargs.get("non_blocking", False)
    to_host = target is not None and str(target).startswith("cpu")
    return blocking and to_host and getattr(source, "type", "cpu") != "cpu"


def _host_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An index that makes the host wait: a Python list (made a host tensor, then copied to
    the device) or a boolean mask (its nonzero count decides the output's size), also
    inside a tuple of indices; a host tensor index on an accelerator tensor too."""
    import torch

    source = getattr(args[0], "device", None) if args else None
    index = args[1] if len(args) > 1 else None
    for part in index if isinstance(index, tuple) else (index,):
        if isinstance(part, list):
            return True
        if isinstance(part, torch.Tensor):
            if part.dtype == torch.bool and part.dim() > 0:
                return True
            on_host = part.device.type == "cpu" and part.dim() > 0
            if on_host and getattr(source, "type", "cpu") != "cpu":
                return True
    return False


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count, inside the block, the tensor calls that would make the host wait for a GPU:
    `.item()`, `float()`/`int()`/`bool()` of a tensor, `.tolist()`, `.numpy()`, `.cpu()`,
    formatting, `bincount` and `nonzero` (their output's size depends on the values), an
    index by a Python list or a boolean mask (`__getitem__`), and a blocking `.to("cpu")` of
    an accelerator tensor. All but the last are counted on CPU
    tensors too, so a CPU test can bound a step's syncs; on a GPU,
    torch.cuda.set_sync_debug_mode is the same check, and also sees `.to("cpu")`.

    Calls made in backward count too (a recompute, a hook), from any thread. A call made
    inside a counted one (formatting reads `.item()`) is not counted again.
    """
    import torch

    counts = HostSyncs()
    inside = threading.local()

    def counted(
        name: str, original: Callable[..., Any], when: Callable[..., bool] | None = None
    ) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(inside, "depth", 0)
            if not depth and not counts.paused and (when is None or when(args, kwargs)):
                counts[name] += 1
            inside.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                inside.depth = depth

        return call

    patches: list[tuple[Any, str, Callable[..., Any]]] = [
        (torch.Tensor, name, counted(name, getattr(torch.Tensor, name))) for name in HOST_SYNCS
    ]
    patches.append((torch.Tensor, "to", counted("to", torch.Tensor.to, _to_host)))
    getitem = counted("__getitem__", torch.Tensor.__getitem__, _host_index)
    patches.append((torch.Tensor, "__getitem__", getitem))
    patches += [(torch, name, counted(name, getattr(torch, name))) for name in _FUNCTIONS]
    saved = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in patches]
    try:
        for owner, name, patched in patches:
            setattr(owner, name, patched)
        yield counts
    finally:
        for owner, name, before in saved:
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
