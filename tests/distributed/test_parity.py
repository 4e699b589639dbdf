"""Parity: every strategy trains the same model as one process on the same global batch.

A small GPT (token embedding tied to the output head, LayerNorm, attention, MLP) is
trained 5 AdamW steps; each distributed rank sees its slice of every global batch. All
cases of one world size run inside one spawned process group to keep the suite fast;
the comparison happens here in the parent, against a reference trained in this process.

The negative controls show the check can fail. Two "obvious" wrong setups cannot be
caught by any loss/parameter comparison and are deliberately not used: every rank fed
the *whole* batch (with a mean loss, the averaged gradient is exactly the whole-batch
gradient) and gradients summed instead of averaged under AdamW (Adam is invariant to a
constant gradient scale, up to eps). The latter is shown with SGD instead.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, ShardingStrategy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardwise import STRATEGIES, ParallelConfig, unwrap, wrap
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, Block, GPTConfig, LoRALM, random_lm_batches
from shardwise.testing.parity import (
    ParityError,
    compare_trajectories,
    split_batch,
    train_distributed,
    train_reference,
)

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, GLOBAL_BATCH = 5, 8
FP32_RTOL = 1e-5
# bf16 case: one batch repeated at lr 1e-2, so the loss really falls (4.17 -> 3.54). It is
# compared with the same precision in one process (the same config at world size 1), at
# two bf16 roundings (2 x 2^-9): each rank's bf16 matmuls over half the batch round
# differently from one process's over the whole (measured: 7.9e-4 ddp, 2.0e-4 full_shard).
# Against fp32 the losses are clearly apart (> 1e-4: the compute really ran in bf16). The
# loss cannot tell an fp32 gradient reduction from a bf16 one (both ~1e-3 here); the
# applied policy is read back in test_wrap_models.py instead.
BF16_RTOL = 2 * 2**-9
BF16_MIN_DIFF = 1e-4

build = functools.partial(GPT, CFG)
build_lora = functools.partial(LoRALM, d=16, n_layers=2, vocab_size=CFG.vocab_size)
BLOCK_PARAMS = sum(p.numel() for p in GPT(CFG).blocks[0].parameters())
sgd = functools.partial(torch.optim.SGD, lr=0.5)
fast_adamw = functools.partial(torch.optim.AdamW, lr=1e-2)


class ScaledGPT(GPT):
    """A 0-dim parameter, as CLIP's logit_scale: fully_shard cannot shard it."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, idx, targets=None):
        logits = super().forward(idx) * self.temperature  # CLIP scales its logits so
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_rank_dependent() -> GPT:
    """Each rank initialises differently (rank 0 like the reference); only
    sync_module_states makes them agree."""
    torch.manual_seed(1000 * dist.get_rank())
    return GPT(CFG)


def same_slice_everywhere(batch, rank, world):
    """Wrong: every rank trains on rank 0's slice, so half the data is never seen."""
    return split_batch(batch, 0, world)


def sum_gradients(model) -> None:
    """Wrong: FSDP2 sums gradients across ranks instead of averaging them.

    Gloo has no PREMUL_SUM, so the divide factor only works with sum-only reductions.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _wrap_error_cases() -> dict[str, str]:
    """Bad input that only shows up in a running job; runs on every rank, no hangs."""
    ddp_model = DistributedDataParallel(GPT(CFG))
    partly = GPT(CFG)
    fully_shard(partly.blocks[0])
    world = dist.get_world_size()
    other = dist.get_rank() + 1  # a device index that is not this rank's
    return {
        "foreign_device": _error(
            lambda: wrap(GPT(CFG), ParallelConfig(strategy="ddp", device_ids=[other]))
        ),
        "mesh_not_whole_job": _error(
            lambda: wrap(GPT(CFG), ParallelConfig(device_mesh=dist.new_group([0, 1])))
        ),
        "ddp_wrapped": _error(lambda: wrap(ddp_model, ParallelConfig())),
        "partly_sharded": _error(lambda: wrap(partly, ParallelConfig())),
        "bad_mesh": _error(
            lambda: (
                wrap(GPT(CFG), ParallelConfig(strategy="hybrid_shard", dp_shard=3))
                if world == 4
                else wrap(GPT(CFG), ParallelConfig(strategy="hybrid_shard"))
            )
        ),
    }


def _bf16_case(strategy, data, force_wrap=False):
    """bf16 trajectory plus the dtype the output head actually computed in."""
    seen = []

    def record(model):
        head = unwrap(model).head
        head.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))

    cfg = ParallelConfig(
        strategy=strategy,
        auto_wrap_policy={Block},
        mixed_precision="bf16",
        force_wrap=force_wrap,
    )
    traj = train_distributed(build, cfg, data, optimizer=fast_adamw, after_wrap=record)
    return traj, sorted({str(d) for d in seen})


def world2_cases(data):
    block = {Block}
    good = {
        "ddp": ParallelConfig(strategy="ddp"),
        "no_shard": ParallelConfig(strategy="no_shard", auto_wrap_policy=block),
        "shard_grad_op": ParallelConfig(strategy="shard_grad_op", auto_wrap_policy=block),
        "full_shard": ParallelConfig(strategy="full_shard", auto_wrap_policy=block),
        "full_shard_root_only": ParallelConfig(strategy="full_shard"),
        "fsdp1_enum": ParallelConfig(
            strategy=ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=block
        ),
        "cpu_offload": ParallelConfig(auto_wrap_policy=block, cpu_offload=True),
        "prefetch": ParallelConfig(
            auto_wrap_policy=block, backward_prefetch=2, forward_prefetch=True
        ),
        "no_reshard_override": ParallelConfig(auto_wrap_policy=block, reshard_after_forward=False),
        # The planner's policies (the default is auto) and its special units.
        "auto": ParallelConfig(),
        "size": ParallelConfig(auto_wrap_policy="size", min_num_params=BLOCK_PARAMS),
        "tied_merged_unit": ParallelConfig(auto_wrap_policy={nn.Embedding}),
        "ac_full_shard": ParallelConfig(activation_checkpointing="full"),
        "ac_ddp": ParallelConfig(strategy="ddp", activation_checkpointing="every_2"),
        # aot_eager traces and runs the same ops (no codegen): parity holds at the fp32 bar.
        "compiled": ParallelConfig(compile="aot_eager"),
        # DDP's own keywords pass through (mmengine's MMDistributedDataParallel took them).
        "ddp_keywords": ParallelConfig(
            strategy="ddp",
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
            static_graph=True,
            bucket_cap_mb=1,
            device_ids=[dist.get_rank()],  # mmengine's Runner passes [LOCAL_RANK]
        ),
    }
    out = {name: train_distributed(build, cfg, data) for name, cfg in good.items()}
    for s in ("ddp", "no_shard", "shard_grad_op", "full_shard"):
        out[f"lora_{s}"] = train_distributed(build_lora, ParallelConfig(strategy=s), data)
    out["lora_split"] = train_distributed(build_lora, ParallelConfig(frozen_policy="split"), data)
    for s in ("ddp", "full_shard", "shard_grad_op"):
        out[f"scalar_{s}"] = train_distributed(
            ScaledGPT, ParallelConfig(strategy=s), data, optimizer=sgd
        )
    for s in ("ddp", "full_shard"):
        cfg = ParallelConfig(strategy=s, auto_wrap_policy=block)
        out[f"synced_{s}"] = train_distributed(build_rank_dependent, cfg, data)
        out[f"bf16_{s}"] = _bf16_case(s, bf16_batches(data))
    fsdp = ParallelConfig(auto_wrap_policy=block)
    bad = {
        "wrong_unsynced_init": train_distributed(
            build_rank_dependent,
            ParallelConfig(auto_wrap_policy=block, sync_module_states=False),
            data,
        ),
        "wrong_same_slice": train_distributed(build, fsdp, data, shard_batch=same_slice_everywhere),
        "sgd_averaged": train_distributed(build, fsdp, data, optimizer=sgd),
        # Wrong: the scalar left unmanaged (ignored), so each rank keeps its own gradient.
        "wrong_scalar_sgd_unsynced": train_distributed(
            ScaledGPT, ParallelConfig(ignored_params=["temperature"]), data, optimizer=sgd
        ),
        "wrong_sgd_summed": train_distributed(
            build, fsdp, data, optimizer=sgd, after_wrap=sum_gradients
        ),
    }
    return out, bad, _wrap_error_cases()


def world4_cases(data):
    block = {Block}
    good = {s: ParallelConfig(strategy=s, auto_wrap_policy=block) for s in STRATEGIES}
    good["hybrid_fsdp1_name"] = ParallelConfig(
        strategy="HYBRID_SHARD", dp_shard=2, auto_wrap_policy=block
    )
    good["hybrid_offload"] = ParallelConfig(
        strategy="hybrid_shard", auto_wrap_policy=block, cpu_offload=True
    )
    good["hybrid_auto"] = ParallelConfig(strategy="hybrid_shard")
    good["hybrid_size"] = ParallelConfig(
        strategy="hybrid_shard_zero2", auto_wrap_policy="size", min_num_params=BLOCK_PARAMS
    )
    # A user's own mesh, and FSDP1's process groups as the trainer mixin passes them.
    good["user_mesh_2d"] = ParallelConfig(
        strategy="hybrid_shard",
        device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
        auto_wrap_policy=block,
    )
    good["user_mesh_1d"] = ParallelConfig(
        device_mesh=init_device_mesh("cpu", (4,)), auto_wrap_policy=block
    )
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes all
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rank = dist.get_rank()
    good["mixin_process_groups"] = ParallelConfig(
        use_fsdp=True,
        sharding_strategy="ShardingStrategy.HYBRID_SHARD",
        process_group=(shard_groups[rank // 2], replicate_groups[rank % 2]),
        auto_wrap_policy=block,
    )
    good["ddp_process_group"] = ParallelConfig(strategy="ddp", process_group=dist.group.WORLD)
    out = {name: train_distributed(build, cfg, data) for name, cfg in good.items()}
    for s in ("hybrid_shard", "hybrid_shard_zero2"):
        out[f"lora_{s}"] = train_distributed(build_lora, ParallelConfig(strategy=s), data)
    out["scalar_hybrid_shard"] = train_distributed(
        ScaledGPT, ParallelConfig(strategy="hybrid_shard"), data, optimizer=sgd
    )
    hybrid = ParallelConfig(strategy="hybrid_shard", auto_wrap_policy=block)
    bad = {
        "wrong_hybrid_same_slice": train_distributed(
            build, hybrid, data, shard_batch=same_slice_everywhere
        )
    }
    return out, bad, _wrap_error_cases()


def world1_bf16_cases(data):
    """The bf16 references: each strategy's own precision handling in one process."""
    return {s: _bf16_case(s, bf16_batches(data), force_wrap=True) for s in ("ddp", "full_shard")}


def bf16_batches(data):
    return [data[0]] * STEPS


@pytest.fixture(scope="module")
def data():
    return random_lm_batches(CFG, STEPS, GLOBAL_BATCH, seed=1)


@pytest.fixture(scope="module")
def reference(data):
    return train_reference(build, data)


@pytest.fixture(scope="module")
def world2(data):
    return run_distributed(world2_cases, 2, args=(data,), timeout_s=240)


@pytest.fixture(scope="module")
def world1_bf16(data):
    return run_distributed(world1_bf16_cases, 1, args=(data,), timeout_s=120)[0]


@pytest.fixture(scope="module")
def world4(data):
    return run_distributed(world4_cases, 4, args=(data,), timeout_s=300)


W2_GOOD = [
    "ddp", "no_shard", "shard_grad_op", "full_shard", "full_shard_root_only", "fsdp1_enum",
    "cpu_offload", "prefetch", "no_reshard_override", "synced_ddp", "synced_full_shard",
    "auto", "size", "tied_merged_unit", "ac_full_shard", "ac_ddp", "compiled", "ddp_keywords",
]  # fmt: skip
LORA_W2 = ["lora_ddp", "lora_no_shard", "lora_shard_grad_op", "lora_full_shard", "lora_split"]
LORA_W4 = ["lora_hybrid_shard", "lora_hybrid_shard_zero2"]
W4_GOOD = [
    "ddp", "no_shard", "shard_grad_op", "full_shard", "hybrid_shard", "hybrid_shard_zero2",
    "hybrid_fsdp1_name", "hybrid_offload", "hybrid_auto", "hybrid_size", "user_mesh_2d",
    "user_mesh_1d", "mixin_process_groups", "ddp_process_group",
]  # fmt: skip


@pytest.mark.parametrize("case", W2_GOOD)
def test_world2_matches_single_process(world2, reference, case):
    for rank, (good, _, _) in enumerate(world2):
        report = compare_trajectories(
            reference, good[case], rtol=FP32_RTOL, label=f"{case} rank {rank}"
        )
        assert report.max_loss_rel <= FP32_RTOL and report.max_param_rel <= FP32_RTOL


@pytest.mark.parametrize("case", W4_GOOD)
def test_world4_matches_single_process(world4, reference, case):
    for rank, (good, _, _) in enumerate(world4):
        compare_trajectories(reference, good[case], rtol=FP32_RTOL, label=f"{case} rank {rank}")


@pytest.fixture(scope="module")
def lora_reference(data):
    return train_reference(build_lora, data)


@pytest.mark.parametrize("case", LORA_W2 + LORA_W4)
def test_lora_frozen_base_matches_single_process(world2, world4, lora_reference, case):
    results = world4 if case in LORA_W4 else world2
    for rank, (good, _, _) in enumerate(results):
        compare_trajectories(
            lora_reference, good[case], rtol=FP32_RTOL, label=f"{case} rank {rank}"
        )
    # The frozen base really stayed frozen.
    torch.manual_seed(0)
    initial = build_lora()
    got = results[0][0][case].params
    assert torch.equal(got["emb.weight"], initial.emb.weight)
    assert torch.equal(got["blocks.0.fc.base.weight"], initial.blocks[0].fc.base.weight)


@pytest.mark.parametrize(
    "case", ["scalar_ddp", "scalar_full_shard", "scalar_shard_grad_op", "scalar_hybrid_shard"]
)
def test_scalar_parameters_stay_whole_and_train_like_one_process(world2, world4, data, case):
    # Before: fully_shard refused the model ("doesn't support scalar parameters").
    # SGD, not AdamW: Adam's normalised step would hide a gradient left unaveraged (the
    # ranks' losses are close, and its update is nearly the gradient's sign).
    results = world4 if "hybrid" in case else world2
    ref = train_reference(ScaledGPT, data, optimizer=sgd)
    assert float(ref.params["temperature"]) != 1.3  # it trains
    for rank, (good, _, _) in enumerate(results):
        compare_trajectories(ref, good[case], rtol=FP32_RTOL, label=f"{case} rank {rank}")


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_bf16_matches_one_process_in_bf16(world2, world1_bf16, data, strategy):
    traj, head_dtypes = world2[0][0][f"bf16_{strategy}"]
    ref, ref_dtypes = world1_bf16[strategy]
    assert head_dtypes == ref_dtypes == ["torch.bfloat16"]  # both computed in bf16
    assert ref.losses[-1] < ref.losses[0] - 0.5  # the loss really moves
    compare_trajectories(ref, traj, rtol=BF16_RTOL, check_params=False, label=strategy)
    # ...and bf16 is not fp32 in disguise: the fp32 run is clearly apart.
    fp32 = train_reference(build, bf16_batches(data), optimizer=fast_adamw)
    with pytest.raises(ParityError):
        compare_trajectories(fp32, traj, rtol=BF16_MIN_DIFF, check_params=False)


def test_sgd_control_passes(world2, data):
    sgd_ref = train_reference(build, data, optimizer=sgd)
    compare_trajectories(sgd_ref, world2[0][1]["sgd_averaged"], rtol=FP32_RTOL)


@pytest.mark.parametrize(
    ("world", "case", "match"),
    [
        (2, "wrong_unsynced_init", "loss diverges at step 0"),
        (2, "wrong_same_slice", "loss diverges at step 0"),
        (2, "wrong_sgd_summed", "loss diverges at step 1"),
        (2, "wrong_scalar_sgd_unsynced", "diverges"),
        (4, "wrong_hybrid_same_slice", "loss diverges at step 0"),
    ],
)
def test_parity_check_catches_wrong_setups(world2, world4, reference, data, world, case, match):
    results = world2 if world == 2 else world4
    builder = ScaledGPT if "scalar" in case else build
    ref = train_reference(builder, data, optimizer=sgd) if "sgd" in case else reference
    with pytest.raises(ParityError, match=match):
        compare_trajectories(ref, results[0][1][case], rtol=FP32_RTOL, label=case)


@pytest.mark.parametrize(
    ("world", "case", "match"),
    [
        (
            2,
            "ddp_wrapped",
            r"ValueError: shardwise\.wrap: the model \(DistributedDataParallel\) is already wrapped by DistributedDataParallel\. .*pass the plain, unwrapped model",
        ),
        (
            2,
            "partly_sharded",
            r"ValueError: shardwise\.wrap: submodule 'blocks\.0' is already wrapped by fully_shard \(FSDP2\)",
        ),
        (4, "partly_sharded", r"submodule 'blocks\.0' is already wrapped"),
        (
            2,
            "foreign_device",
            r"ValueError: ParallelConfig: device_ids=\[\d\] on rank \d, whose device is cpu \(LOCAL_RANK \d\)\. shardwise places each rank on its own local device",
        ),
        (
            4,
            "mesh_not_whole_job",
            r"ValueError: ParallelConfig\.device_mesh spans 2 rank\(s\) but the job has 4\. shardwise treats every rank as a data-parallel replica|this rank is not a member of the given process group",
        ),
        (
            2,
            "bad_mesh",
            r"ValueError: ParallelConfig\.strategy='hybrid_shard' needs a 2-D mesh .* world size 2 has no such split",
        ),
        (
            4,
            "bad_mesh",
            r"ValueError: ParallelConfig\.dp_shard=3 does not divide the world size 4\. Choose a divisor of 4 \(2\) or -1",
        ),
    ],
)
def test_bad_input_in_a_running_job(world2, world4, world, case, match):
    results = world2 if world == 2 else world4
    for _, _, errors in results:  # every rank raises the same clear error, none hangs
        assert errors[case] != "no error"
        assert re.search(match, errors[case]), errors[case]
