"""The load-balancing loss and the statements about statistics of the batch, condition by
condition, in one process (the five habits of docs/testing.md): the loss's refusal, each
case the probe must reject, each word that marks a mixture of experts and where the model
itself comes, each outcome of replacing a family's function, the BatchNorm statement at
the sizes around its three names, and the class a sharded model is named by.
"""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import shardwise
from shardwise.parallelize import batch_stats, router_loss
from shardwise.parallelize.global_batch import BatchGroups
from shardwise.testing.models import ConvNet


def test_the_loss_without_the_number_of_experts_is_refused() -> None:
    logits = (torch.randn(4, 3),)
    with pytest.raises(ValueError) as caught:
        router_loss.load_balancing_loss(logits, None)
    assert str(caught.value) == (
        "load_balancing_loss: num_experts is required (the router's width)."
    )


def _ignores_the_mask(gate_logits, num_experts=None, top_k=2, attention_mask=None):  # type: ignore[no-untyped-def]
    return router_loss.load_balancing_loss(gate_logits, num_experts, top_k, None)


def _a_number(gate_logits, num_experts=None, top_k=2, attention_mask=None):  # type: ignore[no-untyped-def]
    value = router_loss.load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)
    return float(value.detach())  # type: ignore[union-attr]


def _another_signature(gate_logits):  # type: ignore[no-untyped-def]
    return router_loss.load_balancing_loss(gate_logits, 5)


@pytest.mark.parametrize(
    "function",
    [_ignores_the_mask, _a_number, _another_signature],
    ids=["ignores the padding mask", "returns a number", "takes other arguments"],
)
def test_the_probe_rejects_each_function_that_is_not_the_loss(function: object) -> None:
    """Each case alone: the same loss without a mask but not with one (a family that
    counts padding tokens), a value that is no tensor (no gradient to compare), and a
    function the probe's call does not fit."""
    assert router_loss._agrees(function) is False  # type: ignore[arg-type]
    assert router_loss._agrees(router_loss.load_balancing_loss) is True


class _Plain(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.gate = child


@pytest.mark.parametrize("word", ["Moe", "MOE", "Expert", "Router", "router"])
def test_each_word_in_a_class_name_marks_a_mixture_of_experts(word: str) -> None:
    child = type(f"TopK{word}Block", (nn.Linear,), {})(2, 2)
    assert batch_stats.moe_module(_Plain(child)) == "gate"
    assert batch_stats.moe_module(_Plain(nn.Linear(2, 2))) is None


class TinyMoE(nn.Module):
    def __init__(self, experts: bool) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        if experts:
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))


def test_the_model_itself_is_named_only_when_no_submodule_is_a_mixture_of_experts() -> None:
    assert batch_stats.moe_module(TinyMoE(experts=True)) == "experts"
    assert batch_stats.moe_module(TinyMoE(experts=False)) == "TinyMoE"


class _Mixture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)  # type: ignore[return-value]


def _stated(model: nn.Module, steps: int, installed: tuple[list[str], list[str]]) -> list[str]:
    """What `prepare` states over `steps` training forwards of `model` over 2 pretend ranks,
    with `install` answering `installed` (families replaced, families whose function
    differs)."""
    model.train()
    with (
        warnings.catch_warnings(record=True) as caught,
        mock.patch.object(batch_stats.dist, "get_rank", return_value=0),
        mock.patch.object(batch_stats, "install", return_value=installed),
    ):
        warnings.simplefilter("always")
        batch_stats.prepare(model, model, BatchGroups((), 2))
        for _ in range(steps):
            model(torch.ones(2, 4))
    return [str(w.message) for w in caught if w.category is shardwise.BatchStatisticNotice]


@pytest.mark.parametrize(
    ("installed", "stated", "named"),
    [
        ((["fam"], []), False, None),  # its family's loss is made whole-batch: nothing to say
        (([], []), True, None),  # no family function: the model's own code may form one
        (([], ["fam"]), True, "fam"),
        ((["fam"], ["other"]), True, "other"),  # one family replaced, another not
    ],
    ids=["replaced", "none", "differs", "replaced and differs"],
)
def test_each_outcome_of_replacing_the_familys_loss(
    installed: tuple[list[str], list[str]], stated: bool, named: str | None
) -> None:
    said = _stated(_Mixture(), 3, installed)
    assert len(said) == int(stated)
    if named is not None:
        assert f"Its family's load_balancing_loss_func ({named}) is not the Switch-style" in said[0]
    elif stated:
        assert "Its family's" not in said[0]


def _norms(depth: int) -> str:
    model = ConvNet(depth=depth)
    model.train()
    with (
        warnings.catch_warnings(record=True) as caught,
        mock.patch.object(batch_stats.dist, "get_rank", return_value=0),
    ):
        warnings.simplefilter("always")
        batch_stats.prepare(model, model, BatchGroups((), 2))
        model(torch.randn(2, 3, 4, 4))
    (notice,) = [str(w.message) for w in caught if w.category is shardwise.BatchStatisticNotice]
    return notice


@pytest.mark.parametrize(
    ("depth", "shown"),
    [
        (1, "(features.1)"),
        (3, "(features.1, features.4, features.7)"),
        (4, "(features.1, features.4, features.7 and 1 more)"),
    ],
)
def test_the_batchnorm_statement_names_up_to_three_layers(depth: int, shown: str) -> None:
    assert f"training mode {shown}: each of the 2 " in _norms(depth)


def test_a_sharded_model_is_named_by_its_own_class() -> None:
    """fully_shard swaps a module's class for a generated FSDP<Class>; the statements name
    the user's class."""
    model = _Mixture()
    model.__class__ = type(f"FSDP{_Mixture.__name__}", (FSDPModule, _Mixture), {})
    assert batch_stats.user_class(model) is _Mixture
    (notice,) = _stated(model, 2, ([], []))
    assert notice.startswith("shardwise: _Mixture has a mixture of experts (experts)")


@pytest.mark.parametrize("mode", ["raises", "returns"])
def test_a_training_forward_leaves_its_groups_however_it_ends(mode):
    """Fifth audit: after a wrapped model's training forward, raised or returned, its
    data-parallel groups are no longer current, so a global_batch_sum outside any forward
    does not reduce over ranks that never come."""
    import torch
    from torch import nn

    from shardwise.parallelize.global_batch import BatchGroups, attach, current

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = None
            self.layer = nn.Linear(2, 2)

        def forward(self, x):
            self.seen = current()
            if mode == "raises":
                raise RuntimeError("a bad batch")
            return self.layer(x)

    model = Model().train()
    groups = BatchGroups((), 2)
    attach(model, groups)
    try:
        model(torch.zeros(1, 2))
    except RuntimeError:
        pass
    assert model.seen is groups  # current inside the forward
    assert current() is None
