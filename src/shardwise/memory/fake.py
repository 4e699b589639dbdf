"""The fake world the memory answers run in: fake storage, a fake group's DDP hook, inputs.

Owns: giving a meta-built model fake storage (`fake_materialize`, swapped in for wrap's
`materialize` while a simulation wraps), a DDP communication hook that works over the fake
process group, the buffers a real backend's collectives allocate where the fake group
allocates none (`backend_collectives`), a meta copy of a model for tracing (`meta_copy`),
and the default input, call and loss of a model (`default_input`, `call_model`,
`loss_of`), shared by the activation trace and the step simulation.

Must not: allocate real parameter memory or touch a real process group.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import shardwise.parallelize.apply as apply_module
from shardwise.distributed.mesh import MeshSpec

Backend = Literal["nccl", "gloo"]
"""The process-group backend whose collective buffers a simulation models: nccl for a GPU
job (shardwise's CUDA default, `cpu:gloo,cuda:nccl`, runs CUDA tensors on nccl), gloo for a
CPU job."""
BACKENDS: tuple[Backend, ...] = ("nccl", "gloo")

ExampleInput = Callable[[], object]
"""A function returning one rank's example batch: a tensor (the model's one argument), a
tuple of positional arguments, or a dict of keyword arguments; any object it returns is
passed on as that."""


def fake_materialize(model: nn.Module, device: torch.device, **_: Any) -> list[str]:
    """Stand-in for `shardwise.parallelize.materialize.materialize` on a fake, meta-built model.

    Gives each meta parameter and buffer fake storage on `device`; values are irrelevant to
    memory, so no initialiser runs (materialize's NaN check would need real values).
    Plain parameters are replaced in their modules (fake tensors carry weak references that
    forbid `swap_tensors`, which `to_empty` would use), shared ones once, keeping ties.
    FSDP2's DTensor parameters are swapped in place, as `to_empty` does, and FSDP2 is told
    to re-read its shards.
    """
    memo: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if isinstance(p, DTensor):
                    if id(p) not in memo:
                        new = nn.Parameter(
                            torch.empty_like(p, device=device), requires_grad=p.requires_grad
                        )
                        torch.utils.swap_tensors(p, new)
                        memo[id(p)] = p
                    continue
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device=device),
                        requires_grad=p.requires_grad,
                    )
                module._parameters[name] = memo[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                for group in _param_groups(state):
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.reset_sharded_param()
    return ["fake"]


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: torch 2.13 keeps a list (`_fsdp_param_groups`),
    earlier releases one group or None (`_fsdp_param_group`)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def local_comm_hook(compress_to: torch.dtype | None) -> Callable[..., Any]:
    """A DDP comm hook that communicates nothing (the fake group's all-reduce yields no
    tensor for DDP's reducer) but allocates what the real hook would: the bucket itself,
    plus its compressed copy under torch's bf16/fp16 compress hooks."""

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if compress_to is not None:
            buffer.copy_(buffer.to(compress_to))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    hook.__annotations__ = {}  # DDP rejects string annotations (this module's __future__)
    return hook


@contextlib.contextmanager
def fake_world_patches(
    tp_mesh: DeviceMesh | None = None,
    fake_mode: Any = None,
    experts_mesh: DeviceMesh | None = None,
) -> Iterator[list[Any]]:
    """While the simulation's own `wrap` runs: materialise meta models with fake storage
    (`shardwise.wrap` looks `materialize` up in parallelize/apply.py), and give DDP a
    communication hook that works over the fake group. Yields the DDP modules that got one.

    Under tensor parallelism `wrap` builds its (replicate, shard, tp) mesh itself, which
    cannot happen under fake tensors: `tp_mesh`, built before, is handed to it instead,
    and `wrap` then runs on meta outside `fake_mode`, which only materialising enters.
    Under expert parallelism the experts' mesh, `experts_mesh`, is handed over the same way.
    """
    hooked: list[Any] = []
    original_materialize = apply_module.materialize
    original_register = DistributedDataParallel.register_comm_hook
    original_build = MeshSpec.build
    original_build_experts = MeshSpec.build_experts

    def register(self: DistributedDataParallel, state: object, hook: Callable[..., Any]) -> None:
        compress = {
            default_hooks.bf16_compress_hook: torch.bfloat16,
            default_hooks.fp16_compress_hook: torch.float16,
        }
        if hook not in compress:
            raise NotImplementedError(
                f"simulate_step: DDP comm hook {getattr(hook, '__name__', hook)} is not "
                "simulated (only torch's bf16/fp16 compress hooks are)."
            )
        original_register(self, None, local_comm_hook(compress[hook]))
        hooked.append(self)

    def materialize_fake(model: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            return fake_materialize(model, *args, **kwargs)

    apply_module.materialize = materialize_fake
    DistributedDataParallel.register_comm_hook = register  # type: ignore[method-assign]
    if tp_mesh is not None:
        MeshSpec.build = lambda self, device_type: tp_mesh  # type: ignore[method-assign]
    if experts_mesh is not None:
        MeshSpec.build_experts = lambda self, device_type: experts_mesh  # type: ignore[method-assign]
    try:
        yield hooked
    finally:
        apply_module.materialize = original_materialize
        DistributedDataParallel.register_comm_hook = original_register  # type: ignore[method-assign]
        MeshSpec.build = original_build  # type: ignore[method-assign]
        MeshSpec.build_experts = original_build_experts  # type: ignore[method-assign]


class _ShapedGroupedMM(torch.autograd.Function):
    """torch's grouped matrix product by shape alone: what it returns and what its backward
    saves and returns, with no kernel (values are fake)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)


def _shaped_grouped_mm(
    mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    if mat_a.dim() != 2 or mat_b.dim() != 3 or args or kwargs.get("bias") is not None:
        raise NotImplementedError(
            "simulate_step: torch's grouped matrix product is simulated for (rows, in) x "
            f"(groups, in, out) with offsets only; got {tuple(mat_a.shape)} x "
            f"{tuple(mat_b.shape)}."
        )
    out: torch.Tensor = _ShapedGroupedMM.apply(mat_a, mat_b)  # type: ignore[no-untyped-call]
    dtype = kwargs.get("out_dtype")
    return out if dtype is None else out.to(dtype)


@contextlib.contextmanager
def shaped_grouped_mm() -> Iterator[None]:
    """While a simulated step runs: torch's grouped matrix product (a mixture of experts'
    expert math in transformers) by `_ShapedGroupedMM`. Its meta kernel takes bf16 only,
    while the CPU and CUDA kernels take fp32 as well; the tensors it returns and saves are
    the same whatever the dtype."""
    targets = [
        (owner, name)
        for owner, name in ((torch, "_grouped_mm"), (torch.nn.functional, "grouped_mm"))
        if hasattr(owner, name)
    ]
    originals = [getattr(owner, name) for owner, name in targets]
    for owner, name in targets:
        setattr(owner, name, _shaped_grouped_mm)
    try:
        yield
    finally:
        for (owner, name), original in zip(targets, originals, strict=True):
            setattr(owner, name, original)


@contextlib.contextmanager
def unpacked_rows() -> Iterator[None]:
    """While a simulated step runs: a transformers model's rows hold one document each, as
    the default input's positions (0..S-1) say. transformers decides whether rows are
    packed from the position ids' values (`find_packed_sequence_indices`, one host
    check); fake tensors have none, so it took every row as packed and built a whole
    S x S mask, where a real step on the same input passes none (SDPA's is_causal): 69%
    more activations than the real step for llama at sequences of 1,024 on 4 ranks. Rows
    of packed documents given as an example input are simulated as unpacked."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensor

    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def unpacked(position_ids: torch.Tensor) -> Any:
        return None if isinstance(position_ids, FakeTensor) else original(position_ids)

    setattr(module, "find_packed_sequence_indices", unpacked)  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "find_packed_sequence_indices", original)  # noqa: B010


@contextlib.contextmanager
def untracked_shape_inference(fake_mode: Any) -> Iterator[None]:
    """While a simulated step runs: DTensor's shape inference runs with the memory
    tracker set aside, as it does in a real run.

    To learn an op's global output shape, DTensor runs the op on fake arguments of the
    global shapes (`ShardingPropagator._propagate_tensor_meta_non_cached`), in the fake
    mode it finds, else one of its own. In a real run that is its own, entered above the
    tracker, which never sees those arguments. In a simulation it finds the simulation's,
    below the tracker, which then counted them as memory held at that moment: a whole
    experts parameter of DeepSeek-V3's shape (256 experts, 14 GiB) at every experts
    layer's all-gather under ep, and the global shapes of tp's split weights. Here the
    inference runs in the simulation's fake mode alone, every other mode set aside.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def alone(self: ShardingPropagator, op_schema: Any) -> Any:
        with _disable_current_modes(), fake_mode:
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = alone  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions before a simulation: they hold the
    meshes they were made on, and a mesh compares equal to one of an earlier simulation
    with the same layout, so a cached decision could send a collective to a process group
    that simulation destroyed ("Could not resolve the process group registered under the
    name ..."; seen at world 512 with tp 8: full_shard, then hybrid_shard in one process)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # torch 2.13's C++ copy of the same cache
        clear_native()


def check_backend(backend: object) -> Backend:
    """`backend`, if the simulation models it; a ValueError naming the choices otherwise."""
    if backend not in BACKENDS:
        raise ValueError(
            f"simulate_step(backend={backend!r}): use one of {list(BACKENDS)}: 'nccl' for a "
            "GPU job, 'gloo' for a CPU job."
        )
    return backend


def _gloo_reduce_scatter(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (torch's reduce-scatter of one tensor), followed by the copy gloo makes.

    gloo has no reduce-scatter of its own: `ProcessGroupGloo::reduce_scatter_tensor_coalesced`
    clones the whole input, all-reduces the clone in place, and on `wait()` copies this
    rank's chunk of it into the output. Under FSDP2 the input is a unit's flat unsharded
    gradients, so a gloo rank holds them twice while the unit reduces: for a root unit with
    a large embedding and an untied head, that is the step's peak. The fake group does
    nothing; this allocates the clone and copies out of it, as the wait does (the real run's
    tracker first sees the clone there, when `wait()` chunks it), and frees it.

    gloo's worker thread holds the clone too, in the all-reduce it ran, and sometimes lets
    go of it only after `wait()` has returned: the clone then outlives the reduce-scatter,
    and a real rank can peak higher by up to one unit's gradients (seen in about 1 of 5 runs
    of a small Llama at world 2: 32.9 against 30.4 MiB on one rank). That is a race of the
    CPU backend; the simulation models the prompt free.
    """

    @functools.wraps(original)
    def reduce_scatter(
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        work = original(output, input, op, group, async_op)
        clone = input.clone()
        # An async caller waits later; the clone is modelled here, at the call, either way.
        output.copy_(clone.chunk(dist.get_world_size(group))[dist.get_rank(group)])
        del clone
        return work

    return reduce_scatter


@contextlib.contextmanager
def backend_collectives(backend: Backend) -> Iterator[None]:
    """While a simulated step runs: the buffers `backend`'s collectives allocate that a
    real run's tracker counts and the fake process group does not.

    nccl: none (its reduce-scatter and all-gather work on FSDP2's buffers in place).
    gloo: reduce-scatter's clone of its input (`_gloo_reduce_scatter`). gloo's all-gather
    and all-reduce stage through buffers too, but only on gloo's worker thread, between
    the call and `wait()`: no tracker sees them, and no real-run check can measure them.
    """
    if check_backend(backend) == "nccl":
        yield
        return
    # Newer torch reduces through reduce_scatter_single (reduce_scatter_tensor and FSDP2
    # call it), older torch through reduce_scatter_tensor. Wrap the one that does the work
    # (wrapping both would clone twice), in both namespaces callers look it up in.
    name = "reduce_scatter_single"
    if not hasattr(c10d, name):
        name = "reduce_scatter_tensor"
    originals = {module: getattr(module, name) for module in (c10d, dist)}
    for module, original in originals.items():
        setattr(module, name, _gloo_reduce_scatter(original))
    try:
        yield
    finally:
        for module, original in originals.items():
            setattr(module, name, original)


def _vocab_size(model: nn.Module) -> int:
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None)):
        if holder is not None and getattr(holder, "vocab_size", None):
            return int(holder.vocab_size)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    raise ValueError(
        f"simulate_step: cannot tell the vocabulary size of {type(model).__name__} for the "
        "default token input. Pass example_input=lambda: (tokens, labels) (or a dict of "
        "keyword arguments) built with torch.randint."
    )


def default_seq_len(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "seq_len", None):
        return int(cfg.seq_len)
    return None


def default_input(model: nn.Module, batch: int, seq_len: int) -> Any:
    """Integer tokens and next-token labels of shape (batch, seq_len), as a causal LM takes
    them: keyword `input_ids`/`labels` for Hugging Face models, positional otherwise."""
    if isinstance(model, DistributedDataParallel):  # DDP passes keywords through
        model = model.module
    vocab = _vocab_size(model)
    tokens = torch.randint(0, vocab, (batch, seq_len))
    labels = torch.randint(0, vocab, (batch, seq_len))
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        return {"input_ids": tokens, "labels": labels}
    return (tokens, labels)


class ForwardError(RuntimeError):
    """The model's forward raised on the example input while being measured."""


def describe_input(inputs: Any) -> str:
    """'(tensor float32[2, 5], tensor int64[2])' and the like: what the model was given."""
    if isinstance(inputs, torch.Tensor):
        return f"tensor {str(inputs.dtype).removeprefix('torch.')}{list(inputs.shape)}"
    if isinstance(inputs, dict):
        return "{" + ", ".join(f"{k!r}: {describe_input(v)}" for k, v in inputs.items()) + "}"
    if isinstance(inputs, (tuple, list)):
        return "(" + ", ".join(describe_input(v) for v in inputs) + ")"
    return type(inputs).__name__


@contextlib.contextmanager
def _no_fake_tensor_log() -> Iterator[None]:
    """torch logs a failed fake op's traceback at ERROR before raising it; we report it."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def call_model(model: nn.Module, inputs: Any) -> Any:
    try:
        with _no_fake_tensor_log():
            if isinstance(inputs, dict):
                return model(**inputs)
            if isinstance(inputs, (tuple, list)):
                return model(*inputs)
            return model(inputs)
    except Exception as exc:
        hint = (
            "The input is one rank's batch, passed as model(**dict), model(*tuple) or "
            "model(tensor): check that it is what the model takes."
        )
        if "DynamicOutputShape" in type(exc).__name__ or "DataDependent" in type(exc).__name__:
            hint = (
                "A shape there depends on tensor values (torch.where, nonzero, a boolean "
                "mask), which fake tensors do not have: the simulation cannot run this "
                "forward. Measure one real step instead (shardwise.memory.real_step), or "
                "write the op without value-dependent shapes (sort and offsets, as "
                "transformers' grouped experts do)."
            )
        raise ForwardError(
            f"the model's forward raised {type(exc).__name__} on the example input "
            f"{describe_input(inputs)}: {str(exc).rstrip('.')}. {hint}"
        ) from exc


def loss_of(out: Any) -> torch.Tensor:
    """The scalar to backpropagate: the output itself, `.loss` (or a mapping's "loss", as
    the Engine reads it), or the mean of logits."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"simulate_step: the model returned {type(out).__name__}, with no tensor loss. "
            "Return the loss (or an object with .loss), or logits."
        )
    return loss if loss.dim() == 0 else loss.float().mean()


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are empty meta tensors (shapes,
    dtypes, ties and `requires_grad` kept): no parameter data is copied."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)
