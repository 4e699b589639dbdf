"""Models built on the meta device: shard, materialise local shards, initialise or load.

Guarantee tested: a meta build initialises to the same distribution as an eager build
(per-parameter mean/std), identical on HSDP replicas; a meta build + load_weights equals an
eager build + load_weights exactly (parameters and buffers); nothing is left uninitialised
silently.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise import STRATEGIES, InitializationError, ParallelConfig, init_empty, unwrap, wrap
from shardwise.parallelize import WeightsError
from shardwise.testing import assert_same_distribution, run_distributed
from shardwise.testing.models import GPT, ConvNet, GPTConfig, random_lm_batches
from shardwise.testing.parity import full_parameters, split_batch

CFG = GPTConfig(d_model=64, n_layers=2, seq_len=16)


class Rotary(nn.Module):
    """A block with a computed, non-persistent buffer (like rotary tables)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer(
            "table", torch.outer(torch.arange(16).float(), freqs), persistent=False
        )

    def forward(self, x):
        return self.lin(x) + self.table[: x.shape[-2], :1]


class WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Rotary(32), Rotary(32))

    def forward(self, x):
        return self.blocks(x).pow(2).mean()


class Forgetful(nn.Module):
    """reset_parameters() forgets one of its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8))
        self.scale = nn.Parameter(torch.empty(8))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight)

    def forward(self, x):
        return (x @ self.weight * self.scale).sum()


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.zeros(4, 4))


def meta(factory):
    with init_empty():
        return factory()


def train_a_bit(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = random_lm_batches(CFG, 1, 8, seed=5)[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for _ in range(steps):
        loss = model(*split_batch(batch, rank, world))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _error(fn) -> str:
    try:
        fn()
    except (InitializationError, WeightsError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def cases(weights_dir: str, strategies: tuple[str, ...]) -> dict:
    out = {}
    for s in strategies:
        model = wrap(meta(functools.partial(GPT, CFG)), ParallelConfig(strategy=s))
        out[f"init_{s}"] = {"params": full_parameters(model), "losses": train_a_bit(model)}
        loaded = wrap(
            meta(functools.partial(GPT, CFG)), ParallelConfig(strategy=s), weights=weights_dir
        )
        out[f"load_{s}"] = full_parameters(loaded)
        # Only rank 0 is given the file: the others' path does not exist.
        from_rank0 = wrap(
            meta(functools.partial(GPT, CFG)),
            ParallelConfig(strategy=s),
            weights=weights_dir if dist.get_rank() == 0 else "/nonexistent/weights",
            broadcast_from_rank0=True,
        )
        out[f"load_{s}_rank0"] = full_parameters(from_rank0)
    # A model with persistent buffers (BatchNorm running statistics) loaded both ways.
    for s in strategies:
        for rank0 in (False, True):
            cnn = wrap(
                meta(ConvNet),
                ParallelConfig(strategy=s, auto_wrap_policy="none"),
                weights=f"{weights_dir}/convnet",
                broadcast_from_rank0=rank0,
            )
            buffers = {n: b.clone() for n, b in unwrap(cnn).named_buffers()}
            out[f"cnn_{s}_{'rank0' if rank0 else 'slices'}"] = {**full_parameters(cnn), **buffers}
    if dist.get_world_size() == 4:
        out["state_bytes"] = model_state_bytes()
    if "hybrid_shard" in strategies:
        model = wrap(meta(functools.partial(GPT, CFG)), ParallelConfig(strategy="hybrid_shard"))
        out["hsdp_local"] = {n: p.to_local().clone() for n, p in model.named_parameters()}
        out["mesh_coordinate"] = model._shardwise_wrap_info.device_mesh.get_coordinate()
    rot = wrap(meta(WithRotary), ParallelConfig())
    out["rotary_table"] = unwrap(rot).blocks[0].table.clone()
    out["forgetful"] = _error(
        lambda: wrap(meta(Forgetful), ParallelConfig(auto_wrap_policy="none"))
    )
    out["no_init"] = _error(lambda: wrap(meta(NoInit), ParallelConfig(auto_wrap_policy="none")))
    out["init_fn"] = full_parameters(
        wrap(meta(NoInit), ParallelConfig(auto_wrap_policy="none", param_init_fn=_fill_ones))
    )
    out["wrong_weights"] = _error(
        lambda: wrap(
            meta(functools.partial(GPT, GPTConfig(d_model=48, n_layers=2))),
            ParallelConfig(),
            weights=weights_dir,
        )
    )
    only_rank0 = weights_dir if dist.get_rank() == 0 else "/nonexistent/weights"
    out["wrong_weights_rank0"] = _error(
        lambda: wrap(
            meta(functools.partial(GPT, GPTConfig(d_model=48, n_layers=2))),
            ParallelConfig(),
            weights=only_rank0,
            broadcast_from_rank0=True,
        )
    )
    out["missing_file_rank0"] = _error(
        lambda: wrap(
            meta(functools.partial(GPT, CFG)),
            ParallelConfig(),
            weights="/nonexistent/on-rank-0-too",
            broadcast_from_rank0=True,
        )
    )
    return out


def model_state_bytes() -> tuple[int, int]:
    """(bytes of parameters + gradients + AdamW state held by this rank, total params)."""
    big = GPTConfig(d_model=128, n_layers=4, seq_len=16, vocab_size=256)
    model = wrap(meta(functools.partial(GPT, big)), ParallelConfig(strategy="full_shard"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*random_lm_batches(big, 1, 4)[0]).backward()
    opt.step()  # gradients are kept (no zero_grad): all three kinds of state are live

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size() if t.dim() else 0  # AdamW's scalar step: ignore

    total = 0
    for p in model.parameters():
        total += nbytes(p) + nbytes(p.grad) + sum(nbytes(v) for v in opt.state[p].values())
    return total, sum(p.numel() for p in model.parameters())


def _fill_ones(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        p.data.fill_(1.0) if not hasattr(p, "to_local") else p.to_local().fill_(1.0)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    shardwise.shutdown()
    path = tmp_path_factory.mktemp("weights")
    torch.manual_seed(7)
    shardwise.export_weights(GPT(CFG), path)
    cnn = ConvNet()
    with torch.no_grad():  # forward passes in train mode move BatchNorm's running stats
        for _ in range(3):
            cnn(torch.randn(4, 3, 8, 8) * 3 + 1)
    shardwise.export_weights(cnn, path / "convnet")
    return str(path)


@pytest.fixture(scope="module")
def world2(weights_dir):
    return run_distributed(
        cases,
        2,
        args=(weights_dir, tuple(s for s in STRATEGIES if not s.startswith("hybrid"))),
        timeout_s=240,
    )


@pytest.fixture(scope="module")
def world4(weights_dir):
    return run_distributed(
        cases,
        4,
        args=(weights_dir, STRATEGIES),
        timeout_s=240,
    )


@pytest.fixture(scope="module")
def eager():
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in GPT(CFG).named_parameters()}


@pytest.mark.parametrize(
    "case",
    [f"w2:{s}" for s in STRATEGIES if not s.startswith("hybrid")]  # HSDP needs a 2-D mesh
    + [f"w4:{s}" for s in STRATEGIES],
)
def test_meta_build_initialises_like_eager_and_trains(world2, world4, eager, case):
    world, strategy = case.split(":")
    results = world2 if world == "w2" else world4
    got = results[0][f"init_{strategy}"]
    assert_same_distribution(got["params"], eager, label=case)
    for name in ("blocks.0.ln1.weight", "ln_f.bias"):  # deterministic initialisers: exact
        assert torch.equal(got["params"][name], eager[name]), name
    assert all(math.isfinite(x) for x in got["losses"]) and got["losses"][-1] < got["losses"][0]
    for r in results:  # every rank sees the same full model
        for name, value in got["params"].items():
            assert torch.equal(r[f"init_{strategy}"]["params"][name], value)


def test_hsdp_replicas_are_identical_and_shards_differ(world4):
    by_coord = {tuple(r["mesh_coordinate"]): r["hsdp_local"] for r in world4}
    for shard in (0, 1):
        a, b = by_coord[(0, shard)], by_coord[(1, shard)]
        assert all(torch.equal(a[n], b[n]) for n in a), f"replicas of shard {shard} differ"
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.equal(by_coord[(0, 0)][qkv], by_coord[(0, 1)][qkv])


@pytest.mark.parametrize("world", [2, 4])
def test_meta_build_plus_load_equals_eager_build_plus_load(world2, world4, weights_dir, world):
    eager_model = GPT(GPTConfig(d_model=64, n_layers=2, seq_len=16))
    shardwise.load_weights(eager_model, weights_dir)
    want = {n: p.detach() for n, p in eager_model.named_parameters()}
    results = world2 if world == 2 else world4
    for r in results:
        for key in [k for k in r if k.startswith("load_")]:
            for name, value in want.items():
                assert torch.equal(r[key][name], value), (key, name)


def test_rank0_read_and_broadcast_equals_every_rank_reading(world2, world4):
    for results in (world2, world4):
        for r in results:
            for key in [k for k in r if k.startswith("load_") and k.endswith("_rank0")]:
                reference = r[key.removesuffix("_rank0")]
                for name, value in reference.items():
                    assert torch.equal(r[key][name], value), (key, name)


def test_rank0_errors_reach_every_rank(world2, world4):
    for r in (*world2, *world4):
        assert r["wrong_weights_rank0"].startswith("WeightsError: ")
        assert "Shape mismatches: ['blocks.0.attn.proj.bias: file (64,)" in r["wrong_weights_rank0"]
        assert "weights path /nonexistent/on-rank-0-too does not exist" in r["missing_file_rank0"]
    assert world2[1]["wrong_weights_rank0"].startswith(
        "WeightsError: rank 0 could not load the weights: WeightsError: weights in"
    )


def test_meta_build_plus_load_restores_buffers_too(world2, world4, weights_dir):
    eager_model = ConvNet()
    shardwise.load_weights(eager_model, f"{weights_dir}/convnet")
    want = dict(eager_model.state_dict())
    assert float(want["features.1.num_batches_tracked"]) == 3  # buffers are not defaults
    assert not torch.equal(want["features.1.running_mean"], torch.zeros(8))
    for r in (*world2, *world4):
        keys = [k for k in r if k.startswith("cnn_")]
        assert len(keys) >= 6
        for key in keys:
            assert sorted(r[key]) == sorted(want), key
            for name, value in want.items():
                assert torch.equal(r[key][name], value), (key, name)


def test_buffers_are_computed_not_garbage(world2):
    torch.manual_seed(0)
    want = WithRotary().blocks[0].table
    for r in world2:
        assert torch.equal(r["rotary_table"], want)


def test_untouched_parameter_is_reported(world2):
    for r in world2:
        assert r["forgetful"].startswith(
            "InitializationError: after materialising the meta-built model (reset_parameters), these were never initialised: ['scale']"
        )
        assert "Give their module a reset_parameters()" in r["forgetful"]


def test_no_initialiser_and_no_weights(world2):
    for r in world2:
        assert "these were never initialised: ['raw']" in r["no_init"]
        assert "wrap with weights=PATH" in r["no_init"]


def test_param_init_fn(world2):
    assert torch.equal(world2[0]["init_fn"]["raw"], torch.ones(4, 4))


def test_weights_that_do_not_match(world2):
    for r in world2:
        assert r["wrong_weights"].startswith("WeightsError: weights in")
        assert (
            "Shape mismatches: ['blocks.0.attn.proj.bias: file (64,) vs model (48,)'"
            in r["wrong_weights"]
        )


def test_model_state_bytes_per_rank_follow_16_psi_over_n(world4):
    for r in world4:
        held, params = r["state_bytes"]
        expected = 16 * params / 4  # fp32: 4 param + 4 grad + 8 AdamW bytes, over 4 ranks
        assert abs(held - expected) <= 0.02 * expected, (held, expected)
