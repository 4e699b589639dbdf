"""Expert parallel before any group: the config, the mesh, finding the experts and the
guards, each by its message."""

from __future__ import annotations

import inspect

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


class _Named(nn.Module):
    """An experts module in the documented shape whose forward names its routing argument
    `index_name` (transformers' families use three spellings)."""

    def __init__(self, index_name: str, rows: int = 8) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, rows, 6))
        self.down_proj = nn.Parameter(torch.zeros(4, 6, rows // 2))
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        names = ("self", "hidden_states", index_name, "top_k_weights")

        def forward(self: nn.Module, *args: torch.Tensor) -> torch.Tensor:
            return args[0]

        forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, kind) for n in names]
        )
        self.forward = forward.__get__(self)  # what inspect reads is this signature


@pytest.mark.parametrize("index_name", ["top_k_index", "router_indices", "topk_indices"])
def test_each_spelling_of_the_routing_argument_is_found(index_name: str) -> None:
    """Issue 48: each of the three names transformers' MoE families give the expert indices
    (gpt_oss: router_indices) marks an experts module; another name does not."""
    holder = nn.Module()
    holder.experts = _Named(index_name)
    assert list(find_experts(holder)) == ["experts"]
    holder.experts = _Named("expert_ids")
    assert find_experts(holder) == {}


def test_a_packed_gate_and_up_split_needs_tp_parts_of_each_half() -> None:
    """Issue 48: packed gate and up are cut into tp parts each, so dim 1 must split into
    2 x tp rows: 6 rows split into 2 but not into 4 (at tp 2), 8 into both."""
    style = ExpertsParallel({"gate_up_proj": "packed_colwise", "down_proj": "rowwise"})
    odd = _Named("top_k_index", rows=6)
    with pytest.raises(
        ValueError,
        match=r"tp=2: _Named.gate_up_proj has 6 rows on dim 1, which do not split into 4 equal",
    ):
        style._placement("gate_up_proj", odd.gate_up_proj, 2, "_Named")
    even = _Named("top_k_index", rows=8)
    style._placement("gate_up_proj", even.gate_up_proj, 2, "_Named")  # 8 rows: 4 parts of 2
    with pytest.raises(ValueError, match=r"_Named.down_proj has 3 rows on dim 2"):
        style._placement("down_proj", odd.down_proj, 2, "_Named")


def test_a_plan_entry_for_a_parameter_the_experts_lack_is_refused() -> None:
    """Issue 48: a misspelt parameter under an experts entry would split nothing."""
    typo = ExpertsParallel({"gate_up_proj": "packed_colwise", "down_prj": "rowwise"})
    with pytest.raises(
        ValueError,
        match=r"has the parameters \['down_proj', 'gate_up_proj'\], but the plan splits "
        r"\['down_prj', 'gate_up_proj'\]",
    ):
        typo.check_covers(_Named("top_k_index"), "experts")
    extra = ExpertsParallel(
        {"gate_up_proj": "packed_colwise", "down_proj": "rowwise", "bias": "rowwise"}
    )
    with pytest.raises(ValueError, match=r"but the plan splits \['bias', 'down_proj'"):
        extra.check_covers(_Named("top_k_index"), "experts")


def test_experts_with_per_expert_biases_are_found_and_checked() -> None:
    """gpt-oss holds 2-D biases beside its 3-D weights, one row an expert (third audit:
    taking only 3-D parameters would refuse it as having no experts)."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_bias.shape == (4, 32)  # the 2-D rows: one per expert
    assert list(find_experts(model)) == ["model.layers.0.mlp.experts"]
    assert set(check_expert_parallel(model, 2)) == {"model.layers.0.mlp.experts"}
    with pytest.raises(ValueError, match=r"ep=3 does not divide model.layers.0.mlp.experts"):
        check_expert_parallel(model, 3)
