"""The tp gradient check (`check_tp_gradients`) under sequence parallel (issue 34).

Under sequence_parallel a norm inside a decoder layer is a DTensor on the (dp_shard, tp) mesh
and its gradient is placed (Shard(0), Replicate()): whole on tp, but with the tp dimension
second. Without it the same norm's gradient lives on the dp mesh alone, the placement the
tests at world 4 (test_tensor_parallel.py) exercise. The check must compare both across the
tp group and leave the split parameters, whose gradients differ by design, alone.

One spawned group of 2 (dp 1 x tp 2) runs every case: a Llama's gradients after one
backward are checked as they are (equal), then with one whole parameter's gradient changed on
tp rank 1 only (refused, naming it), then with a split parameter's changed (taken).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

import shardwise
from shardwise.parallelize.tensor import SplitGradientError, check_tp_gradients
from shardwise.testing import run_distributed

pytestmark = pytest.mark.tensor_parallel  # `make test-tp` (and .ci/run), not `make test`

NORM = "model.layers.0.post_attention_layernorm.weight"
SPLIT = "model.layers.0.mlp.up_proj.weight"


def _verdict(model) -> str:
    try:
        check_tp_gradients(model)
    except SplitGradientError as exc:
        return str(exc)
    return "equal"


def _nudge(model, name: str) -> None:
    """Change the gradient of `name` on tp rank 1 only (its local part)."""
    grad = dict(model.named_parameters())[name].grad
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    if dist.get_rank() == 1:
        local.add_(1.0)


def _cases() -> dict:  # type: ignore[type-arg]
    from transformers import LlamaConfig, LlamaForCausalLM

    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        parallel = shardwise.ParallelConfig(strategy="full_shard", tp=2, sequence_parallel=sp)
        model = shardwise.wrap(LlamaForCausalLM(config), parallel)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        params = dict(model.named_parameters())
        grad = params[NORM].grad
        mesh = grad.device_mesh.mesh_dim_names if isinstance(grad, DTensor) else None
        tp_place = str(grad.placements[mesh.index("tp")]) if mesh and "tp" in mesh else None
        case = {"norm_mesh": mesh, "norm_tp_placement": tp_place, "as_is": _verdict(model)}
        _nudge(model, SPLIT)
        case["split_changed"] = _verdict(model)
        _nudge(model, NORM)
        case["whole_changed"] = _verdict(model)
        out["sp" if sp else "plain"] = case
    return out


@pytest.fixture(scope="module")
def verdicts() -> dict:  # type: ignore[type-arg]
    ranks = run_distributed(_cases, 2, timeout_s=300)
    assert ranks[0] == ranks[1]  # every rank reaches the same verdict
    return ranks[0]


def test_the_norms_gradient_under_sequence_parallel_is_whole_on_tp_in_second_place(verdicts):
    assert verdicts["sp"]["norm_mesh"] == ("dp_shard", "tp")
    assert verdicts["sp"]["norm_tp_placement"] == str(Replicate())
    assert verdicts["plain"]["norm_mesh"] == ("dp_shard",)  # the placement tested elsewhere


@pytest.mark.parametrize("layout", ["plain", "sp"])
def test_a_whole_parameters_gradient_that_differs_over_tp_is_refused(verdicts, layout):
    case = verdicts[layout]
    assert case["as_is"] == "equal"
    assert case["split_changed"] == "equal"  # each rank's own part: differing is right
    assert case["whole_changed"].startswith(
        f"ParallelConfig.tp_plan leaves ['{NORM}'] whole, but their gradients differ between "
        "the ranks of a tensor-parallel group"
    ), case["whole_changed"]
