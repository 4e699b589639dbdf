"""`shardwise.Muon`: torch's Muon for wrapped models, each matrix orthogonalised whole.

Owns: the optimizer (torch.optim.Muon's hyperparameters, defaults and arithmetic, plus the
Newton–Schulz dtype and a fallback optimizer for what is not a hidden matrix), the split of
parameters between the two (by name and shape), Newton–Schulz itself, and the context the
Engine builds it in (`muon_context`: parameter names and the ddp group). Where each matrix
lies and how its pieces travel is muon_comm.py's.

Newton–Schulz is not elementwise: run on a shard it orthogonalises the shard, not the
matrix (4.1e-2 off one process on a small MLP). So every matrix is assembled on one owner
rank, orthogonalised there once, and each rank keeps its part (muon_comm.py). Under ddp the
owner broadcasts the whole update; under FSDP the shard group gathers and scatters; under
HSDP and beside tp the other replicas receive their parts by broadcast.

Unlike torch 2.13's Muon it never writes Newton–Schulz's normalisation into the momentum
buffer (pytorch#190597: with bf16 parameters and nesterov=False torch divides the buffer
itself by its norm every step).

Built: one process, ddp, full_shard, shard_grad_op, hybrid_shard, tp with any of them,
pipeline stages (each stage's matrices on that stage's ranks: another stage's ranks hold
other matrices, not copies), experts (a 3-D stack is assembled whole and each expert's
matrix orthogonalised on its own) and adapters (LoRA A and B are matrices of their own).
Refused at construction, in one line: context parallelism (not verified yet).

Must not: step the model's other optimizer state, or read the model beyond the names and
group the Engine hands over.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.matrices import (
    DEFAULT_FALLBACK_NAMES,
    EXPERT_NAMES,
    split_parameters,
)
from shardwise.config.optimizer import MATRIX_OPTIMIZERS
from shardwise.parallelize.wrapped import unwrap, wrap_info
from shardwise.train import muon_comm
from shardwise.train.muon_fused import SplitSetting, orthogonalise_blocks, read_splits

__all__ = [
    "DEFAULT_FALLBACK_NAMES",
    "DEFAULT_NS_COEFFICIENTS",
    "EXPERT_NAMES",
    "Muon",
    "muon_context",
    "newton_schulz",
    "split_parameters",
]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's (Keller Jordan's) constants

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class MuonContext:
    """What the Engine knows and an optimizer factory's parameter list does not."""

    names: dict[int, str]
    process_group: dist.ProcessGroup | None = None
    """The group plain-tensor parameters are replicated over (ddp's)."""
    refused: str | None = None
    """A layout shardwise.Muon does not build, said in a few words."""
    model: nn.Module | None = None
    """The unwrapped model (its config gives fused projections' splits)."""


_CONTEXT: contextvars.ContextVar[MuonContext | None] = contextvars.ContextVar(
    "shardwise_muon_context", default=None
)


@contextlib.contextmanager
def muon_context(model: nn.Module) -> Iterator[None]:
    """Around the Engine's optimizer factory: the names and group of `model`'s parameters."""
    inner = unwrap(model)
    names = {id(p): n for n, p in inner.named_parameters()}
    group = getattr(model, "process_group", None) if model is not inner else None
    refused = None
    info = wrap_info(model) or wrap_info(inner)
    if info is not None:
        cfg = info.config
        for field, what in (("cp", "cp"),):
            if int(getattr(cfg, field, 1)) > 1:
                refused = f"{what} (ParallelConfig.{field}={getattr(cfg, field)})"
    token = _CONTEXT.set(MuonContext(names, group, refused, inner))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def newton_schulz(
    x: torch.Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton–Schulz on a matrix, in `dtype` (bf16: torch's, bit
    for bit). `x` is never written: it is copied even when already in `dtype`."""
    if x.ndim != 2:
        raise ValueError(f"newton_schulz: expected a matrix, got shape {tuple(x.shape)}.")
    a, b, c = ns_coefficients
    y = x.to(dtype, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        y = y.T
    y.div_(y.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = y @ y.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.addmm(y, update, y, beta=a)
    return y.T if tall else y


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's learning-rate adjustment for a (whole) matrix's shape."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw"


def _dtype(value: torch.dtype | str) -> torch.dtype:
    """A group's ns_dtype: a torch.dtype, or its name as a checkpoint gives it back
    ('torch.float32': DCP stores a group's dtypes as strings)."""
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"shardwise.Muon: ns_dtype={value!r} is not a torch dtype.")
    return found


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, a fallback optimizer (AdamW by default) for the rest.

    `params`: parameters, or (name, parameter) pairs such as `model.named_parameters()`
    (names decide what goes to the fallback; through the Engine they are known). The
    hyperparameters are torch.optim.Muon's, with its defaults. `ns_dtype`: Newton–Schulz's
    dtype (bf16 as torch; float32 for parity checks). `fallback`: a factory taking the
    other parameters (default: AdamW with `lr` and torch's other AdamW defaults).
    `fallback_names`: regular expressions sending matching parameters to the fallback;
    `matrix_names`: expressions that keep a 2-D parameter on Muon whatever its name;
    `expert_names`: expressions naming 3-D stacks of expert matrices (each expert its own).
    `process_group`: where plain-tensor parameters are replicated (ddp's group).
    `split_fused` (off by default): orthogonalise fused projections per block, `qkv_proj`
    as its q, k and v rows and `gate_up_proj` as its gate and up halves (per expert in an
    MoE stack), the split read from the model's config (True; `model` gives the model
    outside the Engine), or {name pattern: row sizes} (muon_fused.py)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter | tuple[str, nn.Parameter]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        fallback: OptimizerFactory | None = None,
        fallback_names: Sequence[str] = DEFAULT_FALLBACK_NAMES,
        matrix_names: Sequence[str] = (),
        expert_names: Sequence[str] = EXPERT_NAMES,
        process_group: dist.ProcessGroup | None = None,
        split_fused: SplitSetting = False,
        model: nn.Module | None = None,
    ) -> None:
        _check_settings(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn)
        context = _CONTEXT.get()
        if context is not None and context.refused:
            raise NotImplementedError(
                f"shardwise.Muon under {context.refused} is not built yet (its matrices' "
                "layout there is unverified); use AdamW, or train without it."
            )
        named = _named(params, context)
        matrices, others = split_parameters(named, fallback_names, matrix_names, expert_names)
        group = process_group
        if group is None and context is not None:
            group = context.process_group
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            use_muon=True,
        )
        super().__init__([{"params": [p for _, p in matrices]}], defaults)
        self.matrix_names = [n for n, _ in matrices]
        self.fallback_names = [n for n, _ in others]
        self._layouts = _layouts(matrices, group)
        self.expert_names = [n for n, p in matrices if p.ndim == 3]
        if model is None and context is not None:
            model = context.model
        splits = read_splits(split_fused, matrices, model, getattr(model, "config", None))
        self.fused_names = list(splits)  # the matrices orthogonalised per block
        self._splits = {id(p): splits[n] for n, p in matrices if n in splits}
        self._owners = muon_comm.choose_owners(
            list(self._layouts.values()), [p.numel() for _, p in matrices]
        )
        self._owner_of = dict(zip(self._layouts, self._owners, strict=True))
        self._groups = muon_comm.Groups()
        me = dist.get_rank() if dist.is_initialized() else 0
        for layout in self._layouts.values():
            self._groups.prepare(layout, me)
        self.fallback: torch.optim.Optimizer | None = None
        if others:
            build = fallback or (lambda ps: torch.optim.AdamW(ps, lr=lr))
            self.fallback = build([p for _, p in others])
            self._link_fallback()

    def _link_fallback(self) -> None:
        """The fallback's groups sit in this optimizer's param_groups (a scheduler sets
        their lr too) and its state in this optimizer's state (one state_dict)."""
        assert self.fallback is not None
        for g in self.fallback.param_groups:
            g["use_muon"] = False
            if not any(g is mine for mine in self.param_groups):
                self.param_groups.append(g)
        self.fallback.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.fallback is not None:  # torch made new group dicts and a new state
            self.fallback.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.fallback.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items, params, groups = [], [], []
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                items.append(self._item(p, group))
                params.append(p)
                groups.append(group)
        for p, group, update in zip(params, groups, self._orthogonalise(items), strict=True):
            lr = float(group["lr"])
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            step = adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:])  # one expert's matrix
            local.add_(update.to(local.device), alpha=-step)
        if self.fallback is not None:
            self.fallback.step()
        return loss

    def _item(self, p: torch.Tensor, group: dict[str, Any]) -> muon_comm.Item:
        """Momentum on this rank's part (elementwise), then what Newton–Schulz needs."""
        state = self.state[p]
        assert p.grad is not None  # step() takes only parameters holding one
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)  # a DTensor like the grad
        grad, buf = _local(p.grad), _local(state["momentum_buffer"])
        m = group["momentum"]
        buf.lerp_(grad, 1 - m)
        update = grad.lerp(buf, m) if group["nesterov"] else buf

        split = self._splits.get(id(p))

        def orthogonalise(whole: torch.Tensor) -> torch.Tensor:
            settings = (
                tuple(group["ns_coefficients"]),
                group["ns_steps"],
                group["eps"],
                _dtype(group["ns_dtype"]),  # a checkpoint gives it back as a string
            )
            if split is not None:  # each block as the matrix it would be unfused
                fn = group["adjust_lr_fn"]
                return orthogonalise_blocks(
                    whole,
                    split,
                    lambda m: newton_schulz(m, *settings),
                    lambda block, matrix: adjust_lr(1.0, fn, block) / adjust_lr(1.0, fn, matrix),
                )
            if whole.ndim == 3:  # a stack of experts: each expert's matrix on its own
                return torch.stack([newton_schulz(m, *settings) for m in whole])
            return newton_schulz(whole, *settings)

        layout = self._layouts[id(p)]
        return muon_comm.Item(tuple(p.shape), update, layout, self._owner_of[id(p)], orthogonalise)

    def _orthogonalise(self, items: list[muon_comm.Item]) -> list[torch.Tensor]:
        """Each matrix's local part of Newton–Schulz on the whole matrix (muon_comm.py)."""
        return muon_comm.orthogonalise_whole(items, self._groups)


def _check_settings(
    lr: float,
    weight_decay: float,
    momentum: float,
    ns_coefficients: Sequence[float],
    ns_steps: int,
    adjust_lr_fn: str | None,
) -> None:
    for field, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum)):
        if not (math.isfinite(float(value)) and float(value) >= 0):
            raise ValueError(f"shardwise.Muon({field}={value!r}): must be a finite number >= 0.")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(
            f"shardwise.Muon(adjust_lr_fn={adjust_lr_fn!r}): use None, 'original' or "
            "'match_rms_adamw'."
        )
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(
            f"shardwise.Muon(ns_coefficients={tuple(ns_coefficients)!r}): give three "
            "numbers (a, b, c), e.g. (3.4445, -4.7750, 2.0315)."
        )
    if not 0 <= ns_steps < 100:
        raise ValueError(f"shardwise.Muon(ns_steps={ns_steps}): use 0 to 99 (torch: 5).")


def _named(
    params: Iterable[object], context: MuonContext | None
) -> list[tuple[str | None, nn.Parameter]]:
    out: list[tuple[str | None, nn.Parameter]] = []
    for item in params:
        if isinstance(item, dict):
            raise TypeError(
                "shardwise.Muon got a parameter group (a dict); pass parameters or "
                "model.named_parameters(), and choose the fallback's with fallback_names."
            )
        if isinstance(item, tuple):
            out.append((str(item[0]), item[1]))
        elif isinstance(item, torch.Tensor):
            out.append((context.names.get(id(item)) if context else None, item))  # type: ignore[arg-type]
        else:
            raise TypeError(
                f"shardwise.Muon got a {type(item).__name__} among its parameters; pass "
                "parameters or model.named_parameters()."
            )
    return out


def _layouts(
    matrices: Sequence[tuple[str, nn.Parameter]], group: dist.ProcessGroup | None
) -> dict[int, muon_comm.MatrixLayout]:
    layouts = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, p in matrices:
        if not isinstance(p, DTensor) and group is None and world > 1:
            raise ValueError(
                f"shardwise.Muon: {name} is a plain tensor at world size {world} and no "
                "process_group says where its replicas are. Pass process_group=ddp_model."
                "process_group (ddp), or build it through shardwise.Engine."
            )
        layouts[id(p)] = muon_comm.layout_of(p, group, name)
    return layouts


# The run file's `optimizer: {name: muon}` builds this class (config sits below train).
MATRIX_OPTIMIZERS["muon"] = Muon
