"""What wrap asks of the job, checked before any mesh or collective: CPU offload needs a
group that serves CPU tensors, hybrid sharding needs the ranks per node, and a meta-built
model under CPU offload is materialised on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise import ParallelConfig, shutdown, wrap
from shardwise.distributed import DistInfo
from shardwise.parallelize.apply import _check_job, materialize_device
from shardwise.testing.models import GPT, GPTConfig


def _info(backend: str = "gloo", local_world: int | None = 8, device: str = "cuda:0") -> DistInfo:
    return DistInfo(0, 16, 0, local_world, backend, torch.device(device), 300.0)


def test_offload_materialises_on_cpu():
    # Before: to_empty(device="cuda"), and FSDP2's lazy init then refused the parameters.
    assert materialize_device(ParallelConfig(cpu_offload=True), _info()) == torch.device("cpu")
    assert materialize_device(ParallelConfig(), _info()) == torch.device("cuda:0")


def test_offload_on_a_nccl_only_group_is_refused():
    with pytest.raises(
        ValueError,
        match=r"cpu_offload on a process group whose backend is 'nccl', which refuses CPU tensors",
    ):
        _check_job(ParallelConfig(cpu_offload=True), _info("nccl"))
    _check_job(ParallelConfig(cpu_offload=True), _info("cpu:gloo,cuda:nccl"))


def test_offload_on_a_group_without_cpu_backend_fails_clearly_on_cpu():
    """The crash itself, reproduced on CPU: a group whose only backend serves cuda."""
    shutdown()
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(1))  # what offloaded state would hit
        config = ParallelConfig(cpu_offload=True, force_wrap=True)
        with pytest.raises(ValueError, match=r"backend is 'cuda:gloo', which refuses CPU"):
            wrap(GPT(GPTConfig()), config)
    finally:
        dist.destroy_process_group()


def test_hybrid_without_ranks_per_node_is_refused():
    # Before: the local world defaulted to the whole world, and 3 nodes x 8 got shard 6.
    hybrid = ParallelConfig(strategy="hybrid_shard")
    with pytest.raises(
        ValueError,
        match=r"did not set LOCAL_WORLD_SIZE .* Set ParallelConfig\.dp_shard to the number of ranks per node",
    ):
        _check_job(hybrid, _info(local_world=None))
    _check_job(hybrid, _info(local_world=8))
    _check_job(ParallelConfig(strategy="hybrid_shard", dp_shard=8), _info(local_world=None))


def test_fp32_on_cuda_with_tf32_off_is_said_once():
    # Before: H100 fp32 matmuls ran without tensor cores and nothing said so. shardwise
    # does not switch TF32 on itself: that would change the numbers parity checks see.
    from shardwise import Precision
    from shardwise.parallelize.autocast import tf32_advice

    fp32, bf16 = Precision(), Precision(param_dtype=torch.bfloat16)
    advice = tf32_advice("cuda", fp32, "highest")
    assert advice is not None and "torch.set_float32_matmul_precision('high')" in advice
    assert "mixed_precision='bf16'" in advice
    assert tf32_advice("cuda", fp32, "high") is None  # the user chose TF32
    assert tf32_advice("cuda", bf16, "highest") is None
    assert tf32_advice("cpu", fp32, "highest") is None
