"""Expert parallel before any group: the config, the mesh, finding the experts and the
guards, each by its message."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import shardwise
from shardwise.cli.launch import check_layout
from shardwise.distributed.mesh import resolve_mesh
from shardwise.parallelize.experts import (
    check_expert_parallel,
    find_experts,
    plan_without_experts,
)
from shardwise.parallelize.moe import ExpertsParallel
from shardwise.parallelize.tensor import check_tensor_parallel

COMMON = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=32, max_position_embeddings=16, use_cache=False,
)  # fmt: skip


def qwen3_moe(experts: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **COMMON, head_dim=4, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=8
    )
    return transformers.Qwen3MoeForCausalLM(config)


def test_config_guards_name_the_field_and_the_fix() -> None:
    cases = [
        (dict(ep=0), ValueError, r"ParallelConfig.ep=0 must be >= 1"),
        (dict(ep=2, strategy="ddp"), ValueError, r"ep=2 with strategy='ddp': ep spreads the"),
        (dict(ep=2, strategy="no_shard"), ValueError, r"shards over none. Use strategy='full_"),
        (dict(ep=2, sequence_parallel=True, tp=2), NotImplementedError, r"sequence_parallel"),
        (dict(ep=2, strategy="auto"), NotImplementedError, r"strategy or tp 'auto'"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            shardwise.ParallelConfig(**kwargs)


def test_ep_borrows_its_ranks_from_dp_shard_or_whole_tp_groups() -> None:
    spec = resolve_mesh("full_shard", -1, 4, ep=2)
    assert (spec.dp_shard, spec.ep, spec.dp_size) == (4, 2, 4)
    assert str(spec).endswith("; experts: ep 2 x 2 shard rank(s)")
    spec = resolve_mesh("hybrid_shard", 2, 8, ep=2)
    assert (spec.dp_replicate, spec.dp_shard, spec.ep) == (4, 2, 2)
    spec = resolve_mesh("full_shard", -1, 4, tp=2, ep=2)  # dp_shard 2 x tp 2
    assert (spec.dp_shard, spec.tp, spec.ep) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"ep=3 must divide dp_shard=4, the ranks experts are "):
        resolve_mesh("full_shard", -1, 4, ep=3)
    # ep takes whole tp groups: all 4 ranks, each tp rank sending half of its group's tokens
    spec = resolve_mesh("full_shard", -1, 4, tp=2, ep=4)
    assert (spec.ep_borrows_tp, spec.ep_shard) == (True, 1)
    assert "ep 4 (whole tp groups; each tp rank sends 1/2 of the tokens) x 1 shard" in str(spec)
    spec = resolve_mesh("full_shard", -1, 16, tp=2, ep=4)  # dp_shard 8: ep takes 4 of them
    assert (spec.ep_borrows_tp, spec.ep_shard) == (False, 2)
    with pytest.raises(
        NotImplementedError,
        match=r"ep=6 takes some but not all ranks of each tp=4 group .* Choose ep in \[3, 4, 12\]",
    ):
        resolve_mesh("full_shard", -1, 12, tp=4, ep=6)


def test_run_refuses_an_ep_the_world_cannot_hold_before_spawning(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  strategy: full_shard\n")
    check_layout(["--config", str(config), "parallel.ep=2"], 4)
    with pytest.raises(ValueError, match=r"at world size 6: ParallelConfig.ep=4 must divide"):
        check_layout(["--config", str(config), "parallel.ep=4"], 6)


def test_the_experts_are_found_from_the_model_and_checked_against_ep() -> None:
    model = qwen3_moe()
    assert list(find_experts(model)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert set(check_expert_parallel(model, 2)) == set(find_experts(model))
    with pytest.raises(ValueError, match=r"ep=3 does not divide model.layers.0.mlp.experts."):
        check_expert_parallel(model, 3)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    with pytest.raises(ValueError, match=r"ep=2: LlamaForCausalLM has no experts module"):
        check_expert_parallel(dense, 2)


def test_under_ep_the_tp_plan_leaves_the_experts_whole() -> None:
    model = qwen3_moe()
    plan = check_tensor_parallel(model, shardwise.ParallelConfig(tp=2))
    assert isinstance(plan.apply, dict)
    assert any(isinstance(s, ExpertsParallel) for s in plan.apply.values())
    kept = plan_without_experts(plan, 2)
    assert isinstance(kept.apply, dict)
    assert not any(isinstance(s, ExpertsParallel) for s in kept.apply.values())
    assert any(k.endswith("q_proj") for k in kept.apply)  # attention stays under tp
    own = check_tensor_parallel(model, shardwise.ParallelConfig(tp=2, tp_plan=lambda m, t: m))
    with pytest.raises(NotImplementedError, match=r"ep=2 with a callable tp_plan is not built"):
        plan_without_experts(own, 2)


def test_hosts_refuse_expert_parallel_with_the_reason() -> None:
    mmengine = pytest.importorskip("shardwise.integrations.mmengine")
    with pytest.raises(NotImplementedError, match=r"ep=2 inside mmengine's Runner is not built"):
        mmengine.ShardwiseDataParallel(nn.Linear(2, 2), strategy="full_shard", ep=2)
    with pytest.raises(NotImplementedError, match=r"tp=2 inside mmengine's Runner is not built"):
        mmengine.ShardwiseDataParallel(nn.Linear(2, 2), strategy="full_shard", tp=2)
    lightning = pytest.importorskip("shardwise.integrations.lightning")
    with pytest.raises(NotImplementedError, match=r"ep=2 inside Lightning's Trainer"):
        lightning.ShardwiseStrategy(config=shardwise.ParallelConfig(ep=2))
    fabric = pytest.importorskip("shardwise.integrations.fabric")
    with pytest.raises(NotImplementedError, match=r"ep=2 inside Lightning Fabric is not built"):
        fabric.ShardwiseFabricStrategy(ep=2)
    with pytest.raises(NotImplementedError, match=r"pp=2 inside Lightning Fabric is not built"):
        fabric.ShardwiseFabricStrategy(pp=2)
