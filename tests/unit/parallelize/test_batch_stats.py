"""What wrap says about statistics of the batch it leaves per rank, in one process over two
pretend data-parallel ranks (groups of nothing: `global_batch_sum` sums over no process
group here): a mixture of experts whose first step summed nothing over the batch, and
BatchNorm layers normalising in training mode, each stated once on rank 0."""

from __future__ import annotations

import contextvars
import threading
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

import shardwise
from shardwise.parallelize import batch_stats
from shardwise.parallelize.global_batch import BatchGroups
from shardwise.testing.models import GPT, ConvNet, GPTConfig


class _Mixture(nn.Module):
    def __init__(self, use_hook: bool) -> None:
        super().__init__()
        self.use_hook = use_hook
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_hook:
            x = shardwise.global_batch_sum(x)
        return sum(e(x) for e in self.experts)  # type: ignore[return-value]


def test_moe_module_names_the_first_mixture_of_experts():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    mixtral = transformers.MixtralForCausalLM(config)
    assert batch_stats.moe_module(_Mixture(False)) == "experts"
    assert batch_stats.moe_module(mixtral) == "model.layers.0.mlp"  # MixtralSparseMoeBlock
    assert batch_stats.moe_module(GPT(GPTConfig())) is None


def _forwards(model: nn.Module, steps: int, training: bool = True, rank: int = 0) -> list[str]:
    """What `prepare` states over `steps` forwards of `model` over 2 pretend ranks."""
    model.train(training)
    with (
        warnings.catch_warnings(record=True) as caught,
        mock.patch.object(batch_stats.dist, "get_rank", return_value=rank),
    ):
        warnings.simplefilter("always")
        batch_stats.prepare(model, model, BatchGroups((), 2))
        for _ in range(steps):
            model(torch.ones(2, 4))
    return [str(w.message) for w in caught if w.category is shardwise.BatchStatisticNotice]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts) + self.gate(x).sum()  # type: ignore[return-value]


class _Stack(nn.Module):
    """No class named for MoE, experts or a router: only a child named `experts`, below
    the top level, says this is a mixture of experts."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_child_named_experts_below_the_top_level_is_a_mixture_of_experts():
    """Fourth audit: the child's own name is the last part of its path; at the top level
    ('experts') the first part is the same, one level down ('layers.0.experts') it is not."""
    assert batch_stats.moe_module(_Stack()) == "layers.0.experts"
    assert batch_stats.moe_module(_Stack().layers[1]) == "experts"
    (notice,) = _forwards(_Stack(), 3)
    assert notice.startswith(
        "shardwise: _Stack has a mixture of experts (layers.0.experts), and nothing in its "
        "first training step summed a statistic over the global batch "
        "(shardwise.global_batch_sum). If it computes an auxiliary (load-balancing) loss from "
        "routing statistics of the batch, each of the 2 data-parallel ranks computes it from "
        "its own rows"
    )


def test_an_unseen_load_balancing_loss_is_stated_once_before_the_second_step():
    assert _forwards(_Mixture(False), 1) == []  # the loss may be formed after the forward
    (notice,) = _forwards(_Mixture(False), 4)
    assert notice.startswith(
        "shardwise: _Mixture has a mixture of experts (experts), and nothing in its first "
        "training step summed a statistic over the global batch"
    )
    assert "each of the 2 data-parallel ranks computes it from its own rows" in notice
    assert "category=shardwise.BatchStatisticNotice) silences this" in notice


def test_nothing_is_stated_when_the_hook_was_used_or_nothing_trains():
    assert _forwards(_Mixture(True), 3) == []
    assert _forwards(_Mixture(False), 3, training=False) == []  # eval forwards: no step


def test_a_family_with_another_function_is_named_in_the_statement():
    model = _Mixture(False)
    with mock.patch.object(batch_stats, "install", return_value=([], ["transformers.x"])):
        (notice,) = _forwards(model, 2)
    assert (
        "Its family's load_balancing_loss_func (transformers.x) is not the Switch-style" in notice
    )


def test_a_statement_is_made_on_rank_0_only():
    assert _forwards(_Mixture(False), 3, rank=1) == []
    assert _forwards(_Normalised(), 3, rank=1) == []


class _Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def test_batchnorm_in_training_mode_is_stated_once_at_the_first_step():
    (notice,) = _forwards(_Normalised(), 1)
    assert notice == (
        "shardwise: _Normalised has BatchNorm layers in training mode (norm): each of the 2 "
        "data-parallel ranks normalises its own rows by their own mean and variance, so "
        "training differs from one process on the whole batch (see docs/parity.md for the "
        "measured gap). For whole-batch statistics, convert them before wrap on GPUs: model = "
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model). If per-rank statistics are "
        "what you want, warnings.filterwarnings('ignore', "
        "category=shardwise.BatchStatisticNotice) silences this."
    )
    assert len(_forwards(_Normalised(), 4)) == 1  # once


def test_batchnorm_statement_names_three_layers_and_counts_the_rest():
    model = ConvNet(depth=5)
    model.train()
    with (
        warnings.catch_warnings(record=True) as caught,
        mock.patch.object(batch_stats.dist, "get_rank", return_value=0),
    ):
        warnings.simplefilter("always")
        batch_stats.prepare(model, model, BatchGroups((), 4))
        model(torch.randn(2, 3, 4, 4))
    (notice,) = [str(w.message) for w in caught if w.category is shardwise.BatchStatisticNotice]
    assert "(features.1, features.4, features.7 and 2 more): each of the 4 " in notice


def test_batchnorm_in_eval_mode_or_synced_is_not_stated():
    frozen = _Normalised()
    forwards = 0

    def freeze(module: nn.Module, args: object) -> None:  # mmdet's norm_eval: BN stays in eval
        nonlocal forwards
        forwards += 1
        frozen.norm.eval()

    frozen.register_forward_pre_hook(freeze, prepend=True)
    assert _forwards(frozen, 2) == [] and forwards == 2
    synced = _Normalised()
    synced.norm = nn.SyncBatchNorm(4)
    synced.norm.forward = lambda x: x  # type: ignore[method-assign]  # its forward needs CUDA
    assert _forwards(synced, 2) == []


def test_eval_forwards_leave_statistics_per_rank():
    """No collective in eval mode: generation on rank 0 alone must not wait for peers."""
    model = _Mixture(True)
    batch = BatchGroups((), 2)
    with mock.patch.object(batch_stats.dist, "get_rank", return_value=0):
        batch_stats.prepare(model, model, batch)
        model.eval()
        model(torch.ones(2, 4))
        assert batch.used == 0
        model.train()
        model(torch.ones(2, 4))
        assert batch.used == 1


class _Recomputed(nn.Module):
    """A block that activation checkpointing recomputes in backward, whose forward sums a
    statistic over the batch: the recompute must sum it again, over the same ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        # tanh saves its output: the recompute (which stops at the last saved tensor it
        # needs) runs through the sum
        return torch.tanh(shardwise.global_batch_sum(self.inner(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False).sum()


def _backward_in_a_fresh_context(loss: torch.Tensor) -> None:
    contextvars.Context().run(loss.backward)


def _backward_on_another_thread(loss: torch.Tensor) -> None:
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "backward did not finish within 60 s"


@pytest.mark.parametrize(
    "backward",
    [torch.Tensor.backward, _backward_in_a_fresh_context, _backward_on_another_thread],
    ids=["same_context", "fresh_context", "another_thread"],
)
def test_a_recomputed_block_sums_over_the_batch_as_its_forward_did(backward):
    """On CUDA, autograd recomputes a checkpointed block on its device thread, which does not
    see the caller's context variables (pytorch#186583): the recompute must still find the
    forward's groups, or its statistic comes back each rank's own, with no error."""
    model = _Recomputed()
    batch = BatchGroups((), 2)
    with mock.patch.object(batch_stats.dist, "get_rank", return_value=0):
        batch_stats.prepare(model, model, batch)
        loss = model(torch.ones(2, 4))
        assert batch.used == 1
        backward(loss)
    assert batch.used == 2  # the recompute summed too
    assert model.inner.weight.grad is not None


def test_outside_any_forward_or_backward_a_statistic_is_left_alone():
    """The groups of the last training forward are the recompute's, in backward only: a
    statistic summed after the forward (a metric, an eval loop of one's own) is this
    rank's, with no collective (issue 48)."""
    model = _Mixture(True)
    batch = BatchGroups((), 2)
    with mock.patch.object(batch_stats.dist, "get_rank", return_value=0):
        batch_stats.prepare(model, model, batch)
        model(torch.ones(2, 4))
    assert batch.used == 1
    t = torch.ones(3)
    assert shardwise.global_batch_sum(t) is t and batch.used == 1


def test_a_statistic_summed_with_model_is_left_alone_in_eval_mode():
    """`global_batch_sum(t, model=m)` outside a forward: over m's data-parallel ranks in
    training mode, and this rank's own in eval mode (generation or evaluation on rank 0
    alone must not wait for peers), every time the mode changes (fresh audit)."""
    model = _Mixture(True)
    batch = BatchGroups((), 2)
    with mock.patch.object(batch_stats.dist, "get_rank", return_value=0):
        batch_stats.prepare(model, model, batch)
    t = torch.ones(3)
    model.eval()
    assert shardwise.global_batch_sum(t, model=model) is t and batch.used == 0
    model.train()
    summed = shardwise.global_batch_sum(t, model=model)
    assert batch.used == 1 and torch.equal(summed, t)  # no groups here: the sum of one rank
    model.eval()
    assert shardwise.global_batch_sum(t, model=model) is t and batch.used == 1
    unwrapped = _Mixture(True)  # never attached: its own value in either mode
    assert shardwise.global_batch_sum(t, model=unwrapped) is t and batch.used == 1
