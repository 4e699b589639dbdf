"""Fused projections for Muon, opt-in: `qkv_proj` as its q, k and v row blocks, `gate_up_proj`
as its gate and up halves (an MoE stack of them: per expert, then per half).

Owns: reading each fused matrix's split (from the model's config where transformers has one,
or from sizes given by name), refusing a split that cannot be read in one line, and
orthogonalising a whole matrix block by block. Each block is orthogonalised as the matrix
it would be unfused, its learning rate adjusted for its own shape, as shardwise.Muon would
for a separate q_proj, k_proj or v_proj.

The split runs on the owner's assembled whole matrix (muon_comm.py), so how the matrix was
sharded does not change it.

Must not: import transformers (the config is read by attribute), or know the layout.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

QKV = r"(^|\.)qkv_proj\.weight$"
GATE_UP = r"(^|\.)gate_up_proj(\.weight)?$"

SplitSetting = bool | Mapping[str, Sequence[int]]
"""`shardwise.Muon(split_fused=...)`: False (off), True (read from the model's config), or
regular expressions on parameter names mapped to the row sizes of their blocks."""


@dataclasses.dataclass(frozen=True)
class Split:
    """A fused matrix's blocks: `sizes` along `dim` of each (expert's) matrix."""

    dim: int
    sizes: tuple[int, ...]


def read_splits(
    setting: SplitSetting,
    matrices: Sequence[tuple[str, torch.Tensor]],
    model: nn.Module | None,
    config: Any,
) -> dict[str, Split]:
    """Each fused matrix's split, by name; {} when `setting` is False. A ValueError in one
    line names a split that cannot be read."""
    if setting is False:
        return {}
    if setting is True:
        return {n: s for n, p in matrices if (s := _from_model(n, p, model, config)) is not None}
    if not isinstance(setting, Mapping):
        raise TypeError(
            f"shardwise.Muon(split_fused={setting!r}): use False, True (read the split from "
            "the model's config) or {name pattern: row sizes}, e.g. {'qkv_proj': [64, 16, 16]}."
        )
    out = {}
    for name, p in matrices:
        found = [pattern for pattern in setting if re.search(pattern, name)]
        if found:
            sizes = tuple(int(s) for s in setting[found[0]])
            out[name] = _checked(name, p, Split(-2, sizes), f"split_fused[{found[0]!r}]")
    return out


def _from_model(name: str, p: torch.Tensor, model: nn.Module | None, config: Any) -> Split | None:
    if re.search(QKV, name) and p.ndim == 2:
        return _checked(name, p, Split(-2, _qkv_rows(name, config)), "the model's config")
    if re.search(GATE_UP, name):
        layout = _expert_layout(name, model)
        if layout == "interleaved":
            raise ValueError(
                f"shardwise.Muon(split_fused=True): {name} interleaves gate and up "
                "(is_concatenated=False), so it has no gate and up halves to split; leave "
                "split_fused off, or send it whole by giving split_fused a mapping without it."
            )
        dim = -1 if layout == "transposed" else -2
        rows = p.shape[dim]
        if rows % 2:
            raise ValueError(
                f"shardwise.Muon(split_fused=True): {name} has {rows} rows along dim {dim}, "
                "which do not split into equal gate and up halves; leave split_fused off."
            )
        return _checked(name, p, Split(dim, (rows // 2, rows // 2)), "gate and up halves")
    return None


def _qkv_rows(name: str, config: Any) -> tuple[int, int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(
            f"shardwise.Muon(split_fused=True): {name} is a fused q, k, v projection, and "
            "no model config with num_attention_heads says where q ends. Build it through "
            "the Engine or pass model=your_model, or give the rows: "
            "split_fused={'qkv_proj': [q_rows, k_rows, v_rows]}."
        )
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads * head_dim, kv * head_dim, kv * head_dim


def _checked(name: str, p: torch.Tensor, split: Split, source: str) -> Split:
    rows = p.shape[split.dim]
    if sum(split.sizes) != rows or min(split.sizes) <= 0:
        raise ValueError(
            f"shardwise.Muon(split_fused): {name} has {rows} rows along dim {split.dim}, but "
            f"{source} gives blocks {list(split.sizes)} (sum {sum(split.sizes)}); give "
            f"split_fused={{'{name.rsplit('.', 2)[-2]}': [...]}} with positive rows that sum "
            f"to {rows}, or leave split_fused off."
        )
    return split


def _expert_layout(name: str, model: nn.Module | None) -> str:
    """'rows' (gate then up along dim -2), 'transposed' (along dim -1) or 'interleaved',
    from the owning module's transformers attributes (the default where it has none)."""
    module = _owner(name, model)
    if module is None:
        return "rows"
    if getattr(module, "is_concatenated", True) is False:
        return "interleaved"
    return "transposed" if getattr(module, "is_transposed", False) else "rows"


def _owner(name: str, model: nn.Module | None) -> nn.Module | None:
    if model is None or "." not in name:
        return None
    try:
        return model.get_submodule(name.rsplit(".", 1)[0])
    except AttributeError:
        return None


def orthogonalise_blocks(
    whole: torch.Tensor,
    split: Split,
    orthogonalise: Callable[[torch.Tensor], torch.Tensor],
    scale: Callable[[Sequence[int], Sequence[int]], float],
) -> torch.Tensor:
    """`whole` (a matrix, or a stack of experts' matrices) orthogonalised block by block,
    each block's result times `scale(block shape, matrix shape)` (its own learning-rate
    adjustment over the whole matrix's, which the step applies)."""
    if whole.ndim == 3:
        return torch.stack([orthogonalise_blocks(m, split, orthogonalise, scale) for m in whole])
    blocks = whole.split(list(split.sizes), dim=split.dim)
    out = [orthogonalise(b) * scale(b.shape, whole.shape) for b in blocks]
    return torch.cat(out, dim=split.dim)
