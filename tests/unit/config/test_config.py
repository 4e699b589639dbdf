"""ParallelConfig: accepted spellings, normalisation, and every user-input error."""

import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, CPUOffloadPolicy, ShardingStrategy

from shardwise import ParallelConfig
from shardwise.config import STRATEGIES


@pytest.mark.parametrize("name", STRATEGIES)
def test_canonical_names_accepted(name):
    assert ParallelConfig(strategy=name).strategy == name


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (ShardingStrategy.FULL_SHARD, "full_shard"),
        (ShardingStrategy.SHARD_GRAD_OP, "shard_grad_op"),
        (ShardingStrategy.NO_SHARD, "no_shard"),
        (ShardingStrategy.HYBRID_SHARD, "hybrid_shard"),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, "hybrid_shard_zero2"),
        ("FULL_SHARD", "full_shard"),
        ("_HYBRID_SHARD_ZERO2", "hybrid_shard_zero2"),
        ("Full-Shard", "full_shard"),
        ("fsdp", "full_shard"),
        ("zero2", "shard_grad_op"),
        ("hsdp", "hybrid_shard"),
    ],
)
def test_fsdp1_names_and_aliases(given, expected):
    assert ParallelConfig(strategy=given).strategy == expected


def test_unknown_strategy_names_value_choices_and_closest():
    with pytest.raises(
        ValueError,
        match=r"strategy='full_shrad' is not a known strategy\. Did you mean 'full_shard'\?.*Choose one of \['ddp'",
    ):
        ParallelConfig(strategy="full_shrad")


def test_strategy_of_wrong_type():
    with pytest.raises(
        TypeError,
        match=r"ParallelConfig\.strategy must be a string or torch ShardingStrategy, got int",
    ):
        ParallelConfig(strategy=3)


@pytest.mark.parametrize("bad", [0, -2, -10])
def test_zero_or_negative_dp_shard(bad):
    with pytest.raises(
        ValueError,
        match=rf"ParallelConfig\.dp_shard={bad} is not a valid group size\. Use a positive number of ranks, or -1",
    ):
        ParallelConfig(dp_shard=bad)


def test_dp_shard_wrong_type():
    with pytest.raises(TypeError, match=r"ParallelConfig\.dp_shard must be an int, got '2'"):
        ParallelConfig(dp_shard="2")


def test_cpu_offload_with_ddp_is_refused_with_fix():
    with pytest.raises(
        ValueError,
        match=r"cpu_offload is set with strategy='ddp'.*Use a sharded strategy .* or set cpu_offload=False",
    ):
        ParallelConfig(strategy="ddp", cpu_offload=True)


@pytest.mark.parametrize(
    ("value", "offloads"),
    [
        (False, False),
        (None, False),
        (True, True),
        (CPUOffloadPolicy(), True),
        (CPUOffload(offload_params=True), True),
        (CPUOffload(offload_params=False), False),
    ],
)
def test_cpu_offload_forms(value, offloads):
    cfg = ParallelConfig(cpu_offload=value)
    assert (cfg.offload_policy is not None) == offloads
    if offloads:
        assert isinstance(cfg.offload_policy, CPUOffloadPolicy)


def test_cpu_offload_wrong_type():
    with pytest.raises(TypeError, match=r"cpu_offload got str \('yes'\); expected a bool"):
        ParallelConfig(cpu_offload="yes")


@pytest.mark.parametrize(
    ("value", "depth"),
    [("pre", 1), ("BACKWARD_PRE", 1), (BackwardPrefetch.BACKWARD_PRE, 1), (2, 2), (4, 4)],
)
def test_backward_prefetch_exact_mappings(value, depth, recwarn):
    assert ParallelConfig(backward_prefetch=value).backward_prefetch_depth == depth
    assert not [w for w in recwarn if "backward_prefetch" in str(w.message)]


@pytest.mark.parametrize("value", ["post", BackwardPrefetch.BACKWARD_POST, None])
def test_backward_prefetch_without_fsdp2_twin_warns(value):
    with pytest.warns(UserWarning, match="no (exact )?FSDP2 equivalent"):
        cfg = ParallelConfig(backward_prefetch=value)
    assert cfg.backward_prefetch_depth == 1


@pytest.mark.parametrize("bad", [0, -1, "sideways"])
def test_backward_prefetch_invalid(bad):
    with pytest.raises(ValueError, match=r"ParallelConfig\.backward_prefetch="):
        ParallelConfig(backward_prefetch=bad)


@pytest.mark.parametrize(("value", "depth"), [(False, 0), (True, 1), (3, 3)])
def test_forward_prefetch(value, depth):
    assert ParallelConfig(forward_prefetch=value).forward_prefetch_depth == depth


def test_forward_prefetch_negative():
    with pytest.raises(
        ValueError, match=r"forward_prefetch=-1 is not valid\. Use a bool or a depth >= 0"
    ):
        ParallelConfig(forward_prefetch=-1)


@pytest.mark.parametrize("bad", [0, -3, "yes"])
def test_reshard_after_forward_invalid(bad):
    with pytest.raises(
        ValueError, match=r"reshard_after_forward=.* is not valid\. Use True, False, None"
    ):
        ParallelConfig(reshard_after_forward=bad)


def test_bucket_cap_must_be_positive():
    with pytest.raises(ValueError, match=r"bucket_cap_mb=0 must be > 0"):
        ParallelConfig(strategy="ddp", bucket_cap_mb=0)


def test_precision_resolved_at_construction():
    cfg = ParallelConfig(mixed_precision="bf16")
    assert cfg.precision.param_dtype == torch.bfloat16
    assert cfg.precision.reduce_dtype == torch.float32


def test_defaults_are_single_cpu_friendly():
    cfg = ParallelConfig()
    assert cfg.strategy == "full_shard"
    assert cfg.offload_policy is None
    assert cfg.sync_module_states is True
    assert str(cfg.precision) == "fp32"


def test_param_init_fn_must_be_callable():
    with pytest.raises(
        ValueError, match=r"ParallelConfig\.param_init_fn='my_init' is not callable"
    ):
        ParallelConfig(param_init_fn="my_init")
