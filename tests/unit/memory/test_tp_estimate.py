"""The instant memory estimate under tensor parallelism, term by term against the simulation
(issue 34).

The model has what the estimate's terms are about: biases (a column split cuts a linear's
bias, a row split leaves it whole), whole parameters that are far from negligible (the plan
splits the decoder layers only, so the embedding, the untied head and the norms stay whole on
every tp rank: ~47% of the bytes), and units whose gathered copies and buffers differ in
size (the root, holding the whole embedding and head, is the largest unit). Each term of
`estimate_memory` is compared with the simulation's category it stands for, and the
block's unsharded gradients with a count made here from the parameter names.
"""

from __future__ import annotations

import pytest

from shardwise import ParallelConfig, simulate_step
from shardwise.memory.model_states import estimate_memory, tp_shares
from shardwise.parallelize.tensor import check_tensor_parallel, split_parameters
from shardwise.plan.planner import plan_wrap

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
PLAN = {f"model.layers.*.self_attn.{n}": "colwise" for n in COLUMN[:3]}
PLAN |= {f"model.layers.*.mlp.{n}": "colwise" for n in COLUMN[3:]}
PLAN |= {"model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.down_proj": "rowwise"}
WORLD, TP = 4, 2


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _split_by_name(name: str) -> bool:
    """Split over tp, read from the names alone: a column-split layer's weight and bias, a
    row-split layer's weight; nothing else (norms, embedding, head, row biases)."""
    layer = name.split(".")[-2]
    return layer in COLUMN or (layer in ROW and name.endswith(".weight"))


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
@pytest.mark.heavy
def test_each_term_of_the_tp_estimate_equals_the_simulation(strategy):
    config = ParallelConfig(strategy=strategy, tp=TP, tp_plan=PLAN)
    model = _llama()
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    whole = sum(p.numel() for n, p in named.items() if not _split_by_name(n))
    assert any(n.endswith("o_proj.bias") for n in named) and whole / total > 0.4
    plan = plan_wrap(model, config)
    split = split_parameters(model, check_tensor_parallel(model, config))
    assert split == {id(p) for n, p in named.items() if _split_by_name(n)}
    shares = tp_shares(model, plan, split, TP)
    (est,) = estimate_memory(plan, WORLD, tp=TP, tp_share=shares, strategies=(strategy,))
    sim = simulate_step(_llama, config, world=WORLD, batch=1, seq_len=8)
    assert (est.dp_shard, est.dp_replicate) == (2, 1)

    assert est.params == sim.at_peak["params"]
    assert est.grads == sim.category_peaks["grads"]
    # AdamW's one extra: a 4-byte step counter per parameter, not sharded.
    assert sim.at_peak["optimizer"] - est.optimizer == 4 * len(named)
    # The gathered copies: the largest block and the root at once when resharding after
    # forward, every unit between forward and backward otherwise.
    assert est.gathered == sim.category_peaks["gathered_params"]
    # One block's unsharded fp32 gradients for its reduce-scatter (tp's part of the block),
    # counted here from the names; under full_shard beside the next block's all-gather,
    # which the simulation holds at its peak.
    block = sum(
        p.numel() / (TP if _split_by_name(n) else 1)
        for n, p in named.items()
        if n.startswith("model.layers.0.")
    )
    prefetch = sim.at_peak["all_gather"] if strategy == "full_shard" else 0
    assert est.unit_buffers == prefetch + 4 * block
    if strategy == "full_shard":
        assert prefetch == 4 * block  # fp32 compute: a block's gathered bytes
