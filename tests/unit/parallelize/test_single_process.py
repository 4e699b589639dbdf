"""World size 1: init_distributed without a launcher, and wrap returning the model unwrapped."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise import ParallelConfig, init_distributed, shutdown, wrap, wrap_info
from shardwise.testing.models import GPT, Block, GPTConfig


def test_init_without_launcher_is_world_one_and_idempotent():
    info = init_distributed(timeout_s=30)
    assert (info.rank, info.world_size, info.backend, info.device.type) == (0, 1, "gloo", "cpu")
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert init_distributed() is info
    shutdown()
    shutdown()  # idempotent
    assert not dist.is_initialized()


def test_init_rejects_bad_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not an integer"):
        init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        init_distributed()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        ValueError,
        match=r"WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT is not set\. Launch with torchrun",
    ):
        init_distributed()


def test_init_rejects_non_positive_timeout():
    with pytest.raises(ValueError, match=r"timeout_s=0\) must be > 0"):
        init_distributed(timeout_s=0)


def test_world_one_returns_model_unwrapped():
    model = GPT(GPTConfig())
    out = wrap(model, ParallelConfig(strategy="full_shard", auto_wrap_policy={Block}))
    assert out is model and type(out) is GPT
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in out.parameters())
    info = wrap_info(out)
    assert info is not None and not info.wrapped and "unwrapped at world size 1" in str(info)


def test_world_one_still_applies_precision():
    model = wrap(nn.Sequential(nn.Linear(4, 4)), ParallelConfig(mixed_precision="bf16"))
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    assert model[0].weight.dtype == torch.float32


def test_force_wrap_applies_fsdp_at_world_one():
    init_distributed(timeout_s=30)
    model = wrap(GPT(GPTConfig()), ParallelConfig(force_wrap=True, auto_wrap_policy={Block}))
    assert isinstance(model, torch.distributed.fsdp.FSDPModule)
    loss = model(*shardwise.testing.models.random_lm_batches(GPTConfig(), 1, 2)[0])
    loss.backward()
    assert wrap_info(model).mesh_spec.dp_shard == 1


def test_force_wrap_without_process_group():
    with pytest.raises(
        RuntimeError,
        match=r"force_wrap=True needs a process group .* Call shardwise\.init_distributed\(\) first",
    ):
        wrap(nn.Linear(2, 2), ParallelConfig(force_wrap=True))


def test_world_size_in_env_but_no_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError,
        match=r"WORLD_SIZE=2 is set in the environment but no process group is initialised.*Call shardwise\.init_distributed\(\) before shardwise\.wrap\(\)",
    ):
        wrap(nn.Linear(2, 2), ParallelConfig())


def test_wrap_rejects_wrong_types():
    with pytest.raises(TypeError, match=r"expects a ParallelConfig, got dict"):
        wrap(nn.Linear(2, 2), {"strategy": "ddp"})
    with pytest.raises(TypeError, match=r"expects an nn.Module, got str"):
        wrap("model", ParallelConfig())


def test_activation_checkpointing_at_world_one_changes_memory_not_math():
    from shardwise.parallelize.recompute import is_checkpointed

    batch = shardwise.testing.models.random_lm_batches(GPTConfig(), 1, 4)[0]
    grads = {}
    for ac in ("none", "full"):
        torch.manual_seed(0)
        model = wrap(GPT(GPTConfig()), ParallelConfig(activation_checkpointing=ac))
        assert [is_checkpointed(b) for b in model.blocks] == [ac == "full"] * 2
        model(*batch).backward()
        grads[ac] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert "blocks.0.attn.qkv.weight" in dict(model.named_parameters())  # names kept
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], g, rtol=0, atol=0)


@pytest.mark.heavy
def test_wrap_frees_each_units_originals_as_soon_as_it_is_sharded(monkeypatch):
    """Issue 26: wrap kept every original parameter alive until it returned, so each rank
    held the full model and all its shards at once (1.53x the model; bench/wrap_memory.py)."""
    import gc
    import weakref

    import shardwise.parallelize.fsdp as fsdp

    init_distributed(timeout_s=30)
    try:
        model = GPT(GPTConfig())
        originals = {id(m): [weakref.ref(p) for p in m.parameters()] for m in model.blocks}
        alive_after: list[int] = []
        real = fsdp.fully_shard

        def watching(module, **kwargs):
            out = real(module, **kwargs)
            gc.collect()
            if id(module) in originals:  # a block: its own originals must be gone now
                alive_after.append(sum(r() is not None for r in originals[id(module)]))
            return out

        monkeypatch.setattr(fsdp, "fully_shard", watching)
        wrap(model, ParallelConfig(auto_wrap_policy={Block}, force_wrap=True))
        assert len(alive_after) == len(model.blocks)
        assert alive_after == [0] * len(model.blocks)
    finally:
        shutdown()


def test_the_engine_keeps_no_outputs_after_a_step():
    """Issue 26: `last_outputs` kept the last step's outputs (a language model's B x T x V
    logits) alive through the next forward and backward."""
    import gc
    import weakref

    from shardwise import Engine

    model = GPT(GPTConfig())
    seen: list[weakref.ref] = []
    model.register_forward_hook(lambda m, args, out: seen.append(weakref.ref(out)))
    engine = Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3))
    engine.train_step(shardwise.testing.models.random_lm_batches(GPTConfig(), 1, 2)[0])
    gc.collect()
    assert len(seen) == 1 and seen[0]() is None
