"""`shardwise plan` with `optimizer: {name: muon}`: what Muon takes of the model, and the
layouts whose Muon memory is not planned yet.

Owns: turning the run file's optimizer section into `MuonShares` (memory/muon_states.py)
and refusing, in one line, the plan paths that do not count Muon yet (tp, pp, ep, cp,
strategy=auto, --simulate).

Must not: build a real model or start a process group.
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from shardwise.config.matrices import DEFAULT_FALLBACK_NAMES
from shardwise.config.optimizer import OptimizerConfig
from shardwise.memory.model_states import OPTIMIZER_STATES
from shardwise.memory.muon_states import MuonShares, muon_shares

NOT_ESTIMATED = (
    "the peak with activations is not estimated for optimizer muon yet; the table above "
    "has its model states and its step's temporaries"
)


def refuse_unplanned(
    args: argparse.Namespace, optimizer: OptimizerConfig, parallel: Any, spec: Any
) -> None:
    """A ValueError naming the fix when Muon's memory is not planned on this path."""
    if optimizer.name != "muon":
        return
    paths = [
        f"{dim}={getattr(spec, dim)}"
        for dim in ("tp", "pp", "ep", "cp")
        if spec is not None and getattr(spec, dim, 1) > 1
    ]
    if parallel.strategy == "auto" or parallel.activation_checkpointing == "auto":
        paths.append("strategy or activation_checkpointing auto")
    if parallel.device_mesh is not None:
        paths.append("a device_mesh")
    if getattr(args, "simulate", False):
        paths.append("--simulate")
    if paths:
        raise ValueError(
            f"optimizer.name='muon' with {', '.join(paths)} is not planned "
            "yet (Muon's state and step temporaries are counted for ddp and the FSDP "
            "strategies without tp, pp, ep or cp); plan that layout with "
            "optimizer.name=adamw, or drop it."
        )


def shares_of(optimizer: OptimizerConfig, model: nn.Module) -> MuonShares | None:
    """What shardwise.Muon built from `optimizer` takes of `model` (None: not muon)."""
    if optimizer.name != "muon":
        return None
    fallback = optimizer.fallback
    return muon_shares(
        model,
        fallback_names=(
            DEFAULT_FALLBACK_NAMES
            if optimizer.fallback_names is None
            else tuple(optimizer.fallback_names)
        ),
        matrix_names=tuple(optimizer.matrix_names or ()),
        fallback_states=OPTIMIZER_STATES[fallback.name if fallback else "adamw"],
        ns_bytes={"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[
            optimizer.setting("ns_dtype")
        ],
        nesterov=bool(optimizer.setting("nesterov")),
        ns_steps=int(optimizer.setting("ns_steps")),
    )
