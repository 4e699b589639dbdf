"""Decisions a GPU job depends on, tested on CPU with the device counts injected: the
backend a CUDA job asks for, each rank's GPU (and the duplicate-GPU refusal), the device
of a group someone else made, the local world size when the launcher did not say, and
when the watchdog's gloo group is made."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from shardwise.distributed.process_group import (
    _gpu_index,
    _read_env,
    default_backend,
    device_for_group,
    serves_cpu,
    wants_monitor,
)


def test_a_cuda_job_asks_for_gloo_beside_nccl():
    # A nccl-only group refuses CPU tensors, which CPU offload and exports reduce.
    assert default_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert default_backend("cpu") == "gloo"
    assert serves_cpu("cpu:gloo,cuda:nccl") and serves_cpu("gloo") and serves_cpu("undefined")
    assert not serves_cpu("nccl") and not serves_cpu("cuda:gloo")


def test_each_rank_gets_its_own_gpu():
    assert [_gpu_index(r, 8, 8) for r in range(8)] == list(range(8))
    assert _gpu_index(0, 1, 1) == 0  # one process, one GPU
    assert _gpu_index(3, 1, 4, per_task=True) == 0  # srun --gpus-per-task=1
    with pytest.raises(
        ValueError, match=r"Local rank 2 has no GPU of its own: this process sees 2"
    ):
        _gpu_index(2, 2, 4)


def test_two_ranks_on_one_gpu_are_refused_naming_nproc():
    # Before: every rank got cuda:0 and NCCL stopped at init ("Duplicate GPU detected").
    with pytest.raises(
        ValueError, match=r"2 processes run on this node but it has 1 GPU visible.*--nproc 1 here"
    ):
        _gpu_index(1, 1, 2)


@pytest.mark.parametrize(
    ("backend", "env", "gpus", "current", "want"),
    [
        ("nccl", {"LOCAL_RANK": "3"}, 8, 0, "cuda:3"),
        ("cpu:gloo,cuda:nccl", {"LOCAL_RANK": "1"}, 2, 0, "cuda:1"),
        # a bare init_process_group(): torch pairs gloo with nccl, get_backend says 'undefined'
        ("undefined", {"LOCAL_RANK": "1"}, 2, 0, "cuda:1"),
        ("undefined", {}, 2, 1, "cuda:1"),  # no LOCAL_RANK: the device the user set
        ("undefined", {}, 0, 0, "cpu"),
        ("gloo", {"LOCAL_RANK": "1"}, 2, 0, "cpu"),
    ],
)
def test_the_device_of_a_group_made_elsewhere(backend, env, gpus, current, want):
    # Before: CUDA only when get_backend() == 'nccl', at current_device() (0 unless set).
    assert device_for_group(backend, env, gpus, current) == torch.device(want)


@pytest.mark.parametrize(
    ("env", "bound", "want"),
    [
        ({"LOCAL_RANK": "0"}, "cuda:1", "cuda:1"),  # Lightning's devices=[1, 3], rank 0
        ({"LOCAL_RANK": "1"}, "cuda:3", "cuda:3"),  # and rank 1
        ({"LOCAL_RANK": "1"}, None, "cuda:1"),  # a group bound to no device: LOCAL_RANK
        ({"LOCAL_RANK": "1"}, "cpu", "cuda:1"),
    ],
)
def test_a_group_bound_to_a_gpu_puts_the_rank_there(env, bound, want):
    """Issue 47, item 1: Lightning and Fabric bind each rank's group to its root device
    (init_process_group's device_id); shardwise took LOCAL_RANK's GPU, and the first
    broadcast in wrap failed ('Tensor found on device cuda:0 but backend constrained to
    cuda:1')."""
    device = None if bound is None else torch.device(bound)
    got = device_for_group("cpu:gloo,cuda:nccl", env, 4, 0, device)
    assert got == torch.device(want)


def test_get_dist_info_reads_the_device_the_world_group_is_bound_to():
    import torch.distributed as dist

    from shardwise.distributed import process_group

    with (  # patched within the test: the fixture's shutdown() runs after it
        mock.patch.object(process_group, "_info", None),
        mock.patch.object(dist, "is_initialized", lambda: True),
        mock.patch.object(dist, "get_world_size", lambda group=None: 2),
        mock.patch.object(dist, "get_rank", lambda group=None: 0),
        mock.patch.object(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl"),
        mock.patch.object(process_group, "_bound_device", lambda: torch.device("cuda", 1)),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 2),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        mock.patch.dict("os.environ", {"LOCAL_RANK": "0"}),
    ):
        assert process_group.get_dist_info().device == torch.device("cuda", 1)


def test_local_world_size_unknown_when_the_launcher_does_not_say():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "24",
        "LOCAL_RANK": "5",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    assert _read_env(env).local_world_size is None  # before: 24, the whole world
    assert _read_env({**env, "LOCAL_WORLD_SIZE": "8"}).local_world_size == 8
    assert _read_env({}).local_world_size == 1


def test_the_watchdog_group_only_for_gloo_jobs():
    # On nccl torch's own watchdog aborts first; a gloo mesh across nodes would need
    # GLOO_SOCKET_IFNAME for nothing.
    assert wants_monitor("gloo", 2)
    assert not wants_monitor("gloo", 1)
    assert not wants_monitor("cpu:gloo,cuda:nccl", 16)
    assert not wants_monitor("nccl", 16)


def test_init_distributed_adopts_the_gpu_a_host_bound_its_group_to():
    """Called after Lightning or Fabric made the group, init_distributed keeps the rank on
    the host's root device (it set LOCAL_RANK's GPU current, under the host's feet)."""
    import torch.distributed as dist

    from shardwise.distributed import process_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    chosen: list[torch.device] = []
    with (
        mock.patch.object(process_group, "_info", None),
        mock.patch.object(process_group, "_bound_device", lambda: torch.device("cuda", 1)),
        mock.patch.object(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl"),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 2),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        mock.patch.object(torch.cuda, "set_device", chosen.append),
        mock.patch.dict("os.environ", {"LOCAL_RANK": "0"}),
    ):
        info = process_group.init_distributed()
    assert info.device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
