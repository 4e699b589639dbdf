"""The instant estimate of a model with a frozen base: gradients and optimizer state for the
trainable parameters only, counted in their own dtype (a bf16 base with fp32 adapters)."""

from __future__ import annotations

import torch

from shardwise import ParallelConfig, plan_wrap
from shardwise.memory.model_states import estimate_memory
from shardwise.testing.models import LoRALinear, LoRALM


def _bf16_base_fp32_adapters() -> LoRALM:
    model = LoRALM(d=16, n_layers=2, vocab_size=32)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.base.to(torch.bfloat16)
    model.emb.to(torch.bfloat16)
    model.head.to(torch.bfloat16)
    return model


def test_gradients_and_optimizer_state_count_the_trainable_parameters_in_their_dtype():
    model = _bf16_base_fp32_adapters()
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    assert torch.bfloat16 in {p.dtype for p in frozen}
    plan = plan_wrap(model, ParallelConfig())
    (states,) = estimate_memory(plan, 2, strategies=("full_shard",))
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    assert states.grads == -(-trainable_bytes // 2)  # fp32 adapters' gradients, sharded
    assert states.params == -(-stored // 2)
    numel = sum(p.numel() for p in trainable)
    assert states.optimizer == -(-numel * 4 * 2 // 2)  # AdamW: two fp32 states per element
    assert sum(u.trainable_bytes for u in plan) == trainable_bytes
