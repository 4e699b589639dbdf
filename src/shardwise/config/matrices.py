"""Which parameters Muon orthogonalises and which go to its fallback, by name and shape.

Owns: the default name patterns (embeddings, output heads, norms, routers to the fallback;
3-D expert stacks kept as one matrix per expert) and `split_parameters`. Read by
shardwise.Muon (train/muon.py) and by the memory plan (memory/muon_states.py), so both
split a model the same way.

Must not: import torch.distributed or another shardwise package (config is the lowest
layer).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

DEFAULT_FALLBACK_NAMES: tuple[str, ...] = (
    r"embed|(^|\.)(emb|wte|wpe|tok_embeddings)\.",  # embeddings
    r"(^|\.)(lm_head|head|output|classifier|score)\.weight$",  # output heads
    r"norm",  # norms (1-D anyway; also named 2-D ones)
    r"(^|\.)(gate|router)\.weight$",  # MoE routers (not gate_proj, an MLP matrix)
)
"""Regular expressions (re.search on the parameter's name) for parameters that go to the
fallback optimizer. Biases, norms' weights and any other parameter that is not 2-D go there
by shape, except a 3-D stack of experts (`EXPERT_NAMES`): each expert's matrix is
orthogonalised on its own."""

EXPERT_NAMES: tuple[str, ...] = (r"(^|\.)experts\.",)
"""Regular expressions for 3-D parameters that stack one matrix per expert (transformers'
`experts.gate_up_proj`, `experts.down_proj`): Muon treats each expert's matrix as a matrix,
never the stack as one."""


def split_parameters(
    named: Sequence[tuple[str | None, nn.Parameter]],
    fallback_names: Sequence[str] = DEFAULT_FALLBACK_NAMES,
    matrix_names: Sequence[str] = (),
    expert_names: Sequence[str] = EXPERT_NAMES,
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(matrices for Muon, the rest for the fallback): 2-D parameters whose names match no
    `fallback_names` (or match a `matrix_names`) are matrices, and so are 3-D stacks named
    by `expert_names` (one matrix per expert)."""
    matrices, others = [], []
    for i, (name, p) in enumerate(named):
        label = name if name is not None else f"params[{i}]"
        if p.ndim == 3 and name is not None and _any(expert_names, name):
            if not _any(fallback_names, name):
                matrices.append((label, p))
            else:
                others.append((label, p))
            continue
        forced = name is not None and any(re.search(r, name) for r in matrix_names)
        if p.ndim != 2 or (not forced and name is not None and _any(fallback_names, name)):
            others.append((label, p))
            continue
        if name is None and fallback_names:
            raise ValueError(
                f"shardwise.Muon: {label} (shape {tuple(p.shape)}) has no name, so an "
                "embedding or output head cannot be told from a hidden matrix. Pass "
                "model.named_parameters(), or fallback_names=() to split by shape alone."
            )
        matrices.append((label, p))
    return matrices, others


def _any(patterns: Sequence[str], name: str) -> bool:
    return any(re.search(r, name) for r in patterns)
