"""mmengine's Runner on shardwise: the model wrapper `ShardwiseDataParallel`.

A config loads it and selects it by name::

    custom_imports = dict(imports=["shardwise.integrations.mmengine"])
    model_wrapper_cfg = dict(type="ShardwiseDataParallel", strategy="full_shard")

Every `ParallelConfig` keyword works there, and so do the mmengine/FSDP1/DDP words it
accepts (`sharding_strategy`, `broadcast_buffers`, `device_ids`, ...); the wrapper's own
argument is `detect_anomalous_params`, as on `MMDistributedDataParallel`.

Owns: the translation of mmengine's calls into shardwise's: `train_step`/`val_step`/
`test_step` as `MMDistributedDataParallel` does them (through `split_outputs` and the
model's `parse_losses`), `no_sync()` for OptimWrapper accumulation (FSDP2 included), the
global gradient norm for `clip_grad` under sharding (`total_grad_norm`), and mmengine
checkpoints of a sharded model (full tensors in the `.pth`, gathered and restored on every
rank with torch's `torch.distributed.checkpoint.state_dict` functions).

Why the Runner is patched (on import, once): `Runner.save_checkpoint` is `@master_only`
and reads `model.state_dict()` and `optim_wrapper.state_dict()` on rank 0 alone. Under
FSDP2 those hold rank-local shards, and gathering them is a collective every rank must
join. So when `runner.model` is a sharded `ShardwiseDataParallel` (and only then) every
rank first gathers the full model and optimizer states, and rank 0 then runs mmengine's
own save with them in place of the sharded ones: the file is an ordinary mmengine
checkpoint. `Runner.load_checkpoint` and the optimizer's `load_state_dict` on resume put
full states back into the shards on every rank; `Runner._init_model_weights` skips
mmengine's broadcast of shards (the weights were initialised and synchronised before
sharding). Any other model takes mmengine's own path, unchanged.

Must not: be imported by `shardwise` itself (only this module imports mmengine), or hold
training logic of its own beyond the translation.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from mmengine.model.utils import detect_anomalous_params as _detect_anomalous_params
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.registry import MODEL_WRAPPERS
from mmengine.runner import Runner
from mmengine.runner.checkpoint import _load_checkpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from shardwise.config.parallel import ParallelConfig
from shardwise.integrations.layouts import computes_in_fp16, refuse_unbuilt_layouts
from shardwise.parallelize.apply import wrap
from shardwise.parallelize.wrapped import unwrap
from shardwise.train.engine import clip_grad_norm_
from shardwise.train.losses import model_parse_losses, split_outputs
from shardwise.train.optim import sharded_scaler_like

__all__ = ["ShardwiseDataParallel", "full_state_dicts"]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_ADOPTED = "_shardwise_adopted"


@MODEL_WRAPPERS.register_module()
class ShardwiseDataParallel(nn.Module):
    """An mmengine model wrapper that parallelises `module` with `shardwise.wrap`.

    `module` stays the user's model (sharded in place under FSDP strategies, the DDP's
    `.module` under `ddp`), so mmengine's `model.module` finds it as with its own wrappers.
    """

    module: nn.Module
    _ddp: DistributedDataParallel | None

    def __init__(
        self, module: nn.Module, detect_anomalous_params: bool = False, **kwargs: Any
    ) -> None:
        super().__init__()
        config = ParallelConfig(**kwargs)
        refuse_unbuilt_layouts(config, "mmengine's Runner")
        if config.strategy != "ddp":
            # mmengine initialises weights after wrapping, then broadcasts the state dict
            # from rank 0: on shards that would copy rank 0's shard over the others. Here
            # the weights are initialised on the full model and synchronised before
            # sharding instead (the same values, as each rank then holds rank 0's).
            init = getattr(module, "init_weights", None)
            if callable(init) and not getattr(module, "is_init", False):
                init()
        self.config = config
        self.detect_anomalous_params = detect_anomalous_params
        wrapped = wrap(module, config)
        self.module = unwrap(wrapped)
        # The DDP (if any) is kept out of the registered children, so this wrapper's
        # state_dict/parameters name each tensor once.
        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        object.__setattr__(self, "_ddp", ddp)
        self._in_train_step = False

    # --- what mmengine calls ------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        """True when the parameters are FSDP2 shards (DTensors) rather than full tensors."""
        return isinstance(self.module, FSDPModule)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        target = self._ddp if self._ddp is not None else self.module
        return target(*args, **kwargs)

    def train(self, mode: bool = True) -> ShardwiseDataParallel:
        super().train(mode)
        if self._ddp is not None:
            self._ddp.training = mode
        return self

    def train_step(self, data: dict | tuple | list, optim_wrapper: Any) -> dict[str, Any]:
        """MMDistributedDataParallel.train_step: preprocess, forward(mode='loss'), the
        model's parse_losses, `optim_wrapper.update_params`."""
        adopt_optim_wrapper(self, optim_wrapper)
        self._in_train_step = True
        try:
            if self.sharded:
                # no_sync() below may turn it off for this micro-batch; backward (inside
                # update_params, after the context has closed) reads it.
                self._set_gradient_sync(True)
            with optim_wrapper.optim_context(self):
                data = self._preprocess(data, training=True)
                outputs = self._run_forward(data, mode="loss")
            losses, passed = split_outputs(outputs)
            parsed_loss, log_vars = model_parse_losses(self.module, losses)
            optim_wrapper.update_params(parsed_loss)
            if self.detect_anomalous_params:
                _detect_anomalous_params(parsed_loss, model=self)
        finally:
            self._in_train_step = False
            if self.sharded:
                self._set_gradient_sync(True)
        return {**log_vars, **passed}

    def val_step(self, data: dict | tuple | list) -> list:
        """The module's own val_step: data_preprocessor(data, False), mode='predict'."""
        return self._eval_step(data, "val_step")

    def test_step(self, data: dict | tuple | list) -> list:
        return self._eval_step(data, "test_step")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation (OptimWrapper accumulation calls it).

        Under FSDP2 the flag is read at backward, which mmengine runs after this context
        has closed (in `update_params`); inside `train_step` it therefore stays off until
        the step has ended.
        """
        if self._ddp is not None:
            with self._ddp.no_sync():
                yield
        elif self.sharded:
            self._set_gradient_sync(False)
            try:
                yield
            finally:
                if not self._in_train_step:
                    self._set_gradient_sync(True)
        else:
            yield

    # --- helpers ------------------------------------------------------------------------

    def _set_gradient_sync(self, sync: bool) -> None:
        module = self.module
        assert isinstance(module, FSDPModule)
        module.set_requires_gradient_sync(sync)

    def _preprocess(self, data: Any, training: bool) -> Any:
        preprocessor: Callable[..., Any] = getattr(self.module, "data_preprocessor")  # noqa: B009
        return preprocessor(data, training=training)

    def _run_forward(self, data: Any, mode: str) -> Any:
        if isinstance(data, dict):
            return self(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self(*data, mode=mode)
        raise TypeError(
            "ShardwiseDataParallel: the data_preprocessor returned "
            f"{type(data).__name__}; mmengine expects a dict, list or tuple."
        )

    def _eval_step(self, data: Any, name: str) -> list:
        own = getattr(self.module, name, None)
        if callable(own):
            return list(own(data))  # BaseModel: data_preprocessor(data, False), 'predict'
        data = self._preprocess(data, training=False)
        return list(self._run_forward(data, mode="predict"))


# --- the optimizer wrapper --------------------------------------------------------------


def _sub_wrappers(optim_wrapper: Any) -> list[OptimWrapper]:
    if isinstance(optim_wrapper, OptimWrapperDict):
        return list(optim_wrapper.optim_wrappers.values())
    return [optim_wrapper] if isinstance(optim_wrapper, OptimWrapper) else []


def _global_norm_clip(
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """clip_grad_norm_ by the norm over every shard and replica (shardwise's
    total_grad_norm), scaling each (sharded or local) gradient in place; a non-finite norm
    scales nothing (a loss scaler skips that step)."""
    if float(norm_type) != 2.0:
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, foreach
        )
    total = clip_grad_norm_([p for p in params if isinstance(p, nn.Parameter)], float(max_norm))
    if error_if_nonfinite and not torch.isfinite(total):  # nothing was scaled (see above)
        raise RuntimeError(
            f"The total norm of gradients is {float(total)}; clip_grad(error_if_nonfinite="
            "True) refuses it."
        )
    return total


def adopt_optim_wrapper(model: ShardwiseDataParallel, optim_wrapper: Any) -> None:
    """Make an mmengine OptimWrapper right for the model, once per wrapper: refuse one with
    no loss scaler for a model computing in fp16 (any strategy); for a sharded model,
    'norm' clipping by the global norm, an AmpOptimWrapper's GradScaler as a
    ShardedGradScaler with the same settings (so every rank skips the same steps), and
    `load_state_dict` accepting the full, name-keyed optimizer states that checkpoints of
    sharded models hold."""
    for wrapper in _sub_wrappers(optim_wrapper):
        if getattr(wrapper, _ADOPTED, False):
            continue
        if computes_in_fp16(model.config) and getattr(wrapper, "loss_scaler", None) is None:
            raise ValueError(
                f"ShardwiseDataParallel(mixed_precision={model.config.mixed_precision!r}) "
                f"computes in float16, whose gradients need a loss scale, and "
                f"{type(wrapper).__name__} scales nothing: small gradients would round "
                "to zero unseen. Use optim_wrapper=dict(type='AmpOptimWrapper', ...) "
                "(shardwise shards its GradScaler), or mixed_precision='bf16'."
            )
        if model.sharded:
            if wrapper.clip_grad_kwargs and wrapper.clip_func is torch.nn.utils.clip_grad_norm_:
                wrapper.clip_func = _global_norm_clip
            if getattr(wrapper, "loss_scaler", None) is not None:  # AmpOptimWrapper
                wrapper.loss_scaler = sharded_scaler_like(wrapper.loss_scaler)
            optimizer = wrapper.optimizer
            optimizer.load_state_dict = functools.partial(
                _load_optimizer_state, model.module, optimizer
            )
        setattr(wrapper, _ADOPTED, True)


def _by_name(module: nn.Module, optimizer: Any, state_dict: dict) -> dict:
    """An integer-keyed torch optimizer state (what `MMDistributedDataParallel` checkpoints
    hold) keyed by parameter name instead. torch numbers parameters in param-group order,
    so the i-th id of saved group g is the i-th parameter of this optimizer's group g."""
    names = {id(p): n for n, p in module.named_parameters()}
    saved, current = state_dict.get("param_groups", []), optimizer.param_groups
    if len(saved) != len(current) or any(
        len(s["params"]) != len(c["params"]) for s, c in zip(saved, current, strict=True)
    ):
        raise ValueError(
            "ShardwiseDataParallel: the checkpoint's optimizer state has param groups of "
            f"{[len(g['params']) for g in saved]} parameters, this optimizer "
            f"{[len(g['params']) for g in current]}: it was saved for another model or "
            "optimizer configuration. Load the weights only (load_from without resume)."
        )
    to_name = {}
    for s, c in zip(saved, current, strict=True):
        for i, p in zip(s["params"], c["params"], strict=True):
            to_name[i] = names[id(p)]
    return {
        "state": {to_name[i]: v for i, v in state_dict.get("state", {}).items()},
        "param_groups": [{**g, "params": [to_name[i] for i in g["params"]]} for g in saved],
    }


def _load_optimizer_state(module: nn.Module, optimizer: Any, state_dict: dict) -> None:
    own = type(optimizer).load_state_dict
    if getattr(optimizer, "_shardwise_loading", False):
        own(optimizer, state_dict)
        return
    groups = state_dict.get("param_groups", [])
    if not any(isinstance(p, str) for g in groups for p in g.get("params", [])):
        state_dict = _by_name(module, optimizer, state_dict)
    optimizer._shardwise_loading = True
    try:  # torch calls optimizer.load_state_dict inside: that is `own` (flag above)
        set_optimizer_state_dict(
            module, optimizer, state_dict, options=StateDictOptions(full_state_dict=True)
        )
    finally:
        optimizer._shardwise_loading = False


def full_state_dicts(
    module: nn.Module, optim_wrapper: Any = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The full (unsharded, CPU) model state and each optimizer's full state, keyed by
    parameter name. A collective: every rank calls it; only rank 0 gets the values."""
    model_state = get_model_state_dict(module, options=_FULL)
    optim_states = [
        get_optimizer_state_dict(module, w.optimizer, options=_FULL)
        for w in _sub_wrappers(optim_wrapper)
    ]
    return model_state, optim_states


# --- the Runner's checkpoint methods, for sharded ShardwiseDataParallel models ------------


def _sharded_wrapper(runner: Any) -> ShardwiseDataParallel | None:
    model = getattr(runner, "model", None)
    if isinstance(model, ShardwiseDataParallel) and model.sharded:
        return model
    return None


def _patch(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(Runner, name)
    if getattr(original, "_shardwise_original", None) is not None:
        return  # already patched (module re-imported)
    patched = functools.wraps(original)(make(original))
    patched._shardwise_original = original  # type: ignore[attr-defined]
    setattr(Runner, name, patched)


def _make_save(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = _sharded_wrapper(self)
        if model is None:
            return original(self, *args, **kwargs)
        save_optimizer = kwargs.get("save_optimizer", args[3] if len(args) > 3 else True)
        wrappers = _sub_wrappers(self.optim_wrapper) if save_optimizer else []
        # Every rank: gather (collectives). Then rank 0 (original is @master_only) saves.
        model_state, optim_states = full_state_dicts(
            model.module, self.optim_wrapper if save_optimizer else None
        )
        module = model.module
        full = OrderedDict(model_state)  # mmengine's weights_to_cpu reads `_metadata`
        full._metadata = OrderedDict()  # type: ignore[attr-defined]
        with contextlib.ExitStack() as stack:
            _swap(stack, module, "state_dict", lambda *a, **k: full)
            for wrapper, state in zip(wrappers, optim_states, strict=False):
                _swap(stack, wrapper.optimizer, "state_dict", functools.partial(dict, state))
            return original(self, *args, **kwargs)

    return save_checkpoint


def _swap(stack: contextlib.ExitStack, obj: Any, name: str, value: Any) -> None:
    """Set an instance attribute for the duration of `stack`, then restore what was."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)

    def restore() -> None:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)

    stack.callback(restore)


def _make_load(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint(
        self: Any,
        filename: str,
        map_location: Any = "cpu",
        strict: bool = False,
        revise_keys: list | None = None,
    ) -> Any:
        revise = [(r"^module.", "")] if revise_keys is None else revise_keys
        model = _sharded_wrapper(self)
        if model is None:
            return original(self, filename, map_location, strict, revise)
        # Every rank reads the file (full tensors, on CPU) and torch cuts its shards.
        checkpoint = _load_checkpoint(filename, map_location="cpu")
        self.call_hook("after_load_checkpoint", checkpoint=checkpoint)
        state = checkpoint.get("state_dict", checkpoint)
        state = OrderedDict(
            (functools.reduce(lambda k, pr: re.sub(pr[0], pr[1], k), revise, key), value)
            for key, value in state.items()
        )
        result = set_model_state_dict(
            model.module, state, options=StateDictOptions(full_state_dict=True, strict=strict)
        )
        if result.missing_keys or result.unexpected_keys:
            self.logger.warning(
                f"load_checkpoint: missing keys {list(result.missing_keys)}, unexpected keys "
                f"{list(result.unexpected_keys)}"
            )
        self._has_loaded = True
        self.logger.info(f"Load checkpoint from {filename} (into shards)")
        return checkpoint

    return load_checkpoint


def _make_build_optim_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def build_optim_wrapper(self: Any, optim_wrapper: Any) -> Any:
        built = original(self, optim_wrapper)
        model = _sharded_wrapper(self)
        if model is not None:  # before a resume loads full optimizer states into it
            adopt_optim_wrapper(model, built)
        return built

    return build_optim_wrapper


def _make_init_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_model_weights(self: Any) -> None:
        if _sharded_wrapper(self) is None:
            original(self)
        # Sharded: initialised before sharding (see ShardwiseDataParallel.__init__);
        # mmengine's broadcast of the state dict would copy rank 0's shards everywhere.

    return _init_model_weights


_patch("save_checkpoint", _make_save)
_patch("load_checkpoint", _make_load)
_patch("build_optim_wrapper", _make_build_optim_wrapper)
_patch("_init_model_weights", _make_init_weights)
