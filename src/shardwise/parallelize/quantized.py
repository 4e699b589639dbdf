"""A quantized base (bitsandbytes' 4-bit layers, QLoRA) made ready for the strategy.

fully_shard keeps a 4-bit weight's packed codes but not its `quant_state`, which
bitsandbytes' `Linear4bit.forward` restores from the layer's own `quant_state` on every
forward (and backward reads the codes FSDP2 gathers again). Three things would still go
wrong without this module, each found by trying on CPU/gloo:

- an eval-mode forward without gradients on a CPU with AVX512-BF16 makes bitsandbytes
  repack the weight for its inference kernel and mark the (shared) quant_state so. Under
  FSDP2 the repacked copy is the gathered one, thrown away after forward, while the mark
  stays: every later forward reads the shards' codes in the other layout and trains on
  wrong weights without a sign (after `Engine.val_step`, for one). In one process the
  next backward fails. The repacking is turned off on every path;
- every rank syncs rank 0's parameters before sharding, codes included, but the scales
  in the quant_state are not parameters: a rank that loaded or quantized other values
  would pair rank 0's codes with its own scales. They are broadcast from rank 0 too;
- a layer whose own `quant_state` is unset (a Params4bit quantized without its module)
  would have nothing to restore from once the parameter is a DTensor;
- codes stored in a floating dtype (`bnb_4bit_quant_storage=torch.bfloat16`, the FSDP1
  recipe) are numbers to FSDP2: it casts them to a different compute dtype, and where all
  of a unit's all-gather inputs share their dtype it gathers in that dtype, whose CUDA
  copies (bf16 through fp32) turn every NaN bit pattern into one (about 0.1% of packed NF4
  bytes). The codes are held as the bytes they are (uint8), which are never cast, so any
  storage dtype trains; the quant_state already says how to read them;
- the quant_state must sit where the layer computes, also when its codes are offloaded
  to the CPU: FSDP2 gathers the codes to the GPU, and bitsandbytes' dequantize would be
  handed a host pointer for the scales.

Owns: `prepare_quantized`, applied by wrap before the strategy (after the refusals of
plan/quantized.py).

Must not: import bitsandbytes, shard, or decide what is refused (plan/quantized.py does).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.parallelize.fsdp import sync_tensors
from shardwise.plan.quantized import QuantizedParam, quant_state_tensors

__all__ = ["as_bytes", "prepare_quantized"]

_CPU_REPACK = "support_avx512bf16_for_cpu"  # Linear4bit reads it on every forward


def prepare_quantized(
    model: nn.Module,
    found: list[QuantizedParam],
    *,
    device: torch.device | None = None,
    sync: bool = False,
) -> None:
    """Keep each 4-bit layer's quant_state on the layer and its codes in the layout the
    quant_state describes (no CPU inference repacking), as bytes (uint8, whatever their
    storage dtype), move the quant_states to `device` (None: leave them), and make every
    rank's quant_state tensors rank 0's (`sync`; a collective: every rank calls it with the
    same model)."""
    tensors: dict[int, torch.Tensor] = {}
    for q in found:
        module = model.get_submodule(q.module)
        p = model.get_parameter(q.name)
        state = getattr(p, "quant_state", None)
        if q.bits == 4:
            if hasattr(module, _CPU_REPACK):
                setattr(module, _CPU_REPACK, False)
            if state is not None and getattr(module, "quant_state", None) is None:
                module.quant_state = state
            if q.quantized and q.floating_storage:
                as_bytes(p)
        if device is not None:
            for held in {id(s): s for s in (state, getattr(module, "quant_state", None))}.values():
                if held is not None and callable(getattr(held, "to", None)):
                    held.to(device)  # in place: bitsandbytes' QuantState.to moves its tensors
        for t in quant_state_tensors(p):
            tensors.setdefault(id(t), t)
    if sync:
        sync_tensors(list(tensors.values()))


def as_bytes(p: torch.Tensor) -> None:
    """A 4-bit weight's packed codes, held in a floating dtype, viewed as the bytes they
    are: (n, 1) of bf16 becomes (2n, 1) of uint8, bitsandbytes' own default layout."""
    with torch.no_grad():
        p.data = p.data.view(torch.uint8).reshape(-1, 1)
    if hasattr(p, "quant_storage"):
        p.quant_storage = torch.uint8
