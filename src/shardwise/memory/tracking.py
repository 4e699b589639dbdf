"""Measuring one step with torch's memory trackers: the part the simulation (fake tensors)
and the real-run checks (real tensors) share, so both measure exactly the same thing.

Owns: the tracker for a model (FSDPMemTracker for FSDP2, MemTracker otherwise, frozen
parameters left unhooked), reading its peak by shardwise's categories, each category's own
peak, the optimizer state every steady step starts with, DDP's buckets (which no tracker
sees), and `tracked_step`.

Must not: build, wrap or fake anything (simulate.py and stages.py do).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.memory.fake import ExampleInput, call_model, loss_of

__all__ = ["CATEGORIES", "tracked_step"]

# torch's category names (the trackers' `_RefType` values) -> ours.
_CATEGORIES = {
    "Sharded Param": "params",
    "Parameter": "params",
    "Unsharded Param": "gathered_params",
    "Buffer": "buffers",
    "Sharded Grad": "grads",
    "Gradient": "grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Inputs": "inputs",
    "Input": "inputs",
    "Other": "other",
}
CATEGORIES: tuple[str, ...] = (
    "params",
    "gathered_params",
    "buffers",
    "grads",
    "unsharded_grads",
    "activations",
    "temporaries",
    "all_gather",
    "reduce_scatter",
    "optimizer",
    "inputs",
    "other",
    "ddp_buckets",
)


def _ddp_bucket_bytes(model: nn.Module) -> int:
    """DDP's reducer keeps one flat copy of the gradients (its buckets), unless gradients
    are views into them (`gradient_as_bucket_view`)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _tracker(model: nn.Module, optimizer: Any, inputs: Any) -> Any:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        fsdp_tracker = FSDPMemTracker(model, optimizer)
        fsdp_tracker.track_inputs(inputs if isinstance(inputs, tuple) else (inputs,))
        return fsdp_tracker
    tracker = MemTracker()
    _skip_frozen_grad_hooks(tracker, model)
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen_grad_hooks(tracker: Any, model: nn.Module) -> None:
    """torch's MemTracker hooks every parameter's gradient as it meets the parameter, and
    `register_hook` refuses one that does not require a gradient: a model with frozen
    parameters (an adapter model under ddp) could not be simulated. A frozen parameter gets
    no gradient, so it is marked as hooked already, with handles that remove nothing."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def _peaks(tracker: Any) -> tuple[int, dict[str, int], dict[str, int]]:
    """(total peak, categories at the peak, each category's own peak) on one device."""
    snapshot = tracker.get_tracker_snapshot("peak")
    if len(snapshot) > 1:
        raise RuntimeError(f"simulate_step: memory on more than one device: {list(snapshot)}")
    dev_snap: dict[Any, int] = next(iter(snapshot.values()), {})
    at_peak: dict[str, int] = {}
    total = 0
    for key, value in dev_snap.items():
        if key == "Total":
            total = int(value)
            continue
        name = _CATEGORIES.get(getattr(key, "value", str(key)), "other")
        at_peak[name] = at_peak.get(name, 0) + int(value)
    own = dict(getattr(tracker, "_shardwise_category_peaks", {}))
    return total, at_peak, own


def _global_peak(tracker: Any) -> Any:
    """The tracker's update of its step-wide peak alone: torch's `_update_peak_stats` also
    updates the local peak of every module it has met (a loop over all modules at every
    allocation, quadratic in the depth), which nothing here reads."""

    def update(peak_state: Any) -> None:
        for dev, dev_snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < dev_snap["Total"]:
                tracker._peak_mem[dev] = dev_snap["Total"]
                tracker._peak_mem_snap[dev] = dict(dev_snap)  # keys and values immutable

    return update


def _follow_category_peaks(tracker: Any) -> None:
    """Record each category's own maximum as the tracker updates its running snapshot."""
    peaks: dict[str, int] = {}
    names: dict[Any, str] = {}  # the tracker's keys are few: each named once ("" for Total)
    original = _global_peak(tracker)

    def update(peak_state: Any) -> None:
        original(peak_state)  # at every allocation: kept cheap
        for dev_snap in tracker._curr_mem_snap.values():
            for key, value in dev_snap.items():
                name = names.get(key)
                if name is None:
                    label = "" if key == "Total" else getattr(key, "value", str(key))
                    name = names[key] = label and _CATEGORIES.get(label, "other")
                if name and value > peaks.get(name, -1):
                    peaks[name] = max(int(value), 0)

    tracker._update_peak_stats = update
    tracker._shardwise_category_peaks = peaks


def _create_optimizer_state(model: nn.Module, optimizer: Any) -> None:
    """One optimizer step on zero gradients: the state every later step starts with.

    Cheaper than a warm-up forward and backward, and it leaves DDP on its first iteration
    (DDP rebuilds its buckets before the second, which reads data pointers that fake
    tensors do not have).
    """
    if optimizer is None:
        return
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        # The state alone, as the first step makes it (the same tensors), without the
        # step's arithmetic, which costs as much as the tracked step's under fake tensors.
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            with torch.no_grad():
                for p in params:
                    p.grad = torch.zeros_like(p)
            optimizer._init_group(group, [], [], [], [], [], [])
        optimizer.zero_grad(set_to_none=True)
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def tracked_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    make_input: ExampleInput,
    recorder: Any = None,
) -> dict[str, Any]:
    """Create the optimizer state (as in every step after the first), then run one step
    (forward, backward, optimizer step) under torch's memory tracker; return the peak and
    its categories.

    Shared by the simulation (fake tensors) and the real-run check (real tensors), so the
    two measure exactly the same thing. A `recorder` (compose.SegmentRecorder, the fast
    simulation's) also records each segment of the step.
    """
    _create_optimizer_state(model, optimizer)
    inputs = make_input()
    tracker = _tracker(model, optimizer, inputs)
    _follow_category_peaks(tracker)
    phase = recorder.set_phase if recorder is not None else lambda step, name: None
    if recorder is not None:
        recorder.attach(tracker, _CATEGORIES)
    with tracker:
        phase(0, "F")
        loss = loss_of(call_model(model, inputs))
        phase(1, "B")
        loss.backward()
        phase(2, "O")
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del loss
    total, at_peak, own = _peaks(tracker)
    buckets = _ddp_bucket_bytes(model)
    if buckets:
        at_peak["ddp_buckets"] = own["ddp_buckets"] = buckets
        total += buckets
    result = {"peak": total, "at_peak": at_peak, "category_peaks": own}
    if recorder is not None:
        result["segments"] = recorder.finish(buckets)
    return result
