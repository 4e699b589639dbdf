"""Per-rank memory of model states, per strategy, computed from a wrap plan before any run.

Owns: `estimate_memory`, the bytes each rank holds for parameters, gradients and optimizer
state under each strategy at a world size, plus the parameters gathered transiently for
compute. For fp32 AdamW under full sharding this is the familiar 16 bytes x params / N
(4 parameter + 4 gradient + 8 optimizer state). Works from a plan of a meta-device model.

Must not: allocate tensors or measure anything (bench/ and the runner measure).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from torch import nn

from shardwise.config.names import STRATEGIES
from shardwise.distributed.mesh import resolve_mesh
from shardwise.memory.activations import ActivationTrace
from shardwise.memory.muon_states import MUON_STATES, MuonShares, muon_state_bytes, muon_step_bytes
from shardwise.plan.planner import WrapPlan

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "muon": MUON_STATES, "none": 0}
"""Fp32 states per trainable element (muon: per matrix element; its fallback keeps its own)."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank. `gathered` is the transient full-precision-of-compute copy of the
    parameters that FSDP all-gathers: one unit at a time (plus the root) when resharding
    after forward, all units between forward and backward otherwise."""

    strategy: str
    world_size: int
    dp_replicate: int
    dp_shard: int
    params: int
    grads: int
    optimizer: int
    gathered: int
    unit_buffers: int = 0
    """During backward, FSDP also holds the next unit's all-gather (prefetch) and one
    unit's unsharded gradients for its reduce-scatter (fp32): the largest unit's."""
    root_gather: int = 0
    """Resharding after forward, the root unit is gathered again for backward: its
    all-gather buffer and its unsharded parameters are held together for a moment."""
    root_reduce: int = 0
    """Sharding over more than one rank, the root unit's unsharded gradients (in the
    compute dtype) and their fp32 copy for its reduce-scatter, at the end of backward, less
    its sharded gradients (not yet there)."""
    step_temporaries: int | None = None
    """Muon's temporaries at its step on the worst rank (memory/muon_states.py); None: an
    elementwise optimizer's, gradient-sized (PeakEstimate)."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.model_states + self.gathered


def format_bytes(n: float) -> str:
    """Bytes for people: B, KiB, MiB (one decimal), GiB and above (two)."""
    if n < 1024:
        return f"{n:,.0f} B"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.{2 if scale >= 2**30 else 1}f} {unit}"
    return f"{n:,.0f} B"


def tp_shares(model: nn.Module, plan: WrapPlan, split: set[int], tp: int) -> dict[str, float]:
    """Per unit (by fqn): the fraction of its parameters one tp rank holds, when the
    parameters whose ids are in `split` are cut into `tp` parts and the rest stay whole.
    Each parameter belongs to the deepest unit whose module contains it."""
    prefixes = sorted(((m, u.fqn) for u in plan.units for m in u.modules), key=lambda x: -len(x[0]))
    whole: dict[str, int] = {}
    held: dict[str, float] = {}
    for name, p in model.named_parameters():
        fqn = next((f for m, f in prefixes if not m or name.startswith(f"{m}.")), "")
        whole[fqn] = whole.get(fqn, 0) + p.numel()
        held[fqn] = held.get(fqn, 0.0) + p.numel() / (tp if id(p) in split else 1)
    return {f: held[f] / whole[f] for f in whole if whole[f]}


def estimate_memory(
    plan: WrapPlan,
    world_size: int,
    *,
    optimizer: str = "adamw",
    compute_dtype_bytes: int | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    tp: int = 1,
    tp_share: dict[str, float] | None = None,
    muon: MuonShares | None = None,
) -> list[MemoryEstimate]:
    """An estimate per strategy that fits `world_size` (hybrid needs a 2-D mesh).

    Parameters and gradients are counted in their stored dtype, optimizer state in fp32
    (`OPTIMIZER_STATES[optimizer]` tensors per trainable parameter). With `tp > 1`,
    `tp_share` (from `tp_shares`) says what fraction of each unit one tp rank holds; the
    strategy then shards that over the world_size // tp data-parallel ranks (ddp is not
    offered with tp). `optimizer="muon"` needs `muon` (`muon_shares(model)`): one state per
    matrix element, the fallback's for the rest, and the step's temporaries.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"estimate_memory(optimizer={optimizer!r}): use one of {sorted(OPTIMIZER_STATES)}."
        )
    if optimizer == "muon" and muon is None:
        raise ValueError(
            "estimate_memory(optimizer='muon') needs muon=muon_shares(model): which "
            "parameters are matrices (one state each) and which go to the fallback."
        )
    if optimizer == "muon" and tp > 1:
        raise NotImplementedError(
            "estimate_memory(optimizer='muon', tp>1): Muon's memory under tp is not "
            "planned yet; plan the layout without tp, or with optimizer='adamw'."
        )
    if tp > 1 and tp_share is None:
        raise ValueError("estimate_memory(tp>1) needs tp_share: see tp_shares().")
    share = {u.fqn: (tp_share or {}).get(u.fqn, 1.0) for u in plan.units}
    states = OPTIMIZER_STATES[optimizer]
    stored = sum(sum(u.bytes_by_dtype.values()) * share[u.fqn] for u in plan.units)
    trainable = sum(u.trainable_params * share[u.fqn] for u in plan.units)
    trainable_bytes = sum(round(u.trainable_bytes * share[u.fqn]) for u in plan.units)
    whole = sum(u.whole_bytes for u in plan.units)

    def compute_bytes(by_dtype: dict[str, int]) -> int:
        # FSDP2 casts floating parameters to the compute dtype; integer ones (4-bit codes
        # stored as uint8) are gathered as they are.
        if not compute_dtype_bytes:
            return sum(by_dtype.values())
        return sum(
            n // dtype_bytes(k) * compute_dtype_bytes if k in _DTYPE_BYTES else n
            for k, n in by_dtype.items()
        )

    units = [round(compute_bytes(u.bytes_by_dtype) * share[u.fqn]) for u in plan.units]
    root = units[-1] if units else 0
    last = plan.units[-1] if plan.units else None
    root_numel = round(last.trainable_params * share[last.fqn]) if last else 0
    root_grads = round(last.trainable_bytes * share[last.fqn]) if last else 0
    root_width = compute_dtype_bytes or (
        last.trainable_bytes / last.trainable_params if last and last.trainable_params else 4
    )
    largest = max(units[:-1], default=0)
    # FSDP2 reduce-scatters the gradients of trainable parameters only (a frozen base has none).
    largest_numel = max(
        (round(u.trainable_params * share[u.fqn]) for u in plan.units[:-1]), default=0
    )
    out = []
    for strategy in strategies:
        if tp > 1 and strategy == "ddp":
            continue  # DDP cannot hold tp's DTensors (no_shard replicates instead)
        try:
            spec = resolve_mesh(strategy, -1, world_size, tp=tp)
        except ValueError:
            continue  # e.g. hybrid at a world size with no 2-D mesh
        shard = spec.dp_shard
        sharded = strategy != "ddp" and shard > 1
        if strategy == "ddp" or world_size == 1:
            gathered = 0  # DDP computes on its full replica; one process wraps nothing
        elif sharded and spec.reshard_after_forward:
            gathered = largest + root
        else:  # FSDP keeps unsharded copies even over one shard rank (no_shard)
            gathered = sum(units)
        out.append(
            MemoryEstimate(
                strategy=strategy,
                world_size=world_size,
                dp_replicate=spec.dp_replicate,
                dp_shard=shard,
                params=-(-round(stored) // shard) + whole,
                grads=-(-trainable_bytes // shard),
                optimizer=(
                    muon_state_bytes(muon, trainable, shard)
                    if muon is not None and optimizer == "muon"
                    else -(-round(trainable * 4 * states) // shard)
                ),
                gathered=gathered,
                unit_buffers=(
                    (largest if spec.reshard_after_forward else 0) + 4 * largest_numel
                    if sharded
                    else 0
                ),
                root_gather=root if sharded and spec.reshard_after_forward else 0,
                root_reduce=(
                    round(root_numel * (root_width + 4)) - -(-root_grads // shard) if sharded else 0
                ),
                step_temporaries=(
                    muon_step_bytes(muon, world_size, shard, strategy == "ddp")
                    if muon is not None and optimizer == "muon"
                    else None
                ),
            )
        )
    return out


def format_memory(estimates: list[MemoryEstimate]) -> str:
    header = (
        f"{'strategy':<20} {'mesh':>7} {'params':>12} {'grads':>12} {'optimizer':>12} "
        f"{'model states':>13} {'+ gathered':>12} {'peak':>12}"
    )
    lines = ["per-rank memory (model states; activations not included)", header, "-" * len(header)]
    for e in estimates:
        sizes = [e.params, e.grads, e.optimizer, e.model_states, e.gathered, e.peak]
        widths = [12, 12, 12, 13, 12, 12]
        cells = " ".join(f"{format_bytes(n):>{w}}" for n, w in zip(sizes, widths, strict=True))
        lines.append(f"{e.strategy:<20} {f'{e.dp_replicate}x{e.dp_shard}':>7} {cells}")
    steps = [(e.strategy, e.step_temporaries) for e in estimates if e.step_temporaries is not None]
    if steps:
        shown = ", ".join(f"{name} {format_bytes(n)}" for name, n in steps)
        lines.append(f"Muon's step temporaries on its busiest owner (transient): {shown}")
    return "\n".join(lines)


def memory_json(estimates: list[MemoryEstimate]) -> str:
    return json.dumps(
        [{**asdict(e), "model_states": e.model_states, "peak": e.peak} for e in estimates], indent=2
    )


def dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES.get(name, 4)


@dataclass(frozen=True)
class PeakEstimate:
    """The instant per-rank peak: model states plus traced activations, at the larger of
    five moments of a step. `start_of_backward`: every kept activation, plus the loss's
    gradient (twice the largest saved tensor: the logits' gradient and its cast).
    `recompute`: a checkpointed block's activations back during its backward, with
    FSDP's prefetch and reduce-scatter buffers. `root_gather`: the root unit's all-gather
    buffer beside its gathered parameters, as the forward starts. `root_reduce`: the root
    unit's gradients unsharded and in fp32 for its reduce-scatter, every other gradient
    sharded. `optimizer_step`: all gradients present, plus the update's gradient-sized
    temporaries (AdamW's foreach kernels): two over DDP's plain tensors, one over FSDP's
    DTensors, as the simulation measures them, or Muon's (`states.step_temporaries`). DDP
    adds its buckets (one copy of the gradients) throughout."""

    states: MemoryEstimate
    activations: int
    recompute: int
    loss_grads: int
    ddp_buckets: int

    @property
    def phases(self) -> dict[str, int]:
        s = self.states
        held = s.params + s.optimizer + self.ddp_buckets
        ddp = s.strategy == "ddp"
        step = (2 if ddp else 1) * s.grads if s.step_temporaries is None else s.step_temporaries
        return {
            "start_of_backward": held + s.gathered + self.activations + self.loss_grads,
            "recompute": held + s.gathered + s.unit_buffers + self.activations + self.recompute,
            "root_gather": held + s.gathered + s.root_gather,
            "root_reduce": held + s.grads + s.root_reduce,
            "optimizer_step": held + s.grads + step,
        }

    @property
    def peak(self) -> int:
        return max(self.phases.values())


def estimate_peak(states: MemoryEstimate, trace: ActivationTrace, every: int) -> PeakEstimate:
    """Combine `estimate_memory`'s model states with a `trace_activations` trace, for
    activation checkpointing of every `every`-th planned block (0: none)."""
    return PeakEstimate(
        states=states,
        activations=trace.activations(every),
        recompute=trace.recompute(every),
        loss_grads=2 * trace.largest,
        ddp_buckets=states.grads if states.strategy == "ddp" else 0,
    )
