"""Lightning adapter: `Trainer(strategy=ShardwiseStrategy(strategy="full_shard"))`.

Owns: translating Lightning's strategy calls into shardwise's own: `wrap` for the model
(auto plan, meta-device build inside `configure_model`), `total_grad_norm` for
`gradient_clip_val`, DCP for `trainer.save_checkpoint` / `fit(ckpt_path=...)`.

One class deep on Lightning's `ModelParallelStrategy` (FSDP2-based): it already brings the
launcher, process group, restore-after-setup order (optimizers exist when a checkpoint is
loaded) and a DCP checkpoint directory with Lightning's metadata in `meta.pt`. What differs
is done here: the strategy of `ParallelConfig` instead of a user `configure_model`
parallelisation, one data-parallel group over every rank, DDP as well as FSDP2 and HSDP,
only tensors in the DCP files (optimizer hyperparameters go to `meta.pt`) and clipping by
the norm over every shard.

Must not: be imported by `shardwise` itself (it imports lightning).
"""

from __future__ import annotations

import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.nn import Module

from shardwise.checkpoint.ranks import single_process_ok
from shardwise.checkpoint.trust import (
    CheckpointError,
    SafeReader,
    TensorOnlyLoadPlanner,
    root_cause,
)
from shardwise.config.parallel import ParallelConfig
from shardwise.integrations.layouts import host_config
from shardwise.parallelize.apply import wrap
from shardwise.parallelize.materialize import init_empty
from shardwise.parallelize.wrapped import stale_parameters, wrap_info
from shardwise.train.engine import clip_grad_norm_, trainable_params

__all__ = ["ShardwiseStrategy"]

_EXTRA_KEY = "shardwise"


@contextmanager
def _nested_post_forward_suspended(module: Module) -> Generator[None, None, None]:
    """While a step runs inside the root's forward, a nested `self(...)` skips the root's
    post-forward hook.

    The outer call already unsharded the root and its post-forward hook will register the
    root's pre-backward on the step's output. Running it a second time for the nested call
    records the root twice in FSDP2's forward order, and backward then all-gathers the root's
    parameters once more than a plain `model(x)` step does (measured: 8 all-gathers instead
    of 7 for a root and three blocks). The pre-forward hook still runs, so inputs are cast
    as before. Only when the root casts outputs (`output_dtype`) is nothing suspended: that
    cast lives in the same hook.
    """
    state = fully_shard.state(module) if isinstance(module, FSDPModule) else None  # type: ignore[attr-defined]
    handle = getattr(state, "_post_forward_hook_handle", None)
    policy = getattr(state, "_mp_policy", None)
    hooks = module._forward_hooks
    if handle is None or handle.id not in hooks or getattr(policy, "output_dtype", 1) is not None:
        yield
        return
    saved = dict(hooks)
    del hooks[handle.id]
    try:
        yield
    finally:
        hooks.clear()
        hooks.update(saved)


class _StepRedirection(_DDPForwardRedirection):
    """Lightning's forward redirection (step inside `model.__call__`), without the nested
    root post-forward: see `_nested_post_forward_suspended`."""

    def __call__(
        self,
        wrapper_module: Module,
        original_module: Any,
        method_name: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        original_forward = original_module.forward

        def step_as_forward(*a: Any, **k: Any) -> Any:
            original_module.forward = original_forward  # the step may call the real forward
            with _nested_post_forward_suspended(original_module):
                out = getattr(original_module, method_name)(*a, **k)
            self.on_after_inner_forward(wrapper_module, original_module)
            return out

        original_module.forward = step_as_forward
        try:
            out = wrapper_module(*args, **kwargs)
        finally:
            original_module.forward = original_forward
        self.on_after_outer_forward(wrapper_module, original_module)
        return out


def _clip_trainable(optimizer: Any, max_norm: float) -> None:
    """`gradient_clip_val`: clip by the norm over every shard and replica of the
    optimizer's parameters that train (a frozen one never counts)."""
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    clip_grad_norm_(trainable_params(optimizer), max_norm)


class ShardwiseStrategy(ModelParallelStrategy):
    """Lightning strategy that parallelises the LightningModule with `shardwise.wrap`.

    Keywords are `ParallelConfig`'s (or its vocabulary: fairscale's `compute_dtype`,
    `fp32_reduce_scatter`, strategy `'ddp_fully_sharded'`, ...), or pass `config=`.
    `process_group_backend` and `timeout` are Lightning's.

        trainer = lightning.Trainer(strategy=ShardwiseStrategy(strategy="full_shard"),
                                    accelerator="cpu", devices=2)

    Build layers in `configure_model` to have them created on the meta device and
    materialised shard by shard; layers built in `__init__` work too (built eagerly).
    Return optimizers from `configure_optimizers` built from `self.parameters()` there:
    it runs after wrapping.
    """

    def __init__(
        self,
        config: ParallelConfig | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **parallel: Any,
    ) -> None:
        self.config = host_config(config, parallel, "ShardwiseStrategy", "Lightning's Trainer")
        super().__init__(
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._forward_redirection = _StepRedirection()

    # --- processes and data ------------------------------------------------------------------

    def setup_environment(self) -> None:
        # ModelParallelStrategy also builds a (data, tensor) mesh here; shardwise.wrap
        # resolves its own mesh from the config, so only the process group is needed.
        self._setup_distributed()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data parallel over every rank, except that under tensor parallelism the ranks of
        # one tp group read the same rows (Lightning asks after setup has wrapped the model).
        info = wrap_info(self.model) if self.model is not None else None
        if info is not None and self.config.tp_size > 1:
            return {"num_replicas": info.dp_size, "rank": info.dp_rank}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    # --- model and optimizers ----------------------------------------------------------------

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Lightning runs `configure_model` in here: its parameters land on the meta device
        # and `wrap` allocates only this rank's shards.
        with init_empty():
            yield

    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(
                "ShardwiseStrategy: the LightningModule holds FSDP1 FullyShardedDataParallel "
                "modules. Leave the wrapping to the strategy: build plain modules."
            )
        if wrap_info(self.model) is None:  # a second fit/validate reuses the sharded model
            self.model = self.precision_plugin.convert_module(self.model)
            self.model = wrap(self.model, self.config)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._refuse_stale_optimizers()
        self.setup_precision_plugin()
        # Lightning clips through the precision plugin; clip by the norm over every shard.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        pass  # wrap() places the model on this rank's device

    def _refuse_stale_optimizers(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            stale, held = stale_parameters(optimizer)
            if stale:
                raise RuntimeError(
                    f"ShardwiseStrategy: optimizer {i} ({type(optimizer).__name__}) holds "
                    f"{stale} of {held} parameter(s) that sharding replaced: it was built "
                    "before the strategy wrapped the model (in __init__, or from a module kept "
                    "aside), so it would update tensors the model no longer uses. Build it in "
                    "configure_optimizers from self.parameters(): Lightning calls that hook "
                    "after wrapping."
                )

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        _clip_trainable(optimizer, float(clip_val))

    # --- steps: always through the root module's forward --------------------------------------
    # FSDP2 shards the LightningModule in place, so `self.model is self.lightning_module`
    # and Lightning would call `training_step` directly, skipping the root's unshard and
    # reduce-scatter hooks. The forward redirection runs it inside `model.__call__`.

    def _redirect(self, name: str, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    # --- checkpoints ---------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return get_model_state_dict(self.model)  # this rank's shards, user names

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """A directory at `filepath`: DCP files with the model's and optimizers' tensors
        (each rank writes its shards) and `meta.pt`, Lightning's checkpoint without them."""
        if storage_options is not None:
            raise TypeError(
                "ShardwiseStrategy.save_checkpoint(storage_options=...) is not supported: "
                "checkpoints are written by torch.distributed.checkpoint, not CheckpointIO."
            )
        path = Path(self.broadcast(str(filepath)))
        tensors: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        groups = []
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state["state"]
            groups.append(state["param_groups"])
        checkpoint[_EXTRA_KEY] = {
            "optimizer_param_groups": groups,
            "world_size": self.world_size,
            "strategy": self.config.strategy,
        }
        error = ""
        if self.global_rank == 0:
            try:
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.is_dir():  # overwritten (e.g. last.ckpt): no stale shards left
                    shutil.rmtree(path)
                path.mkdir(parents=True)
            except OSError as exc:
                error = f"cannot create the checkpoint directory {path}: {exc}"
        error = self.broadcast(error)
        if error:
            raise CheckpointError(error)
        try:
            with single_process_ok():
                dcp.save(
                    tensors,
                    storage_writer=FileSystemWriter(path, sync_files=True),
                    no_dist=not dist.is_initialized(),
                )
        except Exception as exc:
            raise CheckpointError(f"could not write checkpoint {path}: {root_cause(exc)}") from None
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)
        self.barrier()

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Reshard a checkpoint directory into this run's layout (any world size or
        strategy); returns Lightning's checkpoint without the tensors."""
        assert self.model is not None and self.lightning_module is not None
        strict = bool(self.lightning_module.strict_loading)
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / _METADATA_FILENAME).is_file():
            raise CheckpointError(
                f"ShardwiseStrategy.load_checkpoint: {path} is not a ShardwiseStrategy "
                f"checkpoint (a directory with {_METADATA_FILENAME} and DCP files). Save it "
                "with this strategy's trainer.save_checkpoint or ModelCheckpoint."
            )
        metadata = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        extra = metadata.pop(_EXTRA_KEY, {})
        groups = extra.get("optimizer_param_groups", [])
        optimizers = [
            o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers
        ]
        load_optim = bool(optimizers) and len(groups) == len(optimizers)
        model_sd = get_model_state_dict(self.model)
        state: dict[str, Any] = {"state_dict": model_sd}
        optim_sds = [get_optimizer_state_dict(self.model, o) for o in optimizers]
        if load_optim:
            for i, osd in enumerate(optim_sds):
                state[f"optimizer_{i}"] = osd["state"]
        try:
            with single_process_ok():
                dcp.load(
                    state,
                    storage_reader=SafeReader(path),
                    planner=TensorOnlyLoadPlanner(allow_partial_load=not strict),
                    no_dist=not dist.is_initialized(),
                )
        except Exception as exc:
            raise CheckpointError(f"could not read checkpoint {path}: {root_cause(exc)}") from None
        set_model_state_dict(
            self.model, state["state_dict"], options=StateDictOptions(strict=strict)
        )
        if load_optim:
            for i, optimizer in enumerate(optimizers):
                set_optimizer_state_dict(
                    self.model,
                    optimizer,
                    {"state": state[f"optimizer_{i}"], "param_groups": groups[i]},
                )
        return metadata

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already put the tensors in place

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass
