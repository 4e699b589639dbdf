"""Hugging Face Trainer adapter: `ShardwiseTrainer(..., parallel=ParallelConfig(...))`, and
the same over any Trainer subclass (TRL's `SFTTrainer`) with `shardwise_trainer(cls)`.

Owns: routing the Trainer's parallel work through shardwise. `wrap` replaces Accelerate's
model preparation (once, in `__init__`, so the optimizer, the samplers and `evaluate` see
the sharded model); the optimizer and scheduler are built after it from the Trainer's
arguments; gradient sync is skipped until the last micro-batch (`step_context`);
`max_grad_norm` clips by the norm over the whole mesh (`clip_grad_norm_`); checkpoints
are shardwise's sharded ones (`save_checkpoint` / `load_checkpoint`, resumable at another
world size) beside the Trainer's own files; `save_model` is `export_weights` (a peft
model: its adapter in peft's format).

Kept from Accelerate: the process group (`TrainingArguments` makes it, `wrap` adopts
it), the dataloader sharding (each data-parallel rank its share of every batch; under
tensor parallelism the sampler is given the data-parallel coordinates, so a tp group's
ranks read the same rows), `gather` for the logged loss, the token count and `evaluate`.

Must not: be imported by `shardwise` itself (it imports transformers); hold step logic of
its own beyond calling the core's.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

from shardwise.checkpoint.export import STAGING_PREFIX, export_weights
from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.save import save_checkpoint
from shardwise.checkpoint.trust import CheckpointError
from shardwise.config.parallel import ParallelConfig
from shardwise.config.run_file import Config
from shardwise.distributed.watchdog import guard
from shardwise.integrations.layouts import computes_in_fp16, host_config
from shardwise.parallelize.apply import wrap
from shardwise.parallelize.wrapped import stale_parameters, unwrap, wrap_info
from shardwise.train.engine import clip_grad_norm_, step_context

__all__ = ["CHECKPOINT_SUBDIR", "ShardwiseTrainer", "ShardwiseTrainerMixin", "shardwise_trainer"]

CHECKPOINT_SUBDIR = "shardwise"
"""Where a Trainer checkpoint (OUTPUT/checkpoint-N/) keeps shardwise's sharded state."""

HOST = "the Hugging Face Trainer"

T = TypeVar("T", bound=type)


def _refuse(name: str, value: Any, why: str) -> None:
    raise ValueError(f"ShardwiseTrainer: TrainingArguments.{name}={value!r} is refused: {why}")


def trainer_config(
    parallel: ParallelConfig | Config | None, args: TrainingArguments
) -> ParallelConfig:
    """The `ParallelConfig` a Trainer with `args` runs under: `parallel` with the Trainer's
    arguments whose meaning shardwise keeps translated in, and those it would change
    refused in one line each, naming the argument."""
    if isinstance(parallel, Config):
        parallel = parallel.parallel
    if parallel is None:
        raise TypeError(
            "ShardwiseTrainer needs parallel=ParallelConfig(...) (or a shardwise Config): "
            "it says how the model is laid out over the ranks, e.g. "
            "ParallelConfig(strategy='full_shard')."
        )
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(
            f"ShardwiseTrainer(parallel=...) expects a shardwise ParallelConfig or Config, got "
            f"{type(parallel).__name__}."
        )
    refuse_arguments(args)
    changes: dict[str, Any] = {}
    if args.mixed_precision == "bf16":
        if parallel.mixed_precision not in ("fp32", "bf16"):
            raise ValueError(
                "ShardwiseTrainer: TrainingArguments.bf16=True and ParallelConfig."
                f"mixed_precision={parallel.mixed_precision!r} disagree. Say the precision once: "
                "bf16=True (shardwise's 'bf16' policy), or leave bf16 off and keep the "
                "ParallelConfig's."
            )
        changes["mixed_precision"] = "bf16"
    if args.activation_checkpointing:
        if args.activation_checkpointing_kwargs:
            _refuse(
                "activation_checkpointing_kwargs",
                args.activation_checkpointing_kwargs,
                "shardwise checkpoints each planned block whole (torch's non-reentrant "
                "checkpoint), with no per-call options. Leave it unset, or set "
                "ParallelConfig.activation_checkpointing ('full', 'every_<k>').",
            )
        if parallel.activation_checkpointing == "none":
            changes["activation_checkpointing"] = "full"
    ddp = {
        "find_unused_parameters": args.ddp_find_unused_parameters,
        "bucket_cap_mb": args.ddp_bucket_cap_mb,
        "broadcast_buffers": args.ddp_broadcast_buffers,
        "static_graph": args.ddp_static_graph,
    }
    for name, value in ddp.items():
        if value is not None:
            if getattr(parallel, name) not in (None, value):
                raise ValueError(
                    f"ShardwiseTrainer: TrainingArguments.ddp_{name}={value!r} and "
                    f"ParallelConfig.{name}={getattr(parallel, name)!r} disagree. Set it once."
                )
            changes[name] = value  # DDP's keyword; ParallelConfig refuses it under FSDP
    if changes:
        from dataclasses import replace

        parallel = replace(parallel, **changes)
    if computes_in_fp16(parallel):
        raise ValueError(
            f"ShardwiseTrainer: ParallelConfig.mixed_precision={parallel.mixed_precision!r} "
            "computes in float16, whose gradients need a loss scale, and the Trainer's loop "
            "scales only under its own fp16=True (refused here). Use bf16=True, or shardwise's "
            "Engine and Runner, which scale the loss for fp16."
        )
    return host_config(parallel, {}, "ShardwiseTrainer", HOST)


def refuse_arguments(training_args: TrainingArguments) -> None:
    """Refuse, one line each, the Trainer and Accelerate arguments whose meaning shardwise
    would change (docs/vocabulary.md: a word keeps its meaning or is refused)."""
    args: Any = training_args  # fields typed loosely by transformers (dict | str | None)
    if args.fsdp:
        _refuse(
            "fsdp",
            args.fsdp,
            "Accelerate's FSDP would wrap the model a second time. Leave it unset and say "
            "the layout in ParallelConfig(strategy='full_shard' | 'shard_grad_op' | "
            "'hybrid_shard' | ...).",
        )
    if args.fsdp_config and any(
        k != "xla" and v not in (None, False, [], {}) for k, v in dict(args.fsdp_config).items()
    ):
        _refuse(
            "fsdp_config",
            dict(args.fsdp_config),
            "it configures Accelerate's FSDP, which shardwise replaces. Put the settings in "
            "ParallelConfig (its vocabulary reads FSDP1's words: docs/vocabulary.md).",
        )
    if args.deepspeed:
        _refuse(
            "deepspeed",
            args.deepspeed,
            "DeepSpeed would own the model, optimizer and loss scale. Translate the file "
            "with shardwise.translate_deepspeed(...) and pass the ParallelConfig it gives.",
        )
    if args.fp16 or args.mixed_precision == "fp16":
        _refuse(
            "fp16",
            True,
            "the Trainer scales an fp16 loss with Accelerate's GradScaler, which neither "
            "shardwise's global-norm clipping nor its sharded gradients go through, so small "
            "gradients could round to zero unseen. Use bf16=True (no scale needed), or "
            "shardwise's Engine and Runner, which scale the loss for fp16.",
        )
    if args.fp16_full_eval or args.bf16_full_eval:
        name = "fp16_full_eval" if args.fp16_full_eval else "bf16_full_eval"
        _refuse(
            name,
            True,
            "it casts the whole model with .to(dtype), which would replace the sharded "
            "parameters outside shardwise's precision policy. Evaluate under "
            "ParallelConfig(mixed_precision='bf16') instead.",
        )
    if args.torch_compile:
        _refuse(
            "torch_compile",
            True,
            "Accelerate compiles the whole model before any sharding; shardwise compiles "
            "each planned block before sharding it. Set ParallelConfig(compile=True) (or a "
            "backend name) instead.",
        )
    if getattr(args, "parallelism_config", None) is not None:
        _refuse(
            "parallelism_config",
            args.parallelism_config,
            "Accelerate's ParallelismConfig lays the model out itself. Say the degrees in "
            "ParallelConfig(dp_replicate=..., dp_shard=..., tp=...).",
        )
    accel = args.accelerator_config
    grad_acc = dict(accel.gradient_accumulation_kwargs or {})
    if grad_acc.get("num_steps") is not None:
        _refuse(
            "accelerator_config.gradient_accumulation_kwargs",
            grad_acc,
            "set the accumulation with gradient_accumulation_steps, which the Trainer's loop "
            "(and shardwise's gradient sync) follow.",
        )
    if accel.use_configured_state:
        _refuse(
            "accelerator_config.use_configured_state",
            True,
            "an Accelerator configured beforehand may hold its own parallel plugins. Leave "
            "it False: the Trainer's arguments make the process group and shardwise adopts it.",
        )
    if args.auto_find_batch_size:
        _refuse(
            "auto_find_batch_size",
            True,
            "it frees and re-wraps the model after an out-of-memory error, and shardwise's "
            "wrap is done once. Pick per_device_train_batch_size yourself, or estimate it "
            "with shardwise.simulate_step.",
        )


def _refuse_model(model: nn.Module) -> None:
    if (
        getattr(model, "is_distributed_loading_by_transformers", False)
        or (getattr(model, "tp_size", None) or 1) > 1
    ):
        raise ValueError(
            "ShardwiseTrainer: the model was sharded when it was loaded (from_pretrained's "
            "tp_plan or distributed_config), and shardwise would shard it a second time. Load it "
            "whole (no tp_plan) and say the layout in ParallelConfig."
        )


class ShardwiseTrainerMixin:
    """Put before a `transformers.Trainer` class (`class T(ShardwiseTrainerMixin, Trainer)`):
    the Trainer's loop then trains the model laid out by `shardwise.wrap(model, parallel)`.

    Every other argument is the Trainer's own, unchanged, except those refused in one line
    by `refuse_arguments` and these, translated: `bf16=True` is shardwise's 'bf16' policy,
    `activation_checkpointing` (`gradient_checkpointing`) checkpoints shardwise's planned
    blocks, and `ddp_find_unused_parameters` and the other `ddp_*` are DDP's keywords under
    strategy='ddp' (refused under FSDP strategies, as ParallelConfig refuses them).
    """

    # The Trainer's attributes this mixin reads and writes (declared for mypy).
    args: TrainingArguments
    model: Any
    model_wrapped: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    state: Any
    callback_handler: Any
    processing_class: Any
    _created_lr_scheduler: bool

    def __init__(
        self, *args: Any, parallel: ParallelConfig | Config | None = None, **kwargs: Any
    ) -> None:
        names = ("model", "args")
        bound = dict(zip(names, args, strict=False)) | {k: kwargs[k] for k in names if k in kwargs}
        training_args = bound.get("args")
        if training_args is None:
            raise TypeError(
                "ShardwiseTrainer needs args=TrainingArguments(...): its defaults would train "
                "with a random sampler, which no parity check can follow. Pass your own."
            )
        self.shardwise_config = trainer_config(parallel, training_args)
        if bound.get("model") is None or kwargs.get("model_init") is not None:
            raise TypeError(
                "ShardwiseTrainer needs model=...: model_init builds a new model per trial, "
                "and shardwise wraps the model once. Build it and pass it."
            )
        _refuse_model(bound["model"])
        # The Trainer must neither cast nor checkpoint by itself what shardwise's policy
        # already does: a copy of the arguments without them (the user's object is kept).
        own = copy.copy(training_args)
        own.bf16 = False
        own.mixed_precision = "no"
        own.activation_checkpointing = own.gradient_checkpointing = False
        if len(args) > 1:
            args = (args[0], own, *args[2:])
        else:
            kwargs["args"] = own
        super().__init__(*args, **kwargs)
        self._wrap()

    # --- layout ------------------------------------------------------------------------------

    def _wrap(self) -> None:
        if wrap_info(self.model) is None:
            self.model_wrapped = wrap(self.model, self.shardwise_config)
            self.model = unwrap(self.model_wrapped)  # FSDP2 shards in place: the same module
        info = wrap_info(self.model_wrapped) or wrap_info(self.model)
        assert info is not None
        self.shardwise_info = info

    def get_tp_size(self) -> int:
        # The Trainer divides its token count by the ranks that read the same rows.
        return self.shardwise_config.tp_size

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        loader = super()._get_dataloader(*args, **kwargs)  # type: ignore[misc]
        info = self.shardwise_info
        if info.dp_size == info.dist.world_size:
            return loader  # Accelerate already shards over every rank, as shardwise's dp does
        # Under tensor parallelism the data-parallel ranks are fewer than the processes:
        # the ranks of one tp group must read the same rows.
        sampler: Any = getattr(loader, "batch_sampler", None)
        if type(sampler).__name__ != "BatchSamplerShard":
            raise NotImplementedError(
                f"ShardwiseTrainer with tp={self.shardwise_config.tp_size}: the dataloader is "
                f"{type(loader).__name__} with a {type(sampler).__name__} batch sampler, which "
                "cannot be told the data-parallel rank, so a tensor-parallel group's ranks "
                "would read different rows. Use a map-style dataset (with __len__) and "
                "accelerator_config dispatch_batches unset."
            )
        sampler.num_processes = info.dp_size
        sampler.process_index = info.dp_rank
        return loader

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        # Already wrapped by shardwise: Accelerate must neither wrap nor (for evaluate)
        # prepare it. It prepares a model only while it has none registered.
        if not self.accelerator._models:
            self.accelerator._models.append(self.model_wrapped)
        return self.model_wrapped

    # --- optimizer, scheduler, resume -----------------------------------------------------------

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[Any, Any]:
        if self._created_lr_scheduler:  # a second train() builds its scheduler anew
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer(self.model)  # type: ignore[attr-defined]
        stale, held = stale_parameters(self.optimizer)
        if stale:
            raise RuntimeError(
                f"ShardwiseTrainer: the optimizer holds {stale} of {held} parameter(s) that "
                "sharding replaced: it was built before the model was wrapped, so it would "
                "update tensors the model no longer uses. Leave optimizers= unset (the Trainer "
                "builds it from its arguments after wrapping), or pass optimizer_cls_and_kwargs."
            )
        self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)  # type: ignore[attr-defined]
        if resume_from_checkpoint is not None:
            load_checkpoint(
                _sharded_dir(resume_from_checkpoint),
                self.model_wrapped,
                self.optimizer,
                scheduler=self.lr_scheduler,
            )
        self._wrap_model(self.model_wrapped)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model_wrapped, train_dataloader

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        _sharded_dir(
            resume_from_checkpoint
        )  # fails early; the load runs after the optimizer exists

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        pass  # _prepare_for_training loaded them with the model

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        load_checkpoint(_sharded_dir(best), self.model_wrapped, load_optimizer=False)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(
            Path(output_dir) / CHECKPOINT_SUBDIR,
            self.model_wrapped,
            self.optimizer,
            step=self.state.global_step,
            scheduler=self.lr_scheduler,
        )

    def _save_scaler(self, output_dir: str) -> None:
        pass  # no loss scale: fp16 is refused

    # --- steps ---------------------------------------------------------------------------

    def training_step(self, model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        plugin = self.accelerator.gradient_state.plugin_kwargs
        sync = bool(self.accelerator.sync_gradients or plugin.get("sync_each_batch", False))
        with step_context(self.model_wrapped, sync):
            return super().training_step(model, *args, **kwargs)  # type: ignore[misc]

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(_trainable(self.model_wrapped), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = clip_grad_norm_(_trainable(self.model_wrapped), None)
        return grad_norm

    # --- export ---------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank calls (as the Trainer's scripts do): rank 0 writes safetensors that
        `from_pretrained` opens, or for a peft model the adapter `PeftModel.from_pretrained`
        opens, with the tokenizer and training arguments beside them."""
        out = Path(output_dir if output_dir is not None else str(self.args.output_dir))
        _export_beside(self.model_wrapped, out, self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
            torch.save(self.args, os.path.join(out, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")  # type: ignore[attr-defined]


def _export_beside(model: nn.Module, out: Path, writes: bool) -> None:
    """`export_weights` into `out`, which may hold the Trainer's other files (checkpoints,
    logs, the tokenizer), where an export refuses to write: into a fresh directory inside
    it, whose files then replace an earlier save's weight files, as `save_pretrained` does."""
    staging = out / f"{STAGING_PREFIX}trainer"
    if writes:
        if staging.is_dir():  # left by a killed save
            shutil.rmtree(staging)
        out.mkdir(parents=True, exist_ok=True)
    _barrier("save_model: rank 0 clearing the staging directory")
    export_weights(model, staging)
    if writes:
        for old in out.iterdir():
            if old.is_file() and (old.name in _WEIGHT_NAMES or _SHARD.fullmatch(old.name)):
                old.unlink()
        for new in staging.iterdir():
            os.replace(new, out / new.name)
        staging.rmdir()
    _barrier("save_model: rank 0 moving the exported files into place")


_WEIGHT_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    "config.json",
    "generation_config.json",
)
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _barrier(what: str) -> None:
    """A barrier within the process group's timeout (TrainingArguments.ddp_timeout) that
    names the rank that did not arrive."""
    if dist.is_available() and dist.is_initialized():
        with guard(what):
            dist.barrier()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _sharded_dir(checkpoint: str | os.PathLike[str] | None) -> Path:
    path = Path(os.fspath(checkpoint)) / CHECKPOINT_SUBDIR if checkpoint is not None else None
    if path is None or not path.is_dir():
        raise CheckpointError(
            f"ShardwiseTrainer: {checkpoint} holds no {CHECKPOINT_SUBDIR}/ directory, so it is not "
            "a checkpoint a ShardwiseTrainer saved (with save_only_model=False). Resume from one "
            "of those, or load the weights into the model before building the trainer."
        )
    return path


def shardwise_trainer(cls: T) -> T:
    """`cls` (a `transformers.Trainer` subclass, e.g. `trl.SFTTrainer`) with shardwise's
    layout: `shardwise_trainer(SFTTrainer)(model=..., args=..., parallel=ParallelConfig(...))`."""
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"shardwise_trainer expects a transformers.Trainer subclass, got {cls!r}.")
    if issubclass(cls, ShardwiseTrainerMixin):
        return cls
    for base in cls.__mro__:  # a user's subclass of a refused trainer is refused too
        refusal = _REFUSED_TRAINERS.get(base.__name__)
        if refusal is not None:
            raise NotImplementedError(f"shardwise_trainer({cls.__name__}) is not built: {refusal}")
    made = type(f"Shardwise{cls.__name__}", (ShardwiseTrainerMixin, cls), {})
    made.__module__ = __name__
    made.__doc__ = f"{cls.__name__} on shardwise's layout (see ShardwiseTrainerMixin)."
    return made  # type: ignore[return-value]


_REFUSED_TRAINERS = {
    "DPOTrainer": (
        "it (DPOTrainer) keeps a frozen reference model beside the policy and prepares it with "
        "Accelerate (accelerator.prepare_model), outside shardwise's layout; no test "
        "shows its losses equal to DPO under the Trainer's own DDP. Use SFTTrainer, or "
        "compute the reference log-probabilities beforehand (precompute_ref_log_probs=True) "
        "with a plain Trainer."
    ),
    "GRPOTrainer": (
        "it (GRPOTrainer) generates completions inside the training step (model.generate, "
        "or vLLM with weights synced from the model), a path this adapter does not route "
        "through shardwise's layout, and no test shows its losses equal to GRPO under the "
        "Trainer's own DDP."
    ),
}
"""Trainer classes refused by name, with the reason."""


class ShardwiseTrainer(ShardwiseTrainerMixin, Trainer):
    """`transformers.Trainer` on shardwise's layout:

    trainer = ShardwiseTrainer(model=model, args=TrainingArguments(...),
                               train_dataset=data, parallel=ParallelConfig(strategy="full_shard"))
    """
