"""Expert parallel and the experts' tp split, condition by condition, in one process (the
five habits of docs/testing.md): each combination ep refuses, each condition that makes a
module an experts module, the divisors a refusal offers, each refusal of an experts module's
split, the tp plan's description under ep, and the counts each rank is sent.
"""

from __future__ import annotations

import collections
import math
import re

import pytest
import torch
import transformers
from torch import nn

import shardwise
from shardwise.cli.plan_experts import _expert_load
from shardwise.parallelize.experts import (
    _per_rank,
    check_expert_load,
    check_expert_parallel,
    find_experts,
    plan_without_experts,
)
from shardwise.parallelize.moe import ExpertsParallel
from shardwise.parallelize.tensor import check_tensor_parallel


def test_ep_with_cpu_offload_is_refused_and_without_ep_it_is_taken() -> None:
    with pytest.raises(NotImplementedError) as caught:
        shardwise.ParallelConfig(ep=2, cpu_offload=True)
    assert str(caught.value) == (
        "ParallelConfig.ep=2 with cpu_offload is not built yet: no test proves the "
        "combination equal to one process. Use ep=1 with cpu_offload, or leave it out."
    )
    assert shardwise.ParallelConfig(ep=1, cpu_offload=True).ep == 1
    assert shardwise.ParallelConfig(ep=2, cpu_offload=False).ep == 2


class _Experts(nn.Module):
    """An experts module in the documented shape, each part of it adjustable."""

    def __init__(self, count: object = 4, rows: int = 4, params: bool = True) -> None:
        super().__init__()
        self.num_experts = count
        if params:
            self.gate_up_proj = nn.Parameter(torch.zeros(rows, 8, 6))
            self.down_proj = nn.Parameter(torch.zeros(rows, 6, 4))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return hidden_states


@pytest.mark.parametrize(
    ("experts", "found"),
    [
        (_Experts(), True),
        (_Experts(rows=3), False),  # the first dimension is not the experts'
        (_Experts(params=False), False),  # nothing to spread
        (_Experts(count=0, rows=0), False),
        (_Experts(count=4.0), False),  # not a count
        (_Experts(count=None), False),
    ],
    ids=["experts", "another first dimension", "no parameters", "no experts", "a float", "none"],
)
def test_each_condition_of_an_experts_module(experts: nn.Module, found: bool) -> None:
    holder = nn.Module()
    holder.mlp = experts
    assert find_experts(holder) == ({"mlp": experts} if found else {})


def test_an_ep_that_does_not_divide_the_experts_offers_every_divisor() -> None:
    holder = nn.Module()
    holder.experts = _Experts(count=6, rows=6)
    with pytest.raises(ValueError) as caught:
        check_expert_parallel(holder, 4)
    divisors = [d for d in range(1, 7) if 6 % d == 0]
    assert str(caught.value).endswith(f"Choose ep in {divisors}.")
    assert divisors == [1, 2, 3, 6]


def test_an_unknown_word_for_an_experts_parameter_is_refused_when_the_style_is_made() -> None:
    with pytest.raises(
        NotImplementedError,
        match=r"tensor-parallel plan word 'colwise' on a parameter of a 'moe_tp_experts' module "
        r"is not supported \(shardwise knows packed_colwise, rowwise there\)",
    ):
        ExpertsParallel({"gate_up_proj": "colwise", "down_proj": "rowwise"})


_SPLITS = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def test_experts_stored_transposed_are_refused() -> None:
    experts = _Experts()
    experts.is_transposed = True
    with pytest.raises(NotImplementedError, match=r"the experts module experts stores its weights "
                       r"transposed \(is_transposed=True\)"):  # fmt: skip
        ExpertsParallel(_SPLITS).check_covers(experts, "experts")
    experts.is_transposed = False
    ExpertsParallel(_SPLITS).check_covers(experts, "experts")


@pytest.mark.parametrize("shape", [(4, 8), (4, 8, 6, 2)])
def test_an_experts_parameter_that_is_not_3d_is_refused_by_its_shape(
    shape: tuple[int, ...],
) -> None:
    style = ExpertsParallel({"down_proj": "rowwise"})
    with pytest.raises(ValueError, match=rf"experts\.down_proj has shape {re.escape(str(shape))}; a "
                       r"'moe_tp_experts' module's parameters are 3-D"):  # fmt: skip
        style._placement("down_proj", torch.zeros(shape), 2, "experts")


def test_under_ep_the_plan_describes_only_what_it_still_splits() -> None:
    common = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16, head_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**common))
    plan = check_tensor_parallel(model, shardwise.ParallelConfig(tp=2))
    kept = plan_without_experts(plan, 2)
    assert isinstance(kept.apply, dict)
    assert set(kept.described) == set(kept.apply)
    assert kept.described == {k: plan.described[k] for k in kept.apply}
    assert not any(".experts" in k for k in kept.described)


@pytest.mark.parametrize(
    ("owners", "ep"),
    [([0, 0, 2, 2, 2], 4), ([1, 1, 1], 2), ([0, 1, 2, 3], 4), ([3, 3], 4), ([], 2)],
    ids=["a rank between", "the first rank", "one each", "the last rank only", "no tokens"],
)
def test_each_rank_is_sent_the_copies_of_its_experts(owners: list[int], ep: int) -> None:
    """The sorted copies' owners counted per rank, ranks without any included."""
    count = collections.Counter(owners)
    got = _per_rank(torch.tensor(owners, dtype=torch.long), ep)
    assert got.tolist() == [count[r] for r in range(ep)]


@pytest.mark.parametrize("load", [math.inf, -math.inf, math.nan])
def test_an_expert_load_that_is_not_finite_is_refused(load: float) -> None:
    """+inf passed `load >= 1` and failed later inside the simulation, with OverflowError
    from math.ceil; NaN and -inf compare false and were refused."""
    with pytest.raises(ValueError, match=r"a number >= 1 \(1: perfectly balanced\), or 'worst'"):
        check_expert_load(load)
    with pytest.raises(ValueError, match=rf"--expert-load {load}: give the busiest rank's"):
        _expert_load(str(load), 2.0)
    assert check_expert_load(1e6) == 1e6 and check_expert_load("worst") == "worst"


@pytest.mark.parametrize(
    ("load", "tokens", "k", "ep", "local"),
    [
        (1.5, 3, 1, 2, 4),
        (1.25, 5, 2, 4, 2),
        (1.1, 7, 1, 2, 8),
        (2, 3, 1, 2, 1),
        ("worst", 3, 2, 2, 1),
    ],
)
def test_a_stated_load_sends_the_busiest_rank_its_rows_rounded_up(load, tokens, k, ep, local):
    """Fifth audit: the busiest rank receives load x tokens x k rows, a fraction rounded up
    (a row is whole: 4.5 rows reach it as 5), never more than can reach it."""
    from fractions import Fraction

    from shardwise.parallelize.experts import StatedRouting

    bound = ep * tokens * min(k, local)
    if load == "worst":
        rows = bound
    else:
        exact = Fraction(load).limit_denominator(100) * tokens * k
        rows = min(-(-exact.numerator // exact.denominator), bound)  # the ceiling, exactly
    routing = StatedRouting(load)
    sent, received = routing.splits(tokens, k, ep, local)
    assert sum(sent) == tokens * k and max(sent) - min(sent) <= 1
    assert sum(received) == rows and max(received) - min(received) <= 1
    assert routing.seen == [(tokens, k, rows)]
