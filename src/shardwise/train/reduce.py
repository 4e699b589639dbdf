"""The update's one host sync: what the ranks agree on at each optimizer step.

Owns: one all-reduce per update carrying the window's mean logged values, each rank's
non-finite flag, stop request and save request, and the one copy to the host that brings
them back with the gradient norm (`reduce_window` → `Reduced`); naming this rank's
non-finite values when one is found (`nonfinite_keys`).

Must not: step, clip or log (engine.py and runner.py do), or sync the host more than once
per update: a request from the Runner or a signal handler rides on this reduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Reduced", "nonfinite_keys", "reduce_window"]


def reduce_window(
    window: list[dict[str, torch.Tensor]],
    norm: torch.Tensor,
    device: torch.device,
    norm_is_ours: bool,
    asked: bool,
    save: bool = False,
) -> Reduced:
    """The update's one host sync. One all-reduce carries the window's mean values, each
    rank's non-finite flag, stop request and save request; one copy to the host then
    brings them back with the gradient norm. Everything before it is queued on the device. With fp16
    scaling (`norm_is_ours=False`), inf/nan gradients are the grad scaler's to skip, as in
    any AMP loop; without it they are ours."""
    keys = sorted(window[0])
    means = torch.stack([torch.stack([w[k].float() for w in window]).mean() for k in keys])
    means = means.to(device)
    norm = norm.float().reshape(1).to(device)
    # Each loss picked by an int (a view): a list index becomes a host tensor that is
    # copied to the device, a host sync on CUDA (measured on an H200).
    losses = [means[i] for i, k in enumerate(keys) if "loss" in k]
    bad = torch.zeros((), dtype=torch.bool, device=device)
    if losses:
        bad = ~torch.isfinite(torch.stack(losses)).all()
    finite_norm = torch.isfinite(norm[0])
    bad = bad | ~finite_norm if norm_is_ours else bad & finite_norm
    flags = torch.stack(
        [
            bad.float(),
            torch.full((), float(asked), device=device),
            torch.full((), float(save), device=device),
        ]
    )
    values = torch.cat([means, flags])
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(values)  # SUM (gloo has no AVG)
    host = torch.cat([values, norm]).tolist()  # the one sync of the update
    n = len(keys)
    return Reduced(
        means={k: v / world for k, v in zip(keys, host[:n], strict=True)},
        keys=keys,
        nonfinite_ranks=int(host[n]),
        stop=host[n + 1] > 0,
        save=host[n + 2] > 0,
        norm=host[n + 3],
        local_means=means,
    )


@dataclass(frozen=True)
class Reduced:
    """What the update's one host sync brought back."""

    means: dict[str, float]
    """The window's mean of each logged value, averaged over ranks."""
    keys: list[str]
    nonfinite_ranks: int
    stop: bool
    save: bool
    norm: float
    local_means: torch.Tensor
    """This rank's means, still on the device (read only to report a non-finite value)."""


def nonfinite_keys(reduced: Reduced, norm_is_ours: bool) -> list[str]:
    """This rank's non-finite names: losses among the window's keys, and the gradient norm
    when no grad scaler owns inf/nan gradients."""
    finite = torch.isfinite(reduced.local_means).tolist()
    bad = [k for k, ok in zip(reduced.keys, finite, strict=True) if "loss" in k and not ok]
    if norm_is_ours and not math.isfinite(reduced.norm):
        bad.append("grad_norm")
    return bad
