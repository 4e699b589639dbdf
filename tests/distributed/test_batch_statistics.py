"""Losses built from statistics of the whole batch train under every layout as one process.

A mixture of experts' load-balancing loss multiplies two statistics of the batch (the
fraction of tokens routed to each expert, the mean router probability); computed from each
rank's rows it trains another router (issue 32). Three transformers MoE families with their
auxiliary loss on are trained 3 SGD steps at world 4 under ddp, full_shard, hybrid_shard
(2 x 2), and tp 2 with and without sequence parallel, each data-parallel rank on its part of
every global batch, and compared with one process on the whole batch: the loss at every
step, every gradient after the first step (the routers' included) and the final
parameters. The same comparison rejects the old behaviour (each rank's statistics alone).

A mixture of experts of our own computes the same loss in its own code, beside a router
z-loss (a mean over tokens, equal over equal slices): with `shardwise.global_batch_sum` it
equals one process (also when activation checkpointing recomputes its blocks inside
backward); without it, it does not, and a statement says so once. A masked loss normalised
by the batch's token count is the other statistic the hook makes whole. BatchNorm keeps each
rank's statistics (measured, and stated once). All cases run in one spawned group of 4
(`make test-batch-stats`).
"""

from __future__ import annotations

import functools
import threading
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.parallelize import global_batch, router_loss
from shardwise.testing import run_distributed
from shardwise.testing.models import ConvNet
from shardwise.testing.parity import split_batch, worst_of

pytestmark = pytest.mark.batch_stats

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS, LR = 32, 8, 6, 3, 0.5
RTOL = 1e-5
DECODER = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, output_router_logits=True,
)  # fmt: skip
# Each family at its own default coefficient (OLMoE 0.01, the others 0.001).
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 4, "num_experts": 4, "moe_intermediate_size": 8}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4}),
}  # fmt: skip
LAYOUTS = {
    "ddp": {"strategy": "ddp"},
    "full_shard": {"strategy": "full_shard"},
    "hybrid_shard": {"strategy": "hybrid_shard"},  # replicate 2 x shard 2
    "tp2": {"strategy": "full_shard", "tp": 2},  # dp 2 x tp 2
    "tp2_sp": {"strategy": "full_shard", "tp": 2, "sequence_parallel": True},
}


def build_family(name: str) -> nn.Module:
    config_cls, model_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**DECODER, "num_experts_per_tok": 2, **extra})
    return getattr(transformers, model_cls)(config)


def batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),) for _ in range(STEPS)]


def _hf_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def _backward_on_another_thread(loss: torch.Tensor) -> None:
    """As CUDA runs a checkpointed block's recompute: on a thread that does not see the
    caller's context variables (pytorch#186583)."""
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "backward on another thread did not finish within 120 s"


def train(
    model: nn.Module, rank_batch, loss_of, data=batches, backward=torch.Tensor.backward
) -> dict:  # type: ignore[no-untyped-def]
    """3 SGD steps: each step's loss (averaged over the ranks), the first step's
    gradients and the final parameters, all whole."""
    user = shardwise.unwrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first_grads = [], {}
    for step, batch in enumerate(data()):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, rank_batch(batch))
        backward(loss)
        if step == 0:
            first_grads = {n: _full(p.grad) for n, p in user.named_parameters()}
        opt.step()
        detached = loss.detach()
        losses.append(
            shardwise.mean_across_ranks(detached) if dist.is_initialized() else float(detached)
        )
    return {
        "losses": losses,
        "grads": first_grads,
        "params": {n: _full(p) for n, p in user.named_parameters()},
    }


# --- a mixture of experts of our own, whose code computes the load-balancing loss ----------

D, EXPERTS, TOP_K, AUX, Z = 8, 4, 2, 0.1, 0.01


def _switch_loss(stats: torch.Tensor, whole_batch: bool) -> torch.Tensor:
    if whole_batch:
        stats = shardwise.global_batch_sum(stats)
    counts, probs, rows = stats[:EXPERTS], stats[EXPERTS:-1], stats[-1]
    return EXPERTS * torch.sum((counts / rows) * (probs / rows))


class Experts(nn.Module):
    """A router and EXPERTS small MLPs; top-2 routing; its Switch-style statistics (or, with
    `per_layer`, its own layer's load-balancing loss, formed here inside the block) and its
    router z-loss (the mean over tokens of the squared log-sum-exp of the router logits)."""

    def __init__(self, whole_batch: bool, per_layer: bool) -> None:
        super().__init__()
        self.whole_batch, self.per_layer = whole_batch, per_layer
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))
            for _ in range(EXPERTS)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, D)
        logits = self.router(flat)
        probs = torch.softmax(logits, dim=-1)
        weights, chosen = torch.topk(probs, TOP_K, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        counts = torch.zeros(EXPERTS).scatter_add(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        stats = torch.cat([counts, probs.sum(0), torch.tensor([float(flat.shape[0])])])
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        if self.per_layer:  # activation checkpointing recomputes this in backward
            stats = _switch_loss(stats, self.whole_batch)
        return x + out.reshape(x.shape), stats, z_loss


class Block(nn.Module):
    def __init__(self, whole_batch: bool, per_layer: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = Experts(whole_batch, per_layer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.moe(self.norm(x))


class OwnMoE(nn.Module):
    """A language model whose forward returns cross-entropy + AUX x load-balancing loss +
    Z x router z-loss; `whole_batch` sums the routing statistics with
    shardwise.global_batch_sum first, over the layers at the end (transformers' way) or, with
    `per_layer`, inside each block. The z-loss is a mean over tokens, each rank's own: over
    equal slices their mean is the whole batch's, so it needs nothing."""

    def __init__(self, whole_batch: bool, per_layer: bool = False) -> None:
        super().__init__()
        self.whole_batch, self.per_layer = whole_batch, per_layer
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(whole_batch, per_layer) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, aux, z_loss = self.emb(tokens), torch.zeros(()), torch.zeros(())
        stats = torch.zeros(2 * EXPERTS + 1)
        for block in self.blocks:
            h, layer, layer_z = block(h)
            z_loss = z_loss + layer_z
            if self.per_layer:
                aux = aux + layer
            else:
                stats = stats + layer
        if not self.per_layer:
            aux = _switch_loss(stats, self.whole_batch)
        logits = self.head(h)[:, :-1].flatten(0, 1)
        ce = nn.functional.cross_entropy(logits, tokens[:, 1:].flatten())
        return ce + AUX * aux + Z * z_loss


def _own_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(batch[0])


# --- a loss normalised by the batch's token count (padding) -----------------------------


class MaskedLM(nn.Module):
    """Cross-entropy over the tokens that are not padding (-100): with `whole_batch`, the
    sum and the count are the global batch's, so the mean is over the whole batch's tokens."""

    def __init__(self, whole_batch: bool) -> None:
        super().__init__()
        self.whole_batch = whole_batch
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        labels = torch.where(tokens % 3 == 0, -100, tokens)  # a third is padding, unevenly
        logits = self.head(torch.tanh(self.emb(tokens))).flatten(0, 1)
        total = nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum")
        count = (labels != -100).sum().float()
        if self.whole_batch:
            total, count = shardwise.global_batch_sum(total), shardwise.global_batch_sum(count)
        return total / count


# --- BatchNorm: each rank normalises by its own rows ------------------------------------


def images() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(BATCH, 3, 6, 6, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _cnn_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(*batch)


def references() -> dict:  # type: ignore[type-arg]
    out = {}
    for name in FAMILIES:
        torch.manual_seed(0)
        out[name] = train(build_family(name), lambda b: b, _hf_loss)
    for name, build in (
        ("own", functools.partial(OwnMoE, True)),
        ("own_per_layer", functools.partial(OwnMoE, True, per_layer=True)),
        ("masked", functools.partial(MaskedLM, True)),
    ):
        torch.manual_seed(0)
        out[name] = train(build(), lambda b: b, _own_loss)
    torch.manual_seed(0)
    out["batchnorm"] = train(ConvNet(), lambda b: b, _cnn_loss, data=images)
    return out


def _wrapped(build, config: shardwise.ParallelConfig, loss_of, **kwargs) -> dict:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", shardwise.BatchStatisticNotice)
        model = shardwise.wrap(build(), config)
        info = shardwise.wrap_info(model)
        assert info is not None
        summed_over = _ranks_summed_over(shardwise.unwrap(model))
        shard = functools.partial(split_batch, rank=info.dp_rank, world_size=info.dp_size)
        result = train(model, shard, loss_of, **kwargs)
    notices = [str(w.message) for w in caught if w.category is shardwise.BatchStatisticNotice]
    return {**result, "notices": notices, "summed_over": summed_over[0]}


def _ranks_summed_over(model: nn.Module) -> list[int]:
    """How many ranks `global_batch_sum` sums over in the first training forward (the
    data-parallel ones; a tp group shares its rows), read without summing anything."""
    seen: list[int] = []

    def count(module: nn.Module, args: object) -> None:
        current = global_batch.current()
        if not seen and current is not None:
            seen.append(current.size)

    model.register_forward_pre_hook(count)
    return seen


def _cases() -> dict:  # type: ignore[type-arg]
    out = {}
    for name in FAMILIES:
        build = functools.partial(build_family, name)
        for layout, fields in LAYOUTS.items():
            config = shardwise.ParallelConfig(**fields)
            out[f"{name}/{layout}"] = _wrapped(build, config, _hf_loss)
    # The old behaviour: the family's own function on each rank's rows.
    with mock.patch.object(router_loss, "current", lambda: None):
        build = functools.partial(build_family, "olmoe")
        out["olmoe/per_rank"] = _wrapped(build, shardwise.ParallelConfig(), _hf_loss)
    full = shardwise.ParallelConfig(strategy="full_shard")
    out["own/hook"] = _wrapped(functools.partial(OwnMoE, True), full, _own_loss)
    recompute = shardwise.ParallelConfig(
        strategy="full_shard", auto_wrap_policy={Block}, activation_checkpointing="full"
    )
    per_layer = functools.partial(OwnMoE, True, per_layer=True)
    out["own_per_layer/hook"] = _wrapped(per_layer, full, _own_loss)
    out["own_per_layer/hook_recomputed"] = _wrapped(per_layer, recompute, _own_loss)
    out["own_per_layer/hook_recomputed_other_thread"] = _wrapped(
        per_layer, recompute, _own_loss, backward=_backward_on_another_thread
    )
    out["own/no_hook"] = _wrapped(functools.partial(OwnMoE, False), full, _own_loss)
    out["masked/hook"] = _wrapped(functools.partial(MaskedLM, True), full, _own_loss)
    out["masked/no_hook"] = _wrapped(functools.partial(MaskedLM, False), full, _own_loss)
    for strategy in ("ddp", "full_shard"):
        config = shardwise.ParallelConfig(strategy=strategy)
        out[f"batchnorm/{strategy}"] = _wrapped(ConvNet, config, _cnn_loss, data=images)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _worst(ref: dict, got: dict, only: str = "") -> tuple[float, str]:  # type: ignore[type-arg]
    seen: list[tuple[float, str]] = []
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        seen.append((abs(a - b) / abs(b), f"loss at step {i}"))
    for kind in ("grads", "params"):
        for n, b in ref[kind].items():
            if only in n:
                seen.append((_rel(got[kind][n], b), f"{kind[:-1]} {n}"))
    worst_of(value for value, _ in seen)  # a NaN anywhere fails here, not silently
    return max(seen, default=(0.0, ""))


def _router(name: str) -> str:
    return "mlp.gate.weight" if name in FAMILIES else "moe.router.weight"


@pytest.fixture(scope="module")
def results() -> tuple[dict, list[dict]]:  # type: ignore[type-arg]
    return references(), run_distributed(_cases, 4, timeout_s=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_load_balancing_loss_trains_as_one_process(results, family, layout):
    refs, ranks = results
    got = ranks[0][f"{family}/{layout}"]
    rel, where = _worst(refs[family], got)
    print(f"{family} {layout}: the largest difference is {where}, rel {rel:.2e}")
    assert rel < RTOL, f"{family} {layout}: {where} differs by {rel:.2e}"
    assert got["summed_over"] == (2 if layout.startswith("tp2") else 4)  # the dp ranks only
    # The routers' gradients are compared, not only present: every layer's is there.
    routers = [n for n in refs[family]["grads"] if n.endswith(_router(family))]
    assert len(routers) == 2, routers
    assert all(r[f"{family}/{layout}"]["notices"] == [] for r in ranks)


def test_the_comparison_catches_each_rank_using_its_own_statistics(results):
    refs, ranks = results
    rel, where = _worst(refs["olmoe"], ranks[0]["olmoe/per_rank"], only=_router("olmoe"))
    print(f"olmoe, each rank's own statistics: {where}, rel {rel:.2e}")
    assert rel > 0.2, f"the per-rank loss passed ({where}: {rel:.2e})"
    loss_rel, _ = _worst({**refs["olmoe"], "grads": {}, "params": {}},
                         {**ranks[0]["olmoe/per_rank"], "grads": {}, "params": {}})  # fmt: skip
    print(f"olmoe, each rank's own statistics: the loss, rel {loss_rel:.2e}")
    assert loss_rel < 1e-3  # the loss alone hides it: the gradient is what differs


@pytest.mark.parametrize(
    "case",
    [
        "own/hook",
        "own_per_layer/hook",
        "own_per_layer/hook_recomputed",
        "own_per_layer/hook_recomputed_other_thread",
        "masked/hook",
    ],
)
def test_global_batch_sum_makes_a_models_own_statistics_whole(results, case):
    """Also where the loss is formed inside a block that activation checkpointing recomputes
    in backward: the recomputed statistics are summed again, as in the forward, also when
    the backward runs on a thread of its own (CUDA's autograd device thread)."""
    refs, ranks = results
    rel, where = _worst(refs[case.split("/")[0]], ranks[0][case])
    print(f"{case}: the largest difference is {where}, rel {rel:.2e}")
    assert rel < RTOL, f"{case}: {where} differs by {rel:.2e}"
    assert all(r[case]["notices"] == [] for r in ranks)


def test_without_the_hook_an_own_load_balancing_loss_differs_and_is_stated_once(results):
    refs, ranks = results
    rel, where = _worst(refs["own"], ranks[0]["own/no_hook"], only=_router("own"))
    print(f"own MoE without global_batch_sum: {where}, rel {rel:.2e}")
    assert rel > 0.05, f"the per-rank statistics matched one process ({where}: {rel:.2e})"
    (notice,) = ranks[0]["own/no_hook"]["notices"]  # once, on rank 0 only
    assert all(r["own/no_hook"]["notices"] == [] for r in ranks[1:])
    assert notice.startswith(
        "shardwise: OwnMoE has a mixture of experts (blocks.0.moe), and nothing in its first "
        "training step summed a statistic over the global batch (shardwise.global_batch_sum). "
        "If it computes an auxiliary (load-balancing) loss from routing statistics of the "
        "batch, each of the 4 data-parallel ranks computes it from its own rows"
    ), notice
    assert "Sum the statistics with shardwise.global_batch_sum(...)" in notice


def test_a_padding_normalised_loss_differs_without_the_hook(results):
    refs, ranks = results
    rel, where = _worst(refs["masked"], ranks[0]["masked/no_hook"])
    print(f"masked mean per rank: {where}, rel {rel:.2e}")
    assert rel > 1e-3, f"the per-rank mean matched one process ({where}: {rel:.2e})"
    assert ranks[0]["masked/no_hook"]["notices"] == []  # no experts: nothing to state


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_batchnorm_normalises_each_ranks_rows_and_says_so(results, strategy):
    refs, ranks = results
    got = ranks[0][f"batchnorm/{strategy}"]
    # The head and the norms' scales: the convolutions' biases before a BatchNorm get a
    # gradient of zero in exact arithmetic (the norm removes any shift), so only rounding.
    for only in ("head.weight", "features.1.weight"):
        rel, where = _worst(refs["batchnorm"], got, only=only)
        print(f"BatchNorm, {strategy}: {where}, rel {rel:.2e}")
        assert rel > 1e-2, f"per-rank BatchNorm matched one process ({where}: {rel:.2e})"
    (notice,) = got["notices"]
    assert notice.startswith("shardwise: ConvNet has BatchNorm layers in training mode "
                             "(features.1, features.4): each of the 4 data-parallel ranks")  # fmt: skip
    assert all(r[f"batchnorm/{strategy}"]["notices"] == [] for r in ranks[1:])
