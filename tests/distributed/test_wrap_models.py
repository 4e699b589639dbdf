"""Planned units in a running job: the applied wrap equals the plan (units, precision
policies, DDP hooks), BatchNorm under bf16, frozen gradients, tied state_dict, ignored
parameters. All cases share one spawned world-2 process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise import ParallelConfig, unwrap, wrap, wrap_info
from shardwise.testing import run_distributed
from shardwise.testing.models import (
    GPT,
    Block,
    ConvNet,
    CrossTied,
    Embeddings,
    GPTConfig,
    LoRALM,
    random_lm_batches,
)

CFG = GPTConfig()
STRATEGIES = ("ddp", "no_shard", "shard_grad_op", "full_shard")


def image_batch(rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class is decided by the mean of the first channel: learnable fast."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long()
    return x, y


def cnn_bf16(strategy: str) -> dict:
    torch.manual_seed(0)
    model = wrap(
        ConvNet(channels=8, num_classes=2),
        ParallelConfig(strategy=strategy, mixed_precision="bf16"),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = image_batch(dist.get_rank())
    bn_input_dtypes = set()
    bn = unwrap(model).features[1]
    bn.register_forward_pre_hook(lambda m, args: bn_input_dtypes.add(str(args[0].dtype)))
    losses = []
    for _ in range(15):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    plan = wrap_info(model).plan
    return {
        "losses": losses,
        "bn_input_dtypes": sorted(bn_input_dtypes),
        "bn_param_dtype": str(bn.weight.dtype),
        "fp32_units": [u.fqn for u in plan if u.reason == "keep_fp32"] if strategy != "ddp" else [],
    }


def frozen_grads(strategy: str) -> dict:
    torch.manual_seed(0)
    model = wrap(
        LoRALM(d=16, n_layers=2, vocab_size=CFG.vocab_size), ParallelConfig(strategy=strategy)
    )
    x, y = random_lm_batches(CFG, 1, 4, seed=dist.get_rank())[0]
    model(x, y).backward()
    frozen_with_grad, trainable_without = [], []
    for name, p in unwrap(model).named_parameters():
        if not p.requires_grad and p.grad is not None:
            frozen_with_grad.append(name)
        if p.requires_grad and p.grad is None:
            trainable_without.append(name)
    return {"frozen_with_grad": frozen_with_grad, "trainable_without_grad": trainable_without}


def tied_state_dict(policy) -> dict:
    torch.manual_seed(0)
    model = wrap(GPT(CFG), ParallelConfig(auto_wrap_policy=policy))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(*random_lm_batches(CFG, 1, 4, seed=dist.get_rank())[0]).backward()
    opt.step()
    sd = model.state_dict()
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}
    return {
        "keys": sorted(k for k in sd if k in ("tok_emb.weight", "head.weight")),
        "identical": torch.equal(full["tok_emb.weight"], full["head.weight"]),
        "moved": not torch.equal(full["tok_emb.weight"], GPT(CFG).tok_emb.weight),
    }


def ignored_params() -> dict:
    torch.manual_seed(0)
    model = wrap(GPT(CFG), ParallelConfig(ignored_modules=["re:pos_emb"]))
    model(*random_lm_batches(CFG, 1, 4, seed=dist.get_rank())[0]).backward()
    return {
        "pos_emb_sharded": isinstance(model.pos_emb.weight, DTensor),
        "others_sharded": all(
            isinstance(p, DTensor)
            for n, p in model.named_parameters()
            if not n.startswith("pos_emb")
        ),
        "pos_emb_grad_local": model.pos_emb.weight.grad is not None,
    }


def merged_fp32_unit_dtype() -> str:
    """The dtype the tied head computes in when its merged unit holds an fp32 embedding."""
    seen = []
    config = ParallelConfig(mixed_precision="bf16", keep_fp32=["Embedding"])
    model = wrap(GPT(CFG), config)
    model.head.register_forward_hook(lambda m, args, out: seen.append(str(m.weight.dtype)))
    model(random_lm_batches(CFG, 1, 2)[0][0])
    return seen[0]


def cross_unit_ties() -> list[float]:
    """Two optimizer steps under full_shard with units that split BERT-style ties."""
    torch.manual_seed(0)
    model = wrap(
        CrossTied(CFG.vocab_size), ParallelConfig(auto_wrap_policy={Embeddings, nn.Linear})
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in random_lm_batches(CFG, 2, 4, seed=dist.get_rank()):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_keywords() -> dict:
    """DDP's own keywords reach DistributedDataParallel (before, only two were passed)."""
    model = wrap(
        GPT(CFG),
        ParallelConfig(
            strategy="ddp", broadcast_buffers=False, gradient_as_bucket_view=True, static_graph=True
        ),
    )
    return {
        "broadcast_buffers": model.broadcast_buffers,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "static_graph": model.static_graph,
    }


def _dtype(value) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def applied(build, config: ParallelConfig) -> dict:
    """What wrap planned and what it actually applied, read back from torch's own objects:
    every FSDPModule with the mixed-precision policy its fully_shard call got, and DDP's
    communication hooks. A wrap that raises is reported, not raised, so one broken case
    fails its own test instead of the whole group."""
    torch.manual_seed(0)
    try:
        model = wrap(build(), config)
    except (RuntimeError, TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    plan = wrap_info(model).plan
    inner = unwrap(model)
    policies = {}
    for fqn, module in inner.named_modules():
        if isinstance(module, FSDPModule):
            mp = module._get_fsdp_state()._mp_policy
            policies[fqn] = tuple(
                _dtype(d) for d in (mp.param_dtype, mp.reduce_dtype, mp.output_dtype)
            )
    return {
        "units": [(u.fqn, list(u.modules), u.compute_dtype, u.reason) for u in plan],
        "policies": policies,
        "ddp_hooks": len(getattr(model, "_comm_hooks", [])),
        "sharded_params": sorted(n for n, p in inner.named_parameters() if isinstance(p, DTensor)),
        "all_params": sorted(n for n, _ in inner.named_parameters()),
    }


APPLIED = {
    "gpt_fp32_auto": (lambda: GPT(CFG), {}),
    "gpt_bf16_blocks": (lambda: GPT(CFG), {"mixed_precision": "bf16", "auto_wrap_policy": {Block}}),
    "gpt_bf16_zero2": (
        lambda: GPT(CFG),
        {"strategy": "shard_grad_op", "mixed_precision": "bf16"},
    ),
    "cnn_bf16": (lambda: ConvNet(channels=8, num_classes=2), {"mixed_precision": "bf16"}),
    "ddp_fp32": (lambda: GPT(CFG), {"strategy": "ddp"}),
    "ddp_bf16": (lambda: GPT(CFG), {"strategy": "ddp", "mixed_precision": "bf16"}),
    # The positive control for the hook check: a low-precision reduction asked for
    # explicitly (fp16: torch's bf16 compress hook needs CUDA).
    "ddp_fp16_reduce": (
        lambda: GPT(CFG),
        {
            "strategy": "ddp",
            "mixed_precision": {"param_dtype": torch.float16, "reduce_dtype": torch.float16},
        },
    ),
}


def all_cases() -> dict:
    # The applied wrap is read first and kept when a later case crashes: a broken policy
    # then fails its own assertion, not only a crash somewhere in training.
    out: dict = {"applied": {k: applied(b, ParallelConfig(**kw)) for k, (b, kw) in APPLIED.items()}}
    try:
        out.update(
            merged_fp32=merged_fp32_unit_dtype(),
            cnn={s: cnn_bf16(s) for s in ("ddp", "full_shard", "shard_grad_op")},
            frozen={s: frozen_grads(s) for s in STRATEGIES},
            tied={n: tied_state_dict(p) for n, p in (("auto", "auto"), ("merged", {nn.Embedding}))},
            ignored=ignored_params(),
            cross_tied=cross_unit_ties(),
            ddp_keywords=ddp_keywords(),
        )
    except Exception as exc:  # every rank runs the same cases, so every rank stops here
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(all_cases, 2, timeout_s=240)


@pytest.mark.parametrize("strategy", ["ddp", "full_shard", "shard_grad_op"])
def test_cnn_with_batchnorm_trains_under_bf16(results, strategy):
    for rank in range(2):
        r = results[rank]["cnn"][strategy]
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["losses"][-1] < 0.6 * r["losses"][0], r["losses"]
        assert r["bn_param_dtype"] == "torch.float32"  # stored in fp32 either way
    if strategy == "ddp":
        # Under DDP, autocast keeps batch_norm in fp32 itself; there are no units.
        assert results[0]["cnn"][strategy]["fp32_units"] == []
    else:
        r = results[0]["cnn"][strategy]
        assert r["fp32_units"] == ["features.1", "features.4"]
        assert r["bn_input_dtypes"] == ["torch.float32"]  # the fp32 unit cast its input


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters_get_no_gradients(results, strategy):
    for rank in range(2):
        r = results[rank]["frozen"][strategy]
        assert r == {"frozen_with_grad": [], "trainable_without_grad": []}, (rank, r)


@pytest.mark.parametrize("case", ["auto", "merged"])
def test_tied_weights_train_and_save_both_keys(results, case):
    for rank in range(2):
        r = results[rank]["tied"][case]
        assert r == {"keys": ["head.weight", "tok_emb.weight"], "identical": True, "moved": True}


def test_ignored_params_stay_unsharded(results):
    for rank in range(2):
        assert results[rank]["ignored"] == {
            "pos_emb_sharded": False,
            "others_sharded": True,
            "pos_emb_grad_local": True,
        }


def test_merged_fp32_unit_computes_in_fp32(results):
    assert [r["merged_fp32"] for r in results] == ["torch.float32", "torch.float32"]


def test_ties_across_unit_boundaries_train(results):
    # Before the planner merged across the tree, the first forward raised "shared with a
    # parameter already managed by another FSDP group".
    for rank in range(2):
        losses = results[rank]["cross_tied"]
        assert len(losses) == 2 and losses[1] < losses[0], losses


def test_ddp_keywords_pass_through(results):
    for rank in range(2):
        assert results[rank]["ddp_keywords"] == {
            "broadcast_buffers": False,
            "gradient_as_bucket_view": True,
            "static_graph": True,
        }


@pytest.mark.parametrize("case", [k for k in APPLIED if not k.startswith("ddp")])
def test_applied_units_and_policies_equal_the_plan(results, case):
    """One fully_shard per planned unit, each with the planned policy: compute in the
    planned dtype (fp32 for keep_fp32 units), reduce in fp32, and every parameter sharded."""
    mixed = "mixed_precision" in APPLIED[case][1]
    for rank in range(2):
        got = results[rank]["applied"][case]
        assert "error" not in got, got
        planned = {m: (fqn, dtype) for fqn, mods, dtype, _ in got["units"] for m in mods}
        assert set(got["policies"]) == set(planned), (rank, got["policies"], got["units"])
        assert len(got["units"]) > 2  # blocks and the root, not the root alone
        for module, (unit, compute) in planned.items():
            param, reduce, output = got["policies"][module]
            if not mixed:
                assert (param, reduce, output) == (None, None, None), (unit, param, reduce)
            elif compute == "float32":  # keep_fp32: fp32 inside, bf16 to the next layer
                assert (param, reduce, output) == ("float32", "float32", "bfloat16"), unit
            else:
                assert (param, reduce, output) == ("bfloat16", "float32", None), unit
        assert got["sharded_params"] == got["all_params"]


def test_applied_fp32_units_are_the_batchnorms(results):
    units = results[0]["applied"]["cnn_bf16"]["units"]
    assert [u[0] for u in units if u[3] == "keep_fp32"] == ["features.1", "features.4"]
    assert all(u[2] == "float32" for u in units if u[3] == "keep_fp32")


@pytest.mark.parametrize(
    ("case", "hooks"), [("ddp_fp32", 0), ("ddp_bf16", 0), ("ddp_fp16_reduce", 1)]
)
def test_ddp_compresses_gradients_only_when_asked(results, case, hooks):
    # bf16 compute still reduces in fp32: no compress hook unless reduce_dtype says so.
    for rank in range(2):
        got = results[rank]["applied"][case]
        assert "error" not in got, got
        assert got["ddp_hooks"] == hooks, (case, rank)
        assert got["policies"] == {} and got["sharded_params"] == []
