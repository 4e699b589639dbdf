"""A mixture of experts' load-balancing (auxiliary) loss on whole-batch statistics.

transformers computes the Switch Transformer load-balancing loss in one function per family,
`load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`, the same in 31
families (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DBRX, Jamba, Granite-MoE, ...): the number
of experts times the dot product of the fraction of tokens routed to each expert and its mean
router probability. Both are statistics of the batch, so each data-parallel rank computing
it from its own rows trains another model than one process does (measured: the router's
gradient off by 0.35-0.55 relative at world 4).

Owns: that loss computed as statistics → `global_batch_sum` → product
(`load_balancing_loss`), putting it in place of a family's own function while a wrapped
model's training forward runs (`install`: everywhere else the family's function runs as it
is), and the probe that shows a family's function is this loss before it is replaced (a
family whose function differs keeps it; batch_stats.py states it).

Must not: import transformers (a family is found through its model's classes), reduce
anything itself (global_batch.py does), or replace a function the probe has not passed.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.parallelize.global_batch import current, global_batch_sum

__all__ = ["FUNCTION", "install", "load_balancing_loss", "routing_statistics"]

FUNCTION = "load_balancing_loss_func"
"""The name of transformers' load-balancing function in a family's modeling module."""
_ORIGINAL = "__shardwise_original__"


def routing_statistics(
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's routing statistics, summed over the layers, as one vector of
    2 * num_experts + 1: top-k assignments per expert, router probability per expert, rows
    (tokens; under a mask, the unmasked ones). The first and last parts carry no gradient."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None
    if attention_mask is not None:  # the same flat mask applies to every layer's rows
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in gate_logits:
        weights = torch.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        if mask is None:
            per_choice = torch.ones(chosen.numel(), dtype=torch.float32, device=device)
        else:
            per_choice = mask.repeat_interleave(top_k)
        counts = counts.scatter_add(0, chosen.reshape(-1), per_choice)
        if mask is None:
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return torch.cat([counts, probs, rows.reshape(1)])


def load_balancing_loss(
    gate_logits: Any,
    num_experts: int | None = None,
    top_k: int = 2,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | int:
    """transformers' `load_balancing_loss_func` (the same arguments and result), with the
    statistics summed over the global batch first (`global_batch_sum`): in one process and
    outside a wrapped model's training forward it is the family's loss itself."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0  # as transformers: no router logits were recorded
    if num_experts is None:
        raise ValueError("load_balancing_loss: num_experts is required (the router's width).")
    stats = global_batch_sum(routing_statistics(gate_logits, num_experts, top_k, attention_mask))
    counts, probs, rows = stats[:num_experts], stats[num_experts:-1], stats[-1]
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def _dispatching(original: Callable[..., Any]) -> Callable[..., Any]:
    """The family's function, except inside a wrapped model's training forward over more
    than one data-parallel rank, where the statistics are the whole batch's."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_balancing_loss_func(*args: Any, **kwargs: Any) -> Any:
        if current() is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return load_balancing_loss(**bound.arguments)

    setattr(load_balancing_loss_func, _ORIGINAL, original)
    return load_balancing_loss_func


def _agrees(original: Callable[..., Any]) -> bool:
    """Does a family's function compute `load_balancing_loss`, value and gradient, on a
    probe with and without a padding mask? (Only then may it be replaced.)"""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # Real CPU tensors, also when wrap runs inside the memory simulation's fake mode or a
    # meta-device context.
    with unset_fake_temporarily(), torch.device("cpu"), torch.enable_grad():
        g = torch.Generator().manual_seed(0)
        mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        for m in (None, mask):
            logits = tuple(torch.randn(6, 5, generator=g, requires_grad=True) for _ in range(2))
            try:
                want = original(logits, 5, 2, m)
                got = load_balancing_loss(logits, 5, 2, m)
            except Exception:  # another signature or contract: not this loss
                return False
            if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
                return False
            want_grad = torch.autograd.grad(want, logits)
            got_grad = torch.autograd.grad(got, logits)
            close = functools.partial(torch.allclose, rtol=1e-5, atol=1e-7)
            if not close(want, got) or not all(map(close, want_grad, got_grad)):
                return False
    return True


def install(model: nn.Module) -> tuple[list[str], list[str]]:
    """Put `load_balancing_loss` in place of the load-balancing function of every family
    module `model`'s classes come from, where the probe shows it is that loss. Returns
    (families replaced or replaced before, families whose function differs)."""
    replaced, differ = [], []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        original = getattr(module, FUNCTION, None)
        if not callable(original):
            continue
        if hasattr(original, _ORIGINAL):
            replaced.append(name)
        elif _agrees(original):
            setattr(module, FUNCTION, _dispatching(original))
            replaced.append(name)
        else:
            differ.append(name)
    return replaced, differ
