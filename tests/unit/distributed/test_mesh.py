"""Mesh resolution: degrees against the world size, inference of -1, and the errors.

A layout the job cannot take is refused with a ValueError marked as the user's setting, which a
worker of `shardwise run` shows in one line; a bad argument from shardwise's own code is not.
"""

import pytest

from shardwise.distributed import resolve_mesh
from shardwise.distributed.worker_errors import is_refusal, short_error


@pytest.mark.parametrize(
    ("strategy", "world", "replicate", "shard", "raf", "engine"),
    [
        ("ddp", 4, 4, 1, False, "ddp"),
        ("no_shard", 4, 4, 1, False, "fsdp"),
        ("shard_grad_op", 4, 1, 4, False, "fsdp"),
        ("full_shard", 4, 1, 4, True, "fsdp"),
        ("hybrid_shard", 4, 2, 2, True, "fsdp"),
        ("hybrid_shard_zero2", 4, 2, 2, False, "fsdp"),
        ("full_shard", 1, 1, 1, True, "fsdp"),
    ],
)
def test_degrees_follow_from_strategy(strategy, world, replicate, shard, raf, engine):
    spec = resolve_mesh(strategy, -1, world)
    assert (spec.dp_replicate, spec.dp_shard, spec.reshard_after_forward, spec.engine) == (
        replicate,
        shard,
        raf,
        engine,
    )
    assert spec.world_size == world


def test_hybrid_infers_shard_within_a_node():
    # 2 nodes x 8 ranks: shard inside the node, replicate across nodes.
    spec = resolve_mesh("hybrid_shard", -1, 16, local_world_size=8)
    assert (spec.dp_replicate, spec.dp_shard) == (2, 8)


def test_hybrid_on_one_node_picks_balanced_split():
    spec = resolve_mesh("hybrid_shard", -1, 8, local_world_size=8)
    assert (spec.dp_replicate, spec.dp_shard) == (2, 4)


def test_hybrid_explicit_dp_shard():
    spec = resolve_mesh("hybrid_shard", 4, 8)
    assert (spec.dp_replicate, spec.dp_shard) == (2, 4)


def test_reshard_override():
    assert (
        resolve_mesh("full_shard", -1, 2, reshard_after_forward=False).reshard_after_forward
        is False
    )
    assert (
        resolve_mesh("shard_grad_op", -1, 2, reshard_after_forward=True).reshard_after_forward
        is True
    )


def test_dp_shard_not_dividing_world():
    with pytest.raises(
        ValueError,
        match=r"ParallelConfig\.dp_shard=3 does not divide the world size 4\. Choose a divisor of 4 \(2\) or -1",
    ):
        resolve_mesh("hybrid_shard", 3, 4)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_hybrid_with_no_2d_mesh(world):
    with pytest.raises(
        ValueError,
        match=rf"needs a 2-D mesh .* world size {world} has no such split\. Use 'full_shard'",
    ):
        resolve_mesh("hybrid_shard", -1, world)


def test_hybrid_degenerate_split_refused():
    with pytest.raises(
        ValueError,
        match=r"dp_shard=4 .* gives a 1x4 mesh, which is not hybrid\. Choose dp_shard in \[2\], or use full_shard",
    ):
        resolve_mesh("hybrid_shard", 4, 4)


def test_full_shard_with_partial_dp_shard_points_to_hybrid():
    with pytest.raises(
        ValueError,
        match=r"dp_shard=2 with strategy='full_shard'.*use strategy='hybrid_shard' with dp_shard=2",
    ) as refused:
        resolve_mesh("full_shard", 2, 4)
    assert short_error(refused.value)  # the user's layout: one line under `shardwise run`
    assert is_refusal(refused.value)  # and marked: a restart would refuse it again


def test_ddp_with_dp_shard():
    with pytest.raises(
        ValueError, match=r"dp_shard=2 with strategy='ddp': this strategy replicates everything"
    ):
        resolve_mesh("ddp", 2, 4)


def test_zero_world():
    with pytest.raises(ValueError, match=r"world_size=0 must be >= 1") as internal:
        resolve_mesh("ddp", -1, 0)
    # A message shardwise wrote is shown alone (SHARDWISE_TRACEBACK=1 shows where), but only
    # a marked refusal stops --max-restarts.
    assert short_error(internal.value) and not is_refusal(internal.value)


def test_spec_prints_and_serialises():
    spec = resolve_mesh("hybrid_shard", -1, 4)
    assert "2 replica group(s) x 2 shard rank(s) = world 4" in str(spec)
    assert '"dp_shard": 2' in spec.to_json()
