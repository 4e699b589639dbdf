"""Context parallel's attention: Ulysses, an all-to-all each way around one attention call.

Under context parallel each rank of a cp group holds 1/cp of every sequence's positions
(context.py cuts them). Attention needs all of them. An all-to-all (torch's autograd
`all_to_all_single`) gives each rank every position of 1/cp of the heads; attention runs
there over the whole sequence, with a mask built from the global layout of the batch, the
same on every rank; a second all-to-all gives each rank all heads of its own positions
back. The result is one process's attention, cut as the batch was.

The mask is the model's: causal (or not, for an encoder), the documents of a packed row
(context.py finds them as transformers does, from position ids that restart), the padding
of a 2-D attention mask, and a sliding window. A query whose every key is masked (left
padding) keeps itself, which changes nothing a real token or the loss reads.

Key and value heads that do not divide over cp (grouped-query attention with fewer KV heads
than cp ranks) are repeated first, within their query groups, so every rank gets the KV
heads its query heads read.

Owns: `ulysses_attention` (the exchange around SDPA), `context_attention` (the call a model
of your own makes in place of F.scaled_dot_product_attention), and the transformers
attention function registered under ATTENTION_NAME, with what it refuses.

Must not: hand-write a ring or an attention kernel (SDPA computes), cut batches, or
import transformers at module level (a transformers model brings it).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.distributed.worker_errors import refused
from shardwise.parallelize.context import ROW_NAMES, ContextLayout, current_layout

__all__ = [
    "ATTENTION_NAME",
    "check_context_parallel",
    "context_attention",
    "register_attention",
    "ulysses_attention",
]

ATTENTION_NAME = "shardwise_context_parallel"
"""The attention implementation a transformers model runs under cp (AttentionInterface)."""


def _exchange(x: torch.Tensor, layout: ContextLayout) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(x.contiguous().flatten(), None, None, layout.group)
    return out.view(x.shape)


def _heads_to_sequence(x: torch.Tensor, layout: ContextLayout) -> torch.Tensor:
    """(B, h, S/cp, D), this rank's positions of every head -> (B, h/cp, S, D), every
    position of this rank's heads (rank j's chunk of the sequence is positions j*S/cp on)."""
    b, h, s, d = x.shape
    cp = layout.size
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # chunk j: rank j's heads
    got = _exchange(send, layout)  # chunk i: rank i's positions of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _sequence_to_heads(y: torch.Tensor, layout: ContextLayout) -> torch.Tensor:
    """The inverse: (B, h/cp, S, D) -> (B, h, S/cp, D)."""
    b, hl, n, d = y.shape
    cp = layout.size
    send = y.reshape(b, hl, cp, n // cp, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's positions
    got = _exchange(send, layout)  # chunk i: rank i's heads of this rank's positions
    return got.transpose(0, 1).reshape(b, cp * hl, n // cp, d)


def _repeat_kv(x: torch.Tensor, heads: int, cp: int) -> torch.Tensor:
    """Key or value heads repeated within their query groups until they divide over cp."""
    kv = x.shape[1]
    if kv % cp == 0:
        return x
    times = cp // math.gcd(kv, cp)  # divides heads // kv, since cp divides heads
    if (heads // kv) % times:
        raise ValueError(f"{kv} key/value heads cannot be spread with {heads} query heads")
    return x.repeat_interleave(times, dim=1)


def _mask(
    layout: ContextLayout,
    causal: bool,
    window: int | None,
    device: torch.device,
    rows: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> torch.Tensor | None:
    """(B or 1, 1, S, S) booleans, True where a query may read a key; None where SDPA's own
    `is_causal` (or no mask) is the same. `rows`: a pipeline micro-batch's documents and
    kept keys, in place of the layout's."""
    documents = rows[0] if rows[0] is not None else layout.documents
    keep = rows[1] if rows[1] is not None else layout.keep
    if documents is None and keep is None and not window:
        return None
    n = layout.seq_len
    i = torch.arange(n, device=device)
    distance = i[:, None] - i[None, :]  # query index minus key index
    allowed = distance >= 0 if causal else torch.ones(n, n, dtype=torch.bool, device=device)
    if window:
        allowed = allowed & (distance < window if causal else distance.abs() < window)
    allowed = allowed[None]
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])
    if keep is not None:
        allowed = allowed & keep[:, None, :].bool()
    allowed = allowed | torch.eye(n, dtype=torch.bool, device=device)  # no empty row
    return allowed[:, None]


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: ContextLayout,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    dropout_p: float = 0.0,
    rows: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> torch.Tensor:
    """Attention over the whole sequence for this rank's positions: (B, H, S/cp, D) query,
    (B, Hkv, S/cp, D) key and value in, (B, H, S/cp, D) out. `rows`: under pp, this
    micro-batch's (B, S) document ids and kept keys (the layout holds the whole batch's
    only without pp)."""
    heads, cp = query.shape[1], layout.size
    layout.attention_calls += 1
    key, value = _repeat_kv(key, heads, cp), _repeat_kv(value, heads, cp)
    q, k, v = (_heads_to_sequence(t, layout) for t in (query, key, value))
    mask = _mask(layout, causal, window, q.device, rows)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return _sequence_to_heads(out, layout)


def context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """F.scaled_dot_product_attention for a model of your own that shardwise may run
    under context parallel: query (B, H, S, D), key and value (B, Hkv, S, D), causal or
    not, with no mask of its own. Under `ParallelConfig.cp` > 1, S is this rank's 1/cp of
    each sequence and the attention reads the whole sequence (Ulysses); otherwise it is
    F.scaled_dot_product_attention itself. A model's forward that calls it must also take
    `position_ids` (shardwise passes the global ones) for whatever its positions feed."""
    layout = current_layout()
    if layout is None:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=key.shape[1] != query.shape[1],
        )
    return ulysses_attention(
        query, key, value, layout, causal=is_causal, scale=scale, dropout_p=dropout_p
    )


def _transformers_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: (B, S, H, D) out, and no weights."""
    layout = current_layout()
    if layout is None:
        raise refused(
            RuntimeError(
                f"{type(module).__name__} runs shardwise's context-parallel attention outside "
                "a context-parallel forward: call the model shardwise.wrap returned, with "
                "whole sequences."
            )
        )
    if softcap:
        raise refused(
            NotImplementedError(
                f"ParallelConfig.cp={layout.size}: {type(module).__name__} caps its attention "
                f"scores (softcap={softcap}), which context parallel does not do yet. Use cp=1 "
                "for this model."
            )
        )
    if kwargs.get("s_aux") is not None:
        raise refused(
            NotImplementedError(
                f"ParallelConfig.cp={layout.size}: {type(module).__name__} has attention sinks, "
                "which context parallel does not hold yet. Use cp=1 for this model."
            )
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = ulysses_attention(
        query,
        key,
        value,
        layout,
        causal=bool(causal),
        scale=scaling,
        window=sliding_window,
        dropout_p=dropout if module.training else 0.0,
        rows=(kwargs.get(ROW_NAMES[0]), kwargs.get(ROW_NAMES[1])),
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention(model: nn.Module) -> bool:
    """Run a transformers model's attention through Ulysses: registers ATTENTION_NAME with
    transformers' AttentionInterface and switches the model to it. False for a model that
    is not a transformers model (it calls `context_attention` itself)."""
    transformers = sys.modules.get("transformers")
    switch = getattr(model, "set_attn_implementation", None)
    if transformers is None or not callable(switch):
        return False
    transformers.AttentionInterface.register(ATTENTION_NAME, _transformers_attention)
    switch(ATTENTION_NAME)
    return True


def check_context_parallel(model: nn.Module, cp: int, tp: int = 1) -> None:
    """What Ulysses cannot hold in a transformers model, refused before any group exists:
    attention heads that do not divide by tp x cp (tp splits them first), capped attention
    scores, attention sinks. A model of your own is checked at its first forward (its
    attention must go through `context_attention`)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    name = type(model).__name__
    if isinstance(heads, int) and heads % (cp * tp):
        per = heads // tp if heads % tp == 0 else heads
        fits = [d for d in range(2, per + 1) if per % d == 0]
        over = f"tp x cp = {tp} x {cp}" if tp > 1 else str(cp)
        raise refused(
            ValueError(
                f"ParallelConfig.cp={cp}: Ulysses gives each rank num_attention_heads / "
                f"{'(tp x cp)' if tp > 1 else 'cp'} of {name}'s heads, and its {heads} heads "
                f"do not divide by {over}. Choose cp in {fits or [1]} (ring attention, which "
                "would not need it, is not built yet)."
            )
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise refused(
            NotImplementedError(
                f"ParallelConfig.cp={cp}: {name} caps its attention scores "
                f"(attn_logit_softcapping={softcap}), which context "
                "parallel does not do yet. Use cp=1 for this model."
            )
        )
    sinks = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] == "sinks"]
    if sinks:
        raise refused(
            NotImplementedError(
                f"ParallelConfig.cp={cp}: {name} has attention sinks ({sinks[0]}), which "
                "context parallel does not hold yet. Use cp=1 for this model."
            )
        )
