"""Activation checkpointing for planned blocks, applied before sharding.

Owns: recomputing a module's forward in backward instead of storing its activations.
The module keeps its class and parameter names (no wrapper module, so state_dict keys
do not change), and FSDP2's hooks, which run around `forward`, stay outside the
checkpointed region, so parameters are gathered before the recompute.

Must not: decide which modules are checkpointed (the plan does).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

_ATTR = "_shardwise_checkpointed"


def apply_activation_checkpointing(module: nn.Module) -> nn.Module:
    """Make `module.forward` recompute in backward (non-reentrant; idempotent)."""
    if getattr(module, _ATTR, False):
        return module
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    setattr(module, _ATTR, True)
    return module


def is_checkpointed(module: nn.Module) -> bool:
    return bool(getattr(module, _ATTR, False))
